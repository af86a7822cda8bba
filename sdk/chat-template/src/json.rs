//! JSON in and out of templates: [`json_to_value`] and [`ordered_map`]
//! build insertion-ordered values, [`tojson`] writes them back as Python's
//! `json.dumps` would.

use minijinja::value::{Enumerator, Kwargs, Object, ObjectExt, ObjectRepr, Rest, Value, ValueKind};
use minijinja::{Error, ErrorKind};
use serde_json::Value as Json;
use std::sync::Arc;

/// A map that keeps its keys in insertion order, as Python dicts do. Keys
/// are unique (the constructors see to it); lookups are linear scans, which
/// beats hashing at the sizes of chat messages and template contexts.
#[derive(Debug)]
struct OrderedMap(Vec<(Value, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_enumerator(|this| Box::new(this.0.iter().map(|(k, _)| k.clone())))
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// A template map (a Python dict to the template) with `pairs` in the order
/// given. A key that repeats keeps its first position and takes its last
/// value, as when a Python dict is assigned to in that order.
pub fn ordered_map<K: Into<Value>>(pairs: impl IntoIterator<Item = (K, Value)>) -> Value {
    let mut entries: Vec<(Value, Value)> = Vec::new();
    for (k, v) in pairs {
        let k = k.into();
        match entries.iter_mut().find(|(old, _)| *old == k) {
            Some(entry) => entry.1 = v,
            None => entries.push((k, v)),
        }
    }
    Value::from_object(OrderedMap(entries))
}

/// Converts JSON into a template value. Objects become maps that keep their
/// keys in the order `serde_json` iterates them: the document's order when
/// serde_json's `preserve_order` feature is on in the build, sorted when it
/// is off. Integers stay integers (`1` is not `1.0`), other numbers become
/// floats.
pub fn json_to_value(j: &Json) -> Value {
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
        Json::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        // A JSON object's keys are unique already: no need to check.
        Json::Object(o) => Value::from_object(OrderedMap(
            o.iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v)))
                .collect(),
        )),
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

