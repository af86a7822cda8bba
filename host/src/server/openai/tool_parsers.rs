//! Extraction of OpenAI tool calls from generated text, for `tool_choice: "auto"`.
//!
//! Models that were trained for tool use write their calls into the ordinary
//! output in a model-specific format. The server is told which one with
//! `--tool-call-parser`, and this module turns a generation into the message
//! content the user sees plus a list of `tool_calls`. The accepted formats are
//! those of vLLM's parsers of the same names, so that deployments can switch
//! servers without changing flags:
//!
//! - `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.
//! - `llama3_json` (Llama 3.1/3.2): one or more `;`-separated JSON objects,
//!   optionally after `<|python_tag|>`.
//! - `mistral`: `[TOOL_CALLS]` followed by a JSON array of calls, or by
//!   `name[ARGS]{...}` (newer tokenizers).
//! - `pythonic` (Llama 3.2, Llama 4): a Python list of calls with keyword arguments,
//!   `[get_weather(city="Paris"), get_time()]`.
//!
//! Model output is untrusted, so nothing here panics, and text that does not
//! form a well-formed call is handed back as content rather than dropped.
//!
//! Streaming uses two steps: while tokens arrive,
//! [`ToolCallParser::hold_from`] says how much of the text so far can safely
//! go out as content; once generation ends, [`ToolCallParser::parse`] splits
//! the complete text.

use serde_json::{Map, Number, Value};

/// Which format the model writes tool calls in (`--tool-call-parser`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallParser {
    /// `<tool_call>` blocks holding one JSON call each (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// Bare JSON calls separated by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2).
    Llama3Json,
    /// `[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{...}` per call (Mistral).
    Mistral,
    /// A Python list of keyword-argument calls, optionally inside
    /// `<|python_start|>`/`<|python_end|>` (Llama 3.2, Llama 4).
    Pythonic,
}

/// One tool call found in the output.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedToolCall {
    /// The function's name as the model wrote it.
    pub name: String,
    /// The arguments as a JSON object serialized compactly (serde_json::to_string of a Value).
    pub arguments: String,
}

/// A complete generation split into what the user reads and what the tools get.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ParsedOutput {
    /// Text outside the tool calls, trimmed; None if empty (OpenAI sends content null when a message only calls tools).
    pub content: Option<String>,
    /// The calls in the order the model wrote them; empty when the output
    /// holds no well-formed call, in which case `content` is the whole output.
    pub calls: Vec<ParsedToolCall>,
}

const HERMES_START: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";
const MISTRAL_MARKER: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";
const PYTHON_START: &str = "<|python_start|>";
const PYTHON_END: &str = "<|python_end|>";

/// Bounds nesting in the Python-literal parser so hostile output such as
/// `[f(a=[[[[...` cannot overflow the stack (serde_json has its own limit).
const MAX_PY_DEPTH: usize = 64;

