//! A Jinja environment set up like Hugging Face's `apply_chat_template`:
//!
//! - `trim_blocks` and `lstrip_blocks` on, no auto-escaping, no trailing
//!   newline kept;
//! - Python's string, list and dict methods (`.strip()`, `.items()`, ...);
//! - `raise_exception(msg)`, which fails rendering with `msg` as the whole
//!   error message (templates use it to reject malformed conversations, and
//!   the client should see their words);
//! - `tojson` as HF defines it: Python's `json.dumps(x, ensure_ascii=False,
//!   indent=None, separators=None, sort_keys=False)`, so `", "` and `": "`
//!   separators and Python's float formatting.
//!
//! `strftime_now` is not provided: a plugin has no clock, and templates
//! that use it test `strftime_now is defined` and fall back to a fixed
//! date (clients can pass `date_string` through `chat_template_kwargs`).

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use pagoda_sdk::serde_json::{Map, Value as Json};
use std::cell::RefCell;

thread_local! {
    /// The message of the last `raise_exception` call. minijinja wraps a
    /// function's error in its own message, so the text is kept aside to
    /// give the client exactly what the template said.
    static RAISED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Renders template `source` with the variables `vars`. Errors are
/// messages for the client.
pub fn render(source: &str, vars: &Map<String, Json>) -> Result<String, String> {
    let env = environment();
    let template = env
        .template_from_str(source)
        .map_err(|e| format!("chat template does not compile: {e}"))?;
    let ctx = Value::from_pairs(vars.iter().map(|(k, v)| (k.as_str(), from_json(v))));
    RAISED.with(|r| r.borrow_mut().take());
    template
        .render(ctx)
        .map_err(|e| match RAISED.with(|r| r.borrow_mut().take()) {
            Some(message) => message,
            None => format!("chat template error: {e}"),
        })
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .expect("default delimiters are valid");
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    env
}

/// `raise_exception(msg)`.
fn raise_exception(message: String) -> Result<Value, Error> {
    RAISED.with(|r| *r.borrow_mut() = Some(message.clone()));
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// JSON to a template value. Objects keep their key order: serde_json's
/// and minijinja's `preserve_order` features are on, as Python dicts keep
/// insertion order and `tojson` / `.items()` output should match HF's.
pub fn from_json(j: &Json) -> Value {
    match j {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(from_json).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), from_json(v)))),
    }
}

