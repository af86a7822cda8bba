//! `pythonic` (Llama 3.2, Llama 4): a Python list of calls with keyword arguments,
//! `[get_weather(city="Paris"), get_time()]`, optionally inside
//! `<|python_start|>`/`<|python_end|>`.

use super::{content_only, hold_if_starts_like, ParsedOutput, ParsedToolCall, Spec};
use serde_json::{Map, Number, Value};

const PYTHON_START: &str = "<|python_start|>";
const PYTHON_END: &str = "<|python_end|>";

/// Bounds nesting in the Python-literal parser so hostile output such as
/// `[f(a=[[[[...` cannot overflow the stack (serde_json has its own limit).
const MAX_PY_DEPTH: usize = 64;

pub(super) fn parse(text: &str) -> ParsedOutput {
    match parse_pythonic_calls(text) {
        Some(calls) => ParsedOutput {
            content: None,
            calls,
        },
        None => content_only(text),
    }
}

pub(super) const SPEC: Spec = Spec {
    name: "pythonic",
    parse,
    hold_from,
    plain: None,
};

pub(super) fn hold_from(text: &str) -> usize {
    hold_if_starts_like(text, '[', PYTHON_START)
}

fn parse_pythonic_calls(text: &str) -> Option<Vec<ParsedToolCall>> {
    let trimmed = text.trim();
    let trimmed = trimmed.strip_prefix(PYTHON_START).unwrap_or(trimmed).trim();
    let trimmed = trimmed.strip_suffix(PYTHON_END).unwrap_or(trimmed);
    let mut parser = PyParser {
        src: trimmed,
        pos: 0,
        depth: 0,
    };
    parser.call_list()
}

/// Recursive-descent reader for the subset of Python the pythonic format
/// uses: a list of calls whose keyword arguments are literals. It accepts
/// what `ast.literal_eval` would, except values JSON cannot hold (bytes,
/// sets, non-string dict keys, non-finite floats), which reject the output.
///
/// `pos` only ever advances by whole chars, so slicing at it is safe; every
/// method returns `None` on the first thing that is not valid, and the caller
/// then treats the whole output as content.
struct PyParser<'a> {
    src: &'a str,
    pos: usize,
    depth: usize,
}