/// The `tojson` filter: `tojson(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, positionally or by keyword, as HF
/// defines it (Jinja2's own `tojson` takes `indent` first and escapes HTML;
/// HF replaces it).
pub(crate) fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    if args.len() > 4 {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
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
/// a stack overflow (a plugin's stack is small).
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
        // Anything else (e.g. a macro) as its string form.
        _ => json_string(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

/// `f` as Python's `json.dumps` writes a float (its `repr`): the shortest
/// digits that round-trip, `.0` on integral values (`3.0`), exponent form
/// below 1e-4 and from 1e16 (`1.5e-05`, `1e+16`), and `NaN`, `Infinity`,
/// `-Infinity` for non-finite values.
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

/// Appends `s` as a JSON string literal as Python's `json.dumps` writes it:
/// short escapes where JSON has them, `\u00XX` for other control
/// characters, and with `ensure_ascii` every non-ASCII character as
/// `\uXXXX` (UTF-16 surrogate pairs beyond the BMP).
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
    use crate::{environment, render, Clock};
    use serde_json::json;

    fn render_with(source: &str, vars: Json) -> String {
        let env = environment(Clock::None);
        let template = env.template_from_str(source).unwrap();
        render(&template, json_to_value(&vars)).unwrap()
    }

    #[test]
    fn floats_like_python() {
        for (f, s) in [
            (3.0, "3.0"),
            (2.5, "2.5"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (-2.5e300, "-2.5e+300"),
            (123456789.125, "123456789.125"),
            (1e-4, "0.0001"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(python_float(f), s, "{f}");
        }
    }

    #[test]
    fn tojson_like_python() {
        let vars = json!({"x": {"b": [1, 2.0, null, true], "a": "é\n\u{1}", "e": {}, "l": []}});
        // Without preserve_order, serde_json hands the keys over sorted; the
        // template keeps whatever order it was given (see key_order_is_kept).
        let keys: Vec<&String> = vars["x"].as_object().unwrap().keys().collect();
        let x = |k: &str| match k {
            "b" => r#""b": [1, 2.0, null, true]"#,
            "a" => r#""a": "é\n\u0001""#,
            "e" => r#""e": {}"#,
            _ => r#""l": []"#,
        };
        let expected = format!(
            "{{{}}}",
            keys.iter().map(|k| x(k)).collect::<Vec<_>>().join(", ")
        );
        assert_eq!(render_with("{{ x | tojson }}", vars.clone()), expected);
        assert_eq!(
            render_with("{{ x | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}", vars.clone()),
            "{\n  \"a\": \"\\u00e9\\n\\u0001\",\n  \"b\": [\n    1,\n    2.0,\n    null,\n    true\n  ],\n  \"e\": {},\n  \"l\": []\n}"
        );
        assert_eq!(
            render_with("{{ x.b | tojson(indent='\t') }}", vars.clone()),
            "[\n\t1,\n\t2.0,\n\tnull,\n\ttrue\n]"
        );
        assert_eq!(
            render_with("{{ x.b | tojson(separators=(',', ':')) }}", vars.clone()),
            "[1,2.0,null,true]"
        );
        // Positional arguments in json.dumps' order: ensure_ascii first.
        assert_eq!(
            render_with(
                "{{ '😀é' | tojson(true) }}|{{ '😀é' | tojson }}",
                vars.clone()
            ),
            r#""\ud83d\ude00\u00e9"|"😀é""#
        );
        assert_eq!(
            render_with("{{ x.b | tojson(false, 1, none, true) }}", vars.clone()),
            "[\n 1,\n 2.0,\n null,\n true\n]"
        );
        // Strings are not HTML-escaped (Jinja2's own tojson would).
        assert_eq!(render_with("{{ '<a&b>' | tojson }}", vars), r#""<a&b>""#);
    }

    #[test]
    fn tojson_rejects_bad_arguments() {
        let env = environment(Clock::None);
        for src in [
            "{{ 1 | tojson(nope=1) }}",
            "{{ 1 | tojson(separators=(',',)) }}",
            "{{ 1 | tojson(false, none, none, false, 1) }}",
        ] {
            let template = env.template_from_str(src).unwrap();
            assert!(render(&template, ordered_map::<&str>([])).is_err(), "{src}");
        }
    }

    #[test]
    fn key_order_is_kept() {
        let message = ordered_map([
            ("role", Value::from("user")),
            ("content", Value::from("hi")),
            ("name", Value::from("z")),
        ]);
        let ctx = ordered_map([("m", message)]);
        let env = environment(Clock::None);
        let template = env
            .template_from_str(
                "{{ m | tojson }}|{% for k, v in m.items() %}{{ k }} {% endfor %}|{{ m | list }}|{{ m | length }}|{{ m.role }}{{ m['name'] }}|{{ 'content' in m }}{{ m.nope is defined }}",
            )
            .unwrap();
        assert_eq!(
            render(&template, ctx).unwrap(),
            r#"{"role": "user", "content": "hi", "name": "z"}|role content name |['role', 'content', 'name']|3|userz|TrueFalse"#
        );
    }

    #[test]
    fn repeated_keys_keep_first_position_last_value() {
        let ctx = ordered_map([
            ("a", Value::from(1)),
            ("b", Value::from(2)),
            ("a", Value::from(3)),
        ]);
        let env = environment(Clock::None);
        let template = env.template_from_str("{{ d | tojson }}").unwrap();
        assert_eq!(
            render(&template, ordered_map([("d", ctx)])).unwrap(),
            r#"{"a": 3, "b": 2}"#
        );
    }

    #[test]
    fn json_numbers() {
        let out = render_with(
            "{{ n | tojson }} {{ n[0] is integer }} {{ n[1] is float }}",
            json!({"n": [1, 1.0, -3, 18446744073709551615u64, 0.5]}),
        );
        assert_eq!(out, "[1, 1.0, -3, 18446744073709551615, 0.5] True True");
    }

    #[test]
    fn tojson_depth_is_bounded() {
        let mut deep = json!(1);
        for _ in 0..200 {
            deep = json!([deep]);
        }
        let env = environment(Clock::None);
        let template = env.template_from_str("{{ d | tojson }}").unwrap();
        let err = render(&template, ordered_map([("d", json_to_value(&deep))])).unwrap_err();
        assert!(err.to_string().contains("nests too deeply"), "{err}");
    }
}