/// How `tojson` formats, as Python's `json.dumps` arguments.
struct Style {
    indent: Option<String>,
    ensure_ascii: bool,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

/// `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, positionally or by keyword, as HF defines it.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let arg = |i: usize, name: &str| -> Result<Option<Value>, Error> {
        match args.get(i) {
            Some(v) => Ok(Some(v.clone())),
            None => kwargs.get::<Option<Value>>(name),
        }
    };
    let present = |v: Option<Value>| v.filter(|v| !v.is_none() && !v.is_undefined());
    let ensure_ascii = present(arg(0, "ensure_ascii")?).is_some_and(|v| v.is_true());
    let indent = match present(arg(1, "indent")?) {
        None => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(usize::try_from(v)?),
        }),
    };
    let separators = present(arg(2, "separators")?);
    let sort_keys = present(arg(3, "sort_keys")?).is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    // Python's defaults: "," with indentation (lines end there), ", " without.
    let (mut item_sep, mut key_sep) = (
        if indent.is_some() { "," } else { ", " }.to_owned(),
        ": ".to_owned(),
    );
    if let Some(seps) = separators {
        let seps: Vec<Value> = seps.try_iter()?.collect();
        match seps.as_slice() {
            [i, k] => {
                item_sep = i.as_str().unwrap_or(",").to_owned();
                key_sep = k.as_str().unwrap_or(":").to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair",
                ))
            }
        }
    }
    let style = Style {
        indent,
        ensure_ascii,
        sort_keys,
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Deepest nesting `tojson` follows; deeper input is an error rather than
/// a stack overflow.
const MAX_DEPTH: usize = 128;

fn write_json(out: &mut String, v: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nests too deeply",
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &style.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&python_float(f64::try_from(v.clone())?)),
        ValueKind::String => json_string(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                // Python turns non-string keys into strings.
                let key = k.as_str().map_or_else(|| k.to_string(), str::to_owned);
                json_string(out, &key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &v.get_item(k)?, style, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        // Anything else (e.g. a function) as its string form.
        _ => json_string(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

/// Python's `repr(float)` as `json.dumps` writes it: shortest round-trip
/// digits, `.0` on integral values, exponent form below 1e-4 and from
/// 1e16, and `NaN` / `Infinity` for non-finite values.
pub fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust writes "1e16" / "1.5e-5"; Python "1e+16" / "1.5e-05".
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').expect("{:e} has an exponent");
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        s + ".0"
    }
}

/// A JSON string literal as Python's `json.dumps` writes it.
fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_sdk::json;

    fn render_with(source: &str, vars: Json) -> Result<String, String> {
        let Json::Object(map) = vars else {
            panic!("vars must be an object")
        };
        render(source, &map)
    }

    #[test]
    fn floats_like_python() {
        for (f, s) in [
            (3.0, "3.0"),
            (2.5, "2.5"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (123456789.125, "123456789.125"),
            (1e-4, "0.0001"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(python_float(f), s, "{f}");
        }
    }

    #[test]
    fn tojson_like_python() {
        let vars = json!({"x": {"b": [1, 2.0, null, true], "a": "é\n\u{1}", "e": {}, "l": []}});
        assert_eq!(
            render_with("{{ x | tojson }}", vars.clone()).unwrap(),
            r#"{"b": [1, 2.0, null, true], "a": "é\n\u0001", "e": {}, "l": []}"#
        );
        assert_eq!(
            render_with("{{ x | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}", vars.clone()).unwrap(),
            "{\n  \"a\": \"\\u00e9\\n\\u0001\",\n  \"b\": [\n    1,\n    2.0,\n    null,\n    true\n  ],\n  \"e\": {},\n  \"l\": []\n}"
        );
        assert_eq!(
            render_with("{{ x.b | tojson(separators=(',', ':')) }}", vars.clone()).unwrap(),
            "[1,2.0,null,true]"
        );
        assert_eq!(
            render_with("{{ '😀' | tojson(true) }}", vars).unwrap(),
            r#""\ud83d\ude00""#
        );
    }

    #[test]
    fn python_methods_and_whitespace_control() {
        let out = render_with(
            "{% for k, v in d.items() %}\n    {{ k }}={{ v.strip() }}{% if not loop.last %},{% endif %}\n{% endfor %}\n{{ s.startswith('ab') }} {{ s.split('b') }}",
            json!({"d": {"z": " 1 ", "a": "2"}, "s": "abc"}),
        )
        .unwrap();
        // trim_blocks eats the newline after each block tag, as in Jinja;
        // Python's booleans and lists print Python-style.
        assert_eq!(out, "    z=1,    a=2True ['a', 'c']");
    }

    #[test]
    fn loop_controls_and_macros() {
        let out = render_with(
            "{% macro m(x) %}<{{ x }}>{% endmacro %}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ m(i) }}{% endfor %}",
            json!({}),
        )
        .unwrap();
        assert_eq!(out, "<0><1><2>");
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(render_with("{{ raise_exception('nope') }}", json!({})).unwrap_err() == "nope");
        // A later unrelated error is not mistaken for a raise_exception.
        let err = render_with("{{ 1 + 'a' }}", json!({})).unwrap_err();
        assert!(err.starts_with("chat template error"), "{err}");
        let err = render_with("{% if %}", json!({})).unwrap_err();
        assert!(err.starts_with("chat template does not compile"), "{err}");
    }
}