impl<'a> PyParser<'a> {
    fn rest(&self) -> &'a str {
        self.src.get(self.pos..).unwrap_or("")
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += c.len_utf8();
            true
        } else {
            false
        }
    }

    fn skip_ws(&mut self) {
        // Everything sits inside the outer brackets, where Python lets
        // expressions span lines.
        while let Some(c @ (' ' | '\t' | '\n' | '\r' | '\x0c')) = self.peek() {
            self.pos += c.len_utf8();
        }
    }

    /// The whole input as `[call, ...]` with at least one call.
    fn call_list(&mut self) -> Option<Vec<ParsedToolCall>> {
        self.skip_ws();
        if !self.eat('[') {
            return None;
        }
        let mut calls = Vec::new();
        self.sequence(']', |p| {
            calls.push(p.call()?);
            Some(())
        })?;
        self.skip_ws();
        (self.rest().is_empty() && !calls.is_empty()).then_some(calls)
    }

    /// Items separated by commas up to `close`, a trailing comma allowed;
    /// the opener is already consumed. Returns the item count and whether a
    /// comma was seen, which tells `(x)` from the one-tuple `(x,)`.
    fn sequence(
        &mut self,
        close: char,
        mut item: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<(usize, bool)> {
        self.skip_ws();
        if self.eat(close) {
            return Some((0, false));
        }
        let mut count = 0;
        let mut comma = false;
        loop {
            item(self)?;
            count += 1;
            self.skip_ws();
            if self.eat(close) {
                return Some((count, comma));
            }
            if !self.eat(',') {
                return None;
            }
            comma = true;
            self.skip_ws();
            if self.eat(close) {
                return Some((count, comma));
            }
        }
    }

    fn call(&mut self) -> Option<ParsedToolCall> {
        self.skip_ws();
        let name = self.dotted_name()?;
        self.skip_ws();
        if !self.eat('(') {
            return None;
        }
        let mut arguments = Map::new();
        self.sequence(')', |p| {
            p.skip_ws();
            // Only `name=value`: a positional argument has no parameter name
            // to put in the JSON object, so it is not a tool call.
            let key = p.identifier()?;
            p.skip_ws();
            if !p.eat('=') || p.peek() == Some('=') || arguments.contains_key(&key) {
                return None;
            }
            let value = p.value()?;
            arguments.insert(key, value);
            Some(())
        })?;
        Some(ParsedToolCall {
            name,
            arguments: Value::Object(arguments).to_string(),
        })
    }

    fn dotted_name(&mut self) -> Option<String> {
        let mut name = self.identifier()?;
        while self.peek() == Some('.') {
            self.pos += 1;
            name.push('.');
            name.push_str(&self.identifier()?);
        }
        Some(name)
    }

    fn identifier(&mut self) -> Option<String> {
        let first = self.peek()?;
        if !(first == '_' || first.is_alphabetic()) {
            return None;
        }
        let mut ident = String::new();
        while let Some(c) = self.peek() {
            if c == '_' || c.is_alphanumeric() {
                ident.push(c);
                self.pos += c.len_utf8();
            } else {
                break;
            }
        }
        (!matches!(ident.as_str(), "True" | "False" | "None")).then_some(ident)
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_ws();
        if self.string_start().is_some() {
            return self.strings();
        }
        match self.peek()? {
            '[' | '(' | '{' => {
                self.depth += 1;
                if self.depth > MAX_PY_DEPTH {
                    return None;
                }
                let value = self.container();
                self.depth -= 1;
                value
            }
            '-' | '+' | '.' | '0'..='9' => self.number(),
            c if c == '_' || c.is_alphabetic() => {
                let start = self.pos;
                while let Some(c) = self.peek() {
                    if c == '_' || c.is_alphanumeric() {
                        self.pos += c.len_utf8();
                    } else {
                        break;
                    }
                }
                match self.src.get(start..self.pos)? {
                    "True" => Some(Value::Bool(true)),
                    "False" => Some(Value::Bool(false)),
                    "None" => Some(Value::Null),
                    // A variable or call is not a literal.
                    _ => None,
                }
            }
            _ => None,
        }
    }

    fn container(&mut self) -> Option<Value> {
        match self.bump()? {
            '[' => {
                let mut items = Vec::new();
                self.sequence(']', |p| {
                    items.push(p.value()?);
                    Some(())
                })?;
                Some(Value::Array(items))
            }
            '(' => {
                let mut items = Vec::new();
                let (count, comma) = self.sequence(')', |p| {
                    items.push(p.value()?);
                    Some(())
                })?;
                if count == 1 && !comma {
                    // `(x)` is just a parenthesized `x`.
                    items.pop()
                } else {
                    Some(Value::Array(items))
                }
            }
            '{' => {
                let mut map = Map::new();
                self.sequence('}', |p| {
                    let Value::String(key) = p.value()? else {
                        return None;
                    };
                    p.skip_ws();
                    if !p.eat(':') {
                        return None;
                    }
                    let value = p.value()?;
                    map.insert(key, value);
                    Some(())
                })?;
                Some(Value::Object(map))
            }
            _ => None,
        }
    }

    /// Whether a string literal starts here: `(raw, prefix length)`. Bytes
    /// and f-string prefixes are not recognized, so those values reject.
    fn string_start(&self) -> Option<(bool, usize)> {
        let mut chars = self.rest().chars();
        match chars.next()? {
            '"' | '\'' => Some((false, 0)),
            prefix @ ('r' | 'R' | 'u' | 'U') if matches!(chars.next(), Some('"' | '\'')) => {
                Some((matches!(prefix, 'r' | 'R'), 1))
            }
            _ => None,
        }
    }

    /// One or more adjacent string literals, which Python concatenates.
    fn strings(&mut self) -> Option<Value> {
        let mut out = String::new();
        while let Some((raw, prefix_len)) = self.string_start() {
            self.pos += prefix_len;
            self.string_body(raw, &mut out)?;
            self.skip_ws();
        }
        Some(Value::String(out))
    }

    fn string_body(&mut self, raw: bool, out: &mut String) -> Option<()> {
        let quote = self.bump()?;
        let closing_pair: String = [quote, quote].iter().collect();
        let triple = self.rest().starts_with(&closing_pair);
        if triple {
            self.pos += closing_pair.len();
        }
        loop {
            match self.bump()? {
                c if c == quote => {
                    if !triple {
                        return Some(());
                    }
                    if self.rest().starts_with(&closing_pair) {
                        self.pos += closing_pair.len();
                        return Some(());
                    }
                    out.push(c);
                }
                '\n' | '\r' if !triple => return None,
                '\\' if raw => {
                    // A raw string keeps the backslash, but it still stops
                    // the next char (even a quote) from ending the literal.
                    out.push('\\');
                    out.push(self.bump()?);
                }
                '\\' => self.escape(out)?,
                c => out.push(c),
            }
        }
    }

    fn escape(&mut self, out: &mut String) -> Option<()> {
        let c = self.bump()?;
        let decoded = match c {
            // Backslash-newline continues the literal on the next line.
            '\n' => return Some(()),
            '\r' => {
                self.eat('\n');
                return Some(());
            }
            '\\' | '\'' | '"' => c,
            'n' => '\n',
            't' => '\t',
            'r' => '\r',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'v' => '\u{b}',
            'a' => '\u{7}',
            '0'..='7' => {
                let mut code = c.to_digit(8)?;
                for _ in 0..2 {
                    match self.peek().and_then(|d| d.to_digit(8)) {
                        Some(digit) => {
                            code = code * 8 + digit;
                            self.pos += 1;
                        }
                        None => break,
                    }
                }
                char::from_u32(code)?
            }
            'x' => self.hex_char(2)?,
            'u' => self.hex_char(4)?,
            'U' => self.hex_char(8)?,
            // `\N{NAME}` needs the Unicode name table; reject rather than guess.
            'N' => return None,
            // Python keeps unknown escapes such as `\d` verbatim.
            other => {
                out.push('\\');
                other
            }
        };
        out.push(decoded);
        Some(())
    }

    /// Exactly `digits` hex digits naming a Unicode scalar value; lone
    /// surrogates, which a Rust string cannot hold, reject.
    fn hex_char(&mut self, digits: usize) -> Option<char> {
        let mut code: u32 = 0;
        for _ in 0..digits {
            let digit = self.bump()?.to_digit(16)?;
            code = code.checked_mul(16)?.checked_add(digit)?;
        }
        char::from_u32(code)
    }

    fn number(&mut self) -> Option<Value> {
        let mut negative = false;
        loop {
            self.skip_ws();
            if self.eat('-') {
                negative = !negative;
            } else if !self.eat('+') {
                break;
            }
        }
        let radix = match self.rest().get(..2) {
            Some("0x" | "0X") => Some(16),
            Some("0o" | "0O") => Some(8),
            Some("0b" | "0B") => Some(2),
            _ => None,
        };
        if let Some(radix) = radix {
            self.pos += 2;
            let digits = self.take_while(|c| c.is_ascii_alphanumeric() || c == '_');
            let magnitude = u128::from_str_radix(&digits, radix).ok()?;
            return int_value(negative, magnitude);
        }
        let mut token = self.take_while(|c| c.is_ascii_digit() || c == '_');
        let mut is_float = false;
        if self.eat('.') {
            is_float = true;
            token.push('.');
            token.push_str(&self.take_while(|c| c.is_ascii_digit() || c == '_'));
        }
        if let Some(e @ ('e' | 'E')) = self.peek() {
            self.pos += 1;
            is_float = true;
            token.push(e);
            if let Some(sign @ ('+' | '-')) = self.peek() {
                self.pos += 1;
                token.push(sign);
            }
            token.push_str(&self.take_while(|c| c.is_ascii_digit() || c == '_'));
        }
        // `1abc`, `1.2.3` or a complex `1j` are not numbers JSON can hold.
        if self
            .peek()
            .is_some_and(|c| c == '_' || c == '.' || c.is_alphanumeric())
        {
            return None;
        }
        if is_float {
            let magnitude: f64 = token.parse().ok()?;
            let value = if negative { -magnitude } else { magnitude };
            return Number::from_f64(value).map(Value::Number);
        }
        match token.parse::<u128>() {
            Ok(magnitude) => int_value(negative, magnitude),
            // Too many digits for u128: Python ints are unbounded, JSON
            // numbers are not, so fall back to the nearest float.
            Err(_) if !token.is_empty() => {
                let magnitude: f64 = token.parse().ok()?;
                let value = if negative { -magnitude } else { magnitude };
                Number::from_f64(value).map(Value::Number)
            }
            Err(_) => None,
        }
    }

    /// The chars matching `keep`, without underscores (Python's digit
    /// separators).
    fn take_while(&mut self, keep: impl Fn(char) -> bool) -> String {
        let mut taken = String::new();
        while let Some(c) = self.peek() {
            if !keep(c) {
                break;
            }
            if c != '_' {
                taken.push(c);
            }
            self.pos += c.len_utf8();
        }
        taken
    }
}