impl ToolCallParser {
    /// The names, for help texts and errors.
    pub const NAMES: &'static [&'static str] = &["hermes", "llama3_json", "mistral", "pythonic"];

    /// Parses a `--tool-call-parser` value ("hermes", "llama3_json", "mistral", "pythonic"); the error message lists the known names.
    pub fn from_name(name: &str) -> Result<ToolCallParser, String> {
        match name {
            "hermes" => Ok(ToolCallParser::Hermes),
            "llama3_json" => Ok(ToolCallParser::Llama3Json),
            "mistral" => Ok(ToolCallParser::Mistral),
            "pythonic" => Ok(ToolCallParser::Pythonic),
            _ => Err(format!(
                "unknown tool call parser {name:?}; known parsers: {}",
                Self::NAMES.join(", ")
            )),
        }
    }

    /// The `--tool-call-parser` value that selects this parser.
    pub fn name(self) -> &'static str {
        match self {
            ToolCallParser::Hermes => "hermes",
            ToolCallParser::Llama3Json => "llama3_json",
            ToolCallParser::Mistral => "mistral",
            ToolCallParser::Pythonic => "pythonic",
        }
    }

    /// Splits the complete output into the text the user sees and the tool calls.
    ///
    /// Never fails: output that is not a well-formed call in this parser's
    /// format comes back as content, so no generated text is lost.
    pub fn parse(self, text: &str) -> ParsedOutput {
        match self {
            ToolCallParser::Hermes => parse_hermes(text),
            ToolCallParser::Llama3Json => match parse_llama3_calls(text) {
                Some(calls) => ParsedOutput {
                    content: None,
                    calls,
                },
                None => content_only(text),
            },
            ToolCallParser::Mistral => parse_mistral(text),
            ToolCallParser::Pythonic => match parse_pythonic_calls(text) {
                Some(calls) => ParsedOutput {
                    content: None,
                    calls,
                },
                None => content_only(text),
            },
        }
    }

    /// For streaming: the byte offset in `text` (text generated so far) from which output must be held back because a tool call has started or may be starting (a prefix of the start marker at the end of text counts as "may be starting"). `text.len()` means everything so far can be sent as content.
    ///
    /// The result is always a char boundary of `text`. Marker formats
    /// (`hermes`, `mistral`) hold from the first marker, or from a partial
    /// marker at the very end. Formats whose calls fill the whole output
    /// (`llama3_json`, `pythonic`) hold everything while the output is empty
    /// or starts like a call, and nothing once it clearly does not.
    pub fn hold_from(self, text: &str) -> usize {
        match self {
            ToolCallParser::Hermes => hold_from_marker(text, HERMES_START),
            ToolCallParser::Mistral => hold_from_marker(text, MISTRAL_MARKER),
            ToolCallParser::Llama3Json => hold_if_starts_like(text, '{', LLAMA_PYTHON_TAG),
            ToolCallParser::Pythonic => hold_if_starts_like(text, '[', PYTHON_START),
        }
    }
}

/// The whole text as content, for outputs that hold no call.
fn content_only(text: &str) -> ParsedOutput {
    ParsedOutput {
        content: non_empty_trimmed(text),
        calls: Vec::new(),
    }
}

fn non_empty_trimmed(text: &str) -> Option<String> {
    let trimmed = text.trim();
    (!trimmed.is_empty()).then(|| trimmed.to_string())
}

fn hold_from_marker(text: &str, marker: &str) -> usize {
    if let Some(start) = text.find(marker) {
        return start;
    }
    // Longest first, so that "<tool" holds from "<" rather than from nowhere.
    // The markers are ASCII, so the matched suffix starts on a char boundary.
    (1..marker.len())
        .rev()
        .find(|&len| marker.get(..len).is_some_and(|p| text.ends_with(p)))
        .map_or(text.len(), |len| text.len().saturating_sub(len))
}

fn hold_if_starts_like(text: &str, opener: char, tag: &str) -> usize {
    let trimmed = text.trim_start();
    // `tag.starts_with("")` also holds the empty and all-whitespace text:
    // the model has not yet shown whether it answers or calls.
    if trimmed.starts_with(opener) || trimmed.starts_with(tag) || tag.starts_with(trimmed) {
        0
    } else {
        text.len()
    }
}

/// Reads one JSON value from the start of `text` (after whitespace) and
/// returns it with the byte offset just past it.
fn json_prefix(text: &str) -> Option<(Value, usize)> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    match values.next() {
        Some(Ok(value)) => Some((value, values.byte_offset())),
        _ => None,
    }
}

/// Reads `{"name": ..., "arguments": {...}}`, the shape shared by the JSON
/// formats; Llama 3 templates name the arguments `parameters`.
fn call_from_json(value: &Value) -> Option<ParsedToolCall> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = match object.get("arguments") {
        Some(Value::Null) | None => object.get("parameters"),
        some => some,
    };
    Some(ParsedToolCall {
        name: name.to_string(),
        arguments: arguments_json(arguments)?,
    })
}

/// Normalizes arguments to a compact JSON object, the form OpenAI clients
/// `JSON.parse`; some models already write them as a JSON string.
fn arguments_json(arguments: Option<&Value>) -> Option<String> {
    match arguments {
        None | Some(Value::Null) => Some("{}".to_string()),
        Some(object @ Value::Object(_)) => Some(object.to_string()),
        Some(Value::String(encoded)) => match serde_json::from_str::<Value>(encoded) {
            Ok(object @ Value::Object(_)) => Some(object.to_string()),
            _ => None,
        },
        Some(_) => None,
    }
}

fn parse_hermes(text: &str) -> ParsedOutput {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some((before, after_start)) = rest.split_once(HERMES_START) {
        content.push_str(before);
        // An unclosed block runs to the end: generation may stop on the
        // end-of-turn token right after the JSON, before `</tool_call>`.
        let (body, after_block, closed) = match after_start.split_once(HERMES_END) {
            Some((body, after)) => (body, after, true),
            None => (after_start, "", false),
        };
        match serde_json::from_str::<Value>(body)
            .ok()
            .and_then(|value| call_from_json(&value))
        {
            Some(call) => calls.push(call),
            None => {
                content.push_str(HERMES_START);
                content.push_str(body);
                if closed {
                    content.push_str(HERMES_END);
                }
            }
        }
        rest = after_block;
    }
    content.push_str(rest);
    ParsedOutput {
        content: non_empty_trimmed(&content),
        calls,
    }
}

/// All or nothing, like vLLM: one stray character makes the whole output
/// content, since a partial reading could call a tool the model did not mean.
fn parse_llama3_calls(text: &str) -> Option<Vec<ParsedToolCall>> {
    let trimmed = text.trim_start();
    let mut rest = trimmed.strip_prefix(LLAMA_PYTHON_TAG).unwrap_or(trimmed);
    let mut calls = Vec::new();
    loop {
        let object_text = rest.trim_start();
        if !object_text.starts_with('{') {
            return None;
        }
        let (value, used) = json_prefix(object_text)?;
        calls.push(call_from_json(&value)?);
        let after = object_text.get(used..)?.trim_start();
        if after.is_empty() {
            return Some(calls);
        }
        rest = after.strip_prefix(';')?;
        if rest.trim().is_empty() {
            return Some(calls);
        }
    }
}

fn parse_mistral(text: &str) -> ParsedOutput {
    let Some((before, after)) = text.split_once(MISTRAL_MARKER) else {
        return content_only(text);
    };
    let mut calls = Vec::new();
    for segment in after.split(MISTRAL_MARKER) {
        if parse_mistral_segment(segment, &mut calls).is_none() {
            return content_only(text);
        }
    }
    if calls.is_empty() {
        return content_only(text);
    }
    ParsedOutput {
        content: non_empty_trimmed(before),
        calls,
    }
}