/// An integer as a JSON number: exact within i64/u64, else the nearest float.
fn int_value(negative: bool, magnitude: u128) -> Option<Value> {
    if negative {
        if let Some(exact) = i128::try_from(magnitude)
            .ok()
            .and_then(|m| i64::try_from(-m).ok())
        {
            return Some(Value::from(exact));
        }
    } else if let Ok(exact) = u64::try_from(magnitude) {
        return Some(Value::from(exact));
    }
    let approx = magnitude as f64;
    Number::from_f64(if negative { -approx } else { approx }).map(Value::Number)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;

    use super::MAX_PY_DEPTH;

    /// The value of argument `x` in `[f(x=<literal>)]`.
    fn py(literal: &str) -> Option<Value> {
        let output = Pythonic.parse(&format!("[f(x={literal})]"));
        let (_, arguments) = calls(&output).pop()?;
        arguments.get("x").cloned()
    }

    #[test]
    fn pythonic_reads_a_single_call_with_keyword_arguments() {
        let output = Pythonic.parse("[get_weather(city=\"San Francisco\", metric=\"celsius\")]");
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call(
                "get_weather",
                json!({"city": "San Francisco", "metric": "celsius"})
            )]
        );
    }

    #[test]
    fn pythonic_reads_parallel_calls_including_one_without_arguments() {
        let output = Pythonic.parse("[get_weather(city='Paris'), get_time()]");
        assert_eq!(
            calls(&output),
            [
                call("get_weather", json!({"city": "Paris"})),
                call("get_time", json!({}))
            ]
        );
        assert_eq!(output.calls[1].arguments, "{}");
    }

    #[test]
    fn pythonic_accepts_llama4_tags_whitespace_and_dotted_names() {
        let output = Pythonic.parse(
            "\n<|python_start|>[\n  tools.search.run(\n    query=\"x\",\n  ),\n]<|python_end|>\n",
        );
        assert_eq!(
            calls(&output),
            [call("tools.search.run", json!({"query": "x"}))]
        );
    }

    #[test]
    fn pythonic_text_around_the_list_makes_it_all_content() {
        assert_all_content(Pythonic, "Sure: [get_time()]");
        assert_all_content(Pythonic, "[get_time()] done");
        assert_all_content(Pythonic, "Plain answer.");
    }

    #[test]
    fn pythonic_rejects_what_is_not_a_list_of_keyword_calls() {
        assert_all_content(Pythonic, "[get_weather(\"Paris\")]");
        assert_all_content(Pythonic, "[f(a=1, a=2)]");
        assert_all_content(Pythonic, "[f(a=x)]");
        assert_all_content(Pythonic, "[f(a=g())]");
        assert_all_content(Pythonic, "[f(a==1)]");
        assert_all_content(Pythonic, "[f(**kw)]");
        assert_all_content(Pythonic, "[1, 2]");
        assert_all_content(Pythonic, "[]");
        assert_all_content(Pythonic, "[f(a=1) g(b=2)]");
        assert_all_content(Pythonic, "[f(a=1),, g()]");
        assert_all_content(Pythonic, "[f(a=b'x')]");
        assert_all_content(Pythonic, "[f(a={1, 2})]");
        assert_all_content(Pythonic, "[f(a={1: 2})]");
    }

    #[test]
    fn pythonic_truncated_output_is_all_content() {
        assert_all_content(Pythonic, "[get_weather(city=\"San Fr");
        assert_all_content(Pythonic, "[get_weather(city=\"Paris\")");
        assert_all_content(Pythonic, "[get_weather(city=");
    }

    #[test]
    fn pythonic_literal_numbers() {
        assert_eq!(py("42"), Some(json!(42)));
        assert_eq!(py("-7"), Some(json!(-7)));
        assert_eq!(py("1_000"), Some(json!(1000)));
        assert_eq!(py("0x1F"), Some(json!(31)));
        assert_eq!(py("-2.5"), Some(json!(-2.5)));
        assert_eq!(py("-1.5e-3"), Some(json!(-0.0015)));
        assert_eq!(py("1E3"), Some(json!(1000.0)));
        assert_eq!(py(".5"), Some(json!(0.5)));
        assert_eq!(py("5."), Some(json!(5.0)));
        assert_eq!(py("- 3"), Some(json!(-3)));
        assert_eq!(py("-9223372036854775808"), Some(json!(i64::MIN)));
        assert_eq!(py("18446744073709551615"), Some(json!(u64::MAX)));
        assert_eq!(
            py("18446744073709551616"),
            Some(json!(18446744073709551616.0))
        );
        assert_eq!(py("1e999"), None);
        assert_eq!(py("1j"), None);
        assert_eq!(py("1.2.3"), None);
        assert_eq!(py("."), None);
        assert_eq!(py("1e"), None);
    }

    #[test]
    fn pythonic_literal_constants() {
        assert_eq!(py("True"), Some(json!(true)));
        assert_eq!(py("False"), Some(json!(false)));
        assert_eq!(py("None"), Some(json!(null)));
        assert_eq!(py("true"), None);
        assert_eq!(py("null"), None);
    }

    #[test]
    fn pythonic_literal_strings_and_escapes() {
        assert_eq!(py(r#""it's""#), Some(json!("it's")));
        assert_eq!(py(r#"'say "hi"'"#), Some(json!("say \"hi\"")));
        assert_eq!(py(r#"'a\'b'"#), Some(json!("a'b")));
        assert_eq!(
            py(r#""line\nnext\ttab\\""#),
            Some(json!("line\nnext\ttab\\"))
        );
        assert_eq!(py(r#""\x41\u00e9\U0001F600\101""#), Some(json!("Aé😀A")));
        assert_eq!(py(r#""\d""#), Some(json!("\\d")));
        assert_eq!(py(r#"r"\d\"""#), Some(json!("\\d\\\"")));
        assert_eq!(py(r#"u"x""#), Some(json!("x")));
        assert_eq!(py(r#""a" 'b'"#), Some(json!("ab")));
        assert_eq!(py("'''multi\nline'''"), Some(json!("multi\nline")));
        assert_eq!(py("\"\""), Some(json!("")));
        assert_eq!(py("\"日本語\""), Some(json!("日本語")));
        assert_eq!(py("\"open\nline\""), None);
        assert_eq!(py(r#""\ud800""#), None);
        assert_eq!(py(r#""\x4""#), None);
        assert_eq!(py("\"unterminated"), None);
    }

    #[test]
    fn pythonic_literal_containers() {
        assert_eq!(
            py("[1, [2, 'x'], {'k': [None, True]}]"),
            Some(json!([1, [2, "x"], {"k": [null, true]}]))
        );
        assert_eq!(
            py("{'a': {'b': (1, 2.0)}, \"c\": [],}"),
            Some(json!({"a": {"b": [1, 2.0]}, "c": []}))
        );
        assert_eq!(py("()"), Some(json!([])));
        assert_eq!(py("(1,)"), Some(json!([1])));
        assert_eq!(py("(1)"), Some(json!(1)));
        assert_eq!(py("[1, 2,]"), Some(json!([1, 2])));
        assert_eq!(py("{}"), Some(json!({})));
        assert_eq!(py("[1 2]"), None);
        assert_eq!(py("{'a' 1}"), None);
    }

    #[test]
    fn pythonic_rejects_nesting_beyond_the_depth_limit() {
        let deep = format!(
            "{}{}",
            "[".repeat(MAX_PY_DEPTH + 1),
            "]".repeat(MAX_PY_DEPTH + 1)
        );
        assert_eq!(py(&deep), None);
        let ok = format!("{}{}", "[".repeat(MAX_PY_DEPTH), "]".repeat(MAX_PY_DEPTH));
        assert!(py(&ok).is_some());
    }

    #[test]
    fn pythonic_holds_while_the_output_may_still_be_a_call() {
        assert_eq!(Pythonic.hold_from(""), 0);
        assert_eq!(Pythonic.hold_from("\n["), 0);
        assert_eq!(Pythonic.hold_from("[get_wea"), 0);
        assert_eq!(Pythonic.hold_from("<|python_st"), 0);
        assert_eq!(Pythonic.hold_from("<|python_start|>[f("), 0);
        assert_eq!(Pythonic.hold_from("Sure"), 4);
        assert_eq!(Pythonic.hold_from("<p>"), 3);
    }
}