/// One stretch after a `[TOOL_CALLS]`: a JSON array (or single object) of
/// calls in the older format, or `name[ARGS]{...}` in the newer one.
fn parse_mistral_segment(segment: &str, calls: &mut Vec<ParsedToolCall>) -> Option<()> {
    let segment = segment.trim();
    if segment.starts_with('[') || segment.starts_with('{') {
        match serde_json::from_str::<Value>(segment).ok()? {
            Value::Array(items) => {
                for item in &items {
                    calls.push(call_from_json(item)?);
                }
            }
            object => calls.push(call_from_json(&object)?),
        }
        return Some(());
    }
    let (name, arguments) = segment.split_once(MISTRAL_ARGS)?;
    let name = name.trim();
    if name.is_empty() || name.chars().any(char::is_whitespace) {
        return None;
    }
    let arguments = serde_json::from_str::<Value>(arguments).ok()?;
    calls.push(ParsedToolCall {
        name: name.to_string(),
        arguments: arguments_json(Some(&arguments))?,
    });
    Some(())
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
    use super::*;
    use serde_json::json;

    use ToolCallParser::{Hermes, Llama3Json, Mistral, Pythonic};

    const ALL: [ToolCallParser; 4] = [Hermes, Llama3Json, Mistral, Pythonic];

    /// The calls as `(name, arguments as a Value)`, so tests do not depend
    /// on serde_json's key order.
    fn calls(output: &ParsedOutput) -> Vec<(String, Value)> {
        output
            .calls
            .iter()
            .map(|call| {
                let arguments = serde_json::from_str(&call.arguments)
                    .unwrap_or_else(|e| panic!("arguments {:?}: {e}", call.arguments));
                (call.name.clone(), arguments)
            })
            .collect()
    }

    fn call(name: &str, arguments: Value) -> (String, Value) {
        (name.to_string(), arguments)
    }

    fn assert_all_content(parser: ToolCallParser, text: &str) {
        let output = parser.parse(text);
        assert!(
            output.calls.is_empty(),
            "{parser:?} found calls in {text:?}"
        );
        assert_eq!(output.content.as_deref(), Some(text.trim()), "{parser:?}");
    }

    /// The value of argument `x` in `[f(x=<literal>)]`.
    fn py(literal: &str) -> Option<Value> {
        let output = Pythonic.parse(&format!("[f(x={literal})]"));
        let (_, arguments) = calls(&output).pop()?;
        arguments.get("x").cloned()
    }

    // --- names ---

    #[test]
    fn every_listed_name_parses_back_to_its_parser() {
        for name in ToolCallParser::NAMES {
            let parser = ToolCallParser::from_name(name).unwrap();
            assert_eq!(parser.name(), *name);
        }
        assert_eq!(ToolCallParser::NAMES.len(), ALL.len());
    }

    #[test]
    fn an_unknown_name_is_an_error_listing_the_known_ones() {
        let err = ToolCallParser::from_name("qwen").unwrap_err();
        assert!(err.contains("\"qwen\""), "{err}");
        for name in ToolCallParser::NAMES {
            assert!(err.contains(name), "{err}");
        }
    }

    // --- hermes ---

    #[test]
    fn hermes_reads_a_single_call_and_leaves_no_content() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let output = Hermes.parse(text);
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("get_weather", json!({"city": "Paris"}))]
        );
        assert_eq!(output.calls[0].arguments, r#"{"city":"Paris"}"#);
    }

    #[test]
    fn hermes_reads_parallel_calls_in_order() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"n\": 1}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let output = Hermes.parse(text);
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("a", json!({"n": 1})), call("b", json!({}))]
        );
    }

    #[test]
    fn hermes_keeps_text_before_the_call_as_trimmed_content() {
        let text = "Let me check.\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let output = Hermes.parse(text);
        assert_eq!(output.content.as_deref(), Some("Let me check."));
        assert_eq!(calls(&output), [call("get_time", json!({}))]);
    }

    #[test]
    fn hermes_keeps_text_between_and_after_blocks() {
        let text = "A <tool_call>{\"name\": \"x\"}</tool_call> B <tool_call>{\"name\": \"y\"}</tool_call> C";
        let output = Hermes.parse(text);
        assert_eq!(output.content.as_deref(), Some("A  B  C"));
        assert_eq!(calls(&output), [call("x", json!({})), call("y", json!({}))]);
    }

    #[test]
    fn hermes_leaves_a_block_with_invalid_json_as_content() {
        let bad = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"n\": }\n</tool_call>";
        assert_all_content(Hermes, bad);

        let text =
            format!("{bad}\n<tool_call>{{\"name\": \"b\", \"arguments\": {{}}}}</tool_call>");
        let output = Hermes.parse(&text);
        assert_eq!(output.content.as_deref(), Some(bad));
        assert_eq!(calls(&output), [call("b", json!({}))]);
    }

    #[test]
    fn hermes_leaves_a_block_without_a_string_name_as_content() {
        assert_all_content(Hermes, "<tool_call>{\"arguments\": {}}</tool_call>");
        assert_all_content(Hermes, "<tool_call>{\"name\": 3}</tool_call>");
        assert_all_content(Hermes, "<tool_call>[1, 2]</tool_call>");
    }

    #[test]
    fn hermes_accepts_a_final_block_without_its_end_tag_if_the_json_is_complete() {
        let output =
            Hermes.parse("Sure. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1]}}\n");
        assert_eq!(output.content.as_deref(), Some("Sure."));
        assert_eq!(calls(&output), [call("f", json!({"a": [1]}))]);
    }

    #[test]
    fn hermes_keeps_a_truncated_call_as_content() {
        assert_all_content(Hermes, "Sure. <tool_call>\n{\"name\": \"f\", \"argum");
        assert_all_content(Hermes, "<tool_call>");
    }

    #[test]
    fn hermes_accepts_parameters_and_string_encoded_arguments() {
        let output =
            Hermes.parse("<tool_call>{\"name\": \"f\", \"parameters\": {\"a\": 1}}</tool_call>");
        assert_eq!(calls(&output), [call("f", json!({"a": 1}))]);

        let output =
            Hermes.parse(r#"<tool_call>{"name": "f", "arguments": "{\"a\": \"b\"}"}</tool_call>"#);
        assert_eq!(calls(&output), [call("f", json!({"a": "b"}))]);
        assert_eq!(output.calls[0].arguments, r#"{"a":"b"}"#);
    }

    #[test]
    fn hermes_rejects_arguments_that_are_not_an_object() {
        assert_all_content(
            Hermes,
            r#"<tool_call>{"name": "f", "arguments": "not json"}</tool_call>"#,
        );
        assert_all_content(
            Hermes,
            r#"<tool_call>{"name": "f", "arguments": [1]}</tool_call>"#,
        );
    }

    #[test]
    fn hermes_without_a_block_is_all_content() {
        assert_all_content(Hermes, "  The weather is fine.  ");
        assert_eq!(Hermes.parse(""), ParsedOutput::default());
        assert_eq!(Hermes.parse(" \n "), ParsedOutput::default());
    }

    #[test]
    fn hermes_holds_from_the_start_tag_or_a_partial_one_at_the_end() {
        assert_eq!(Hermes.hold_from("Hello"), 5);
        assert_eq!(Hermes.hold_from(""), 0);
        assert_eq!(Hermes.hold_from("Hi <tool_call>{\"na"), 3);
        assert_eq!(Hermes.hold_from("Hi <"), 3);
        assert_eq!(Hermes.hold_from("Hi <tool_cal"), 3);
        assert_eq!(Hermes.hold_from("a < b"), 5);
        assert_eq!(Hermes.hold_from("x<<tool"), 2);
        assert_eq!(Hermes.hold_from("é<tool_call>"), "é".len());
    }

    // --- llama3_json ---

    #[test]
    fn llama3_reads_a_single_call_with_parameters() {
        let output = Llama3Json.parse(
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 3}}",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("get_weather", json!({"city": "Paris", "days": 3}))]
        );
    }

    #[test]
    fn llama3_accepts_the_python_tag_and_arguments() {
        let output =
            Llama3Json.parse("\n<|python_tag|>{\"name\": \"f\", \"arguments\": {\"a\": true}}");
        assert_eq!(calls(&output), [call("f", json!({"a": true}))]);
    }

    #[test]
    fn llama3_reads_parallel_calls_separated_by_semicolons() {
        let output = Llama3Json.parse(
            "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": null}};",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("a", json!({})), call("b", json!({"x": null}))]
        );
    }

    #[test]
    fn llama3_text_before_the_json_makes_it_all_content() {
        assert_all_content(Llama3Json, "Calling: {\"name\": \"f\", \"parameters\": {}}");
        assert_all_content(Llama3Json, "The answer is 4.");
    }

    #[test]
    fn llama3_invalid_json_is_all_content() {
        assert_all_content(Llama3Json, "{\"name\": \"f\", \"parameters\": {a: 1}}");
        assert_all_content(Llama3Json, "{\"parameters\": {}}");
        assert_all_content(
            Llama3Json,
            "{\"name\": \"f\", \"parameters\": {}} trailing words",
        );
        assert_all_content(Llama3Json, "<|python_tag|>brave_search.call(query=\"x\")");
    }

    #[test]
    fn llama3_a_truncated_second_call_makes_it_all_content() {
        assert_all_content(
            Llama3Json,
            "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"para",
        );
    }

    #[test]
    fn llama3_holds_while_the_output_may_still_be_a_call() {
        assert_eq!(Llama3Json.hold_from(""), 0);
        assert_eq!(Llama3Json.hold_from("  "), 0);
        assert_eq!(Llama3Json.hold_from(" {\"na"), 0);
        assert_eq!(Llama3Json.hold_from("<|pyth"), 0);
        assert_eq!(Llama3Json.hold_from("<|python_tag|>{"), 0);
        assert_eq!(Llama3Json.hold_from("Hello"), 5);
        assert_eq!(Llama3Json.hold_from("<b>"), 3);
    }

    // --- mistral ---

    #[test]
    fn mistral_reads_a_json_array_call() {
        let output = Mistral.parse(
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [call("get_weather", json!({"city": "Paris"}))]
        );
    }

    #[test]
    fn mistral_reads_parallel_calls_from_one_array() {
        let output = Mistral.parse(
            "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"n\": 1.5}}, {\"name\": \"b\", \"arguments\": {}}]",
        );
        assert_eq!(
            calls(&output),
            [call("a", json!({"n": 1.5})), call("b", json!({}))]
        );
    }

    #[test]
    fn mistral_reads_the_newer_name_args_form_repeated() {
        let output = Mistral.parse(
            "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}",
        );
        assert_eq!(output.content, None);
        assert_eq!(
            calls(&output),
            [
                call("get_weather", json!({"city": "Paris"})),
                call("get_time", json!({}))
            ]
        );
    }

    #[test]
    fn mistral_keeps_text_before_the_marker_as_content() {
        let output =
            Mistral.parse("Let me look.\n[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]");
        assert_eq!(output.content.as_deref(), Some("Let me look."));
        assert_eq!(calls(&output), [call("f", json!({}))]);
    }

    #[test]
    fn mistral_invalid_json_is_all_content() {
        assert_all_content(
            Mistral,
            "Hi [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {,}}]",
        );
        assert_all_content(Mistral, "[TOOL_CALLS][{\"arguments\": {}}]");
        assert_all_content(Mistral, "[TOOL_CALLS]get weather[ARGS]{}");
        assert_all_content(Mistral, "[TOOL_CALLS]f[ARGS]{} and more");
        assert_all_content(Mistral, "[TOOL_CALLS][]");
    }

    #[test]
    fn mistral_truncated_output_is_all_content() {
        assert_all_content(Mistral, "[TOOL_CALLS][{\"name\": \"f\", \"argu");
        assert_all_content(Mistral, "[TOOL_CALLS]f[ARGS]{\"a\": ");
        assert_all_content(Mistral, "[TOOL_CALLS]f");
    }

    #[test]
    fn mistral_without_the_marker_is_all_content() {
        assert_all_content(Mistral, "[1, 2, 3] is a list.");
    }

    #[test]
    fn mistral_holds_from_the_marker_or_a_partial_one_at_the_end() {
        assert_eq!(Mistral.hold_from("Hello"), 5);
        assert_eq!(Mistral.hold_from("Hi [TOOL_CALLS][{"), 3);
        assert_eq!(Mistral.hold_from("Hi [TOOL"), 3);
        assert_eq!(Mistral.hold_from("Hi ["), 3);
        assert_eq!(Mistral.hold_from("[1]"), 3);
    }

    // --- pythonic ---

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

    // --- all parsers ---

    /// Outputs with calls in each format, used for streaming and fuzz tests.
    fn samples() -> Vec<(ToolCallParser, &'static str)> {
        vec![
            (
                Hermes,
                "Voilà — je vérifie 🌦.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>",
            ),
            (
                Llama3Json,
                "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": \"日本\"}}; {\"name\": \"g\", \"parameters\": {}}",
            ),
            (
                Mistral,
                "Un instant…[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"q\": \"ü\"}}, {\"name\": \"g\"}]",
            ),
            (Mistral, "[TOOL_CALLS]f[ARGS]{\"q\": \"é\"}[TOOL_CALLS]g[ARGS]{}"),
            (
                Pythonic,
                "[f(q='日本\\'s', n=-1.5e3, l=[1, (2,), {'k': None}]), g.h(b=True)]",
            ),
        ]
    }

    #[test]
    fn samples_parse_into_calls() {
        for (parser, text) in samples() {
            assert_eq!(parser.parse(text).calls.len(), 2, "{parser:?} {text:?}");
        }
    }

    #[test]
    fn streaming_never_sends_part_of_a_call_as_content() {
        for (parser, text) in samples() {
            let call_start = match parser {
                Hermes => text.find(HERMES_START),
                Mistral => text.find(MISTRAL_MARKER),
                Llama3Json | Pythonic => Some(0),
            }
            .unwrap();
            for (end, _) in text.char_indices().chain([(text.len(), ' ')]) {
                let prefix = &text[..end];
                let hold = parser.hold_from(prefix);
                assert!(
                    hold <= call_start,
                    "{parser:?} would send {:?}",
                    &prefix[..hold]
                );
            }
        }
    }

    /// A deterministic pseudo-random generator, so the fuzz test needs no
    /// extra crate and fails reproducibly.
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, bound: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % bound
        }
    }

    fn check_no_panic_and_invariants(parser: ToolCallParser, text: &str) {
        let hold = parser.hold_from(text);
        assert!(hold <= text.len(), "{parser:?} {text:?}");
        assert!(text.is_char_boundary(hold), "{parser:?} {text:?}");
        let output = parser.parse(text);
        if output.calls.is_empty() {
            assert_eq!(
                output.content.as_deref(),
                non_empty_trimmed(text).as_deref()
            );
        }
        if let Some(content) = &output.content {
            assert!(!content.is_empty() && content.trim() == content);
        }
        for call in &output.calls {
            assert!(!call.name.is_empty());
            let arguments: Value = serde_json::from_str(&call.arguments).unwrap();
            assert!(arguments.is_object(), "{parser:?} {text:?}");
        }
    }

    #[test]
    fn every_prefix_of_a_valid_output_is_handled_by_every_parser() {
        for (_, text) in samples() {
            for (end, _) in text.char_indices().chain([(text.len(), ' ')]) {
                for parser in ALL {
                    check_no_panic_and_invariants(parser, &text[..end]);
                }
            }
        }
    }

    #[test]
    fn random_and_hostile_text_is_handled_by_every_parser() {
        const PIECES: &[&str] = &[
            "<tool_call>",
            "</tool_call>",
            "<tool_",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[TOOL",
            "<|python_tag|>",
            "<|python_start|>",
            "<|python_end|>",
            "<|py",
            "{",
            "}",
            "[",
            "]",
            "(",
            ")",
            ",",
            ";",
            ":",
            "=",
            "\"",
            "'",
            "'''",
            "\\",
            "\\x",
            "\\u",
            "\\U0001F6",
            "\\N{",
            "name",
            "\"name\"",
            "\"arguments\"",
            "\"parameters\"",
            "f",
            "a.b",
            "True",
            "None",
            "-",
            "1",
            "2.5e",
            "0x",
            "_",
            ".",
            " ",
            "\n",
            "r'",
            "b'",
            "é",
            "日本",
            "🌦",
            "\u{0}",
            "\u{200b}",
        ];
        let mut rng = Lcg(0x5eed);
        for _ in 0..3000 {
            let mut text = String::new();
            for _ in 0..rng.below(24) {
                text.push_str(PIECES[rng.below(PIECES.len())]);
            }
            for parser in ALL {
                check_no_panic_and_invariants(parser, &text);
            }
        }
        let hostile = [
            "[".repeat(100_000),
            format!("[f(a={})]", "[".repeat(100_000)),
            format!("[f(a={})]", "(".repeat(100_000)),
            format!("<tool_call>{}</tool_call>", "[".repeat(100_000)),
            format!("[TOOL_CALLS]{}", "{\"a\":".repeat(50_000)),
            "{".repeat(100_000),
            "\u{10ffff}\u{fffd}".repeat(100),
        ];
        for text in &hostile {
            for parser in ALL {
                check_no_panic_and_invariants(parser, text);
            }
        }
    }
}
