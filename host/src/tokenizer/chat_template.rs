//! Hugging Face–compatible chat templates, rendered with minijinja.
//!
//! HF renders `tokenizer.chat_template` with Jinja2 configured with
//! `trim_blocks=True` and `lstrip_blocks=True`, Python string/dict methods
//! available (`.strip()`, `.startswith()`, `.items()` …), and the extra
//! globals `raise_exception(msg)` and `strftime_now(fmt)`, plus a `tojson`
//! filter that behaves like Python's `json.dumps(…, ensure_ascii=False)`.
//! [`ChatTemplate`] sets minijinja up the same way and compiles the template
//! once.

use anyhow::{anyhow, Result};
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use std::sync::Arc;

/// The name the template is stored under inside its environment.
const TEMPLATE_NAME: &str = "chat";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template together with the BOS/EOS token texts it may
/// refer to as `bos_token` and `eos_token`.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// A map that keeps its keys in insertion order, as Python dicts do, so
/// that `tojson` and `.items()` see message fields in their original order.
#[derive(Debug)]
struct OrderedMap(Vec<(String, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let keys: Vec<Value> = self
            .0
            .iter()
            .map(|(k, _)| Value::from(k.as_str()))
            .collect();
        Enumerator::Iter(Box::new(keys.into_iter()))
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// Converts JSON into a template value, keeping object keys in the order
/// `serde_json` iterates them (sorted, unless its `preserve_order` feature
/// is enabled somewhere in the build).
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
        Json::Object(o) => Value::from_object(OrderedMap(
            o.iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect(),
        )),
    }
}

fn message_value(m: &ChatMessage) -> Value {
    Value::from_object(OrderedMap(vec![
        ("role".to_owned(), Value::from(m.role.as_str())),
        ("content".to_owned(), Value::from(m.content.as_str())),
    ]))
}

/// `raise_exception(msg)`: aborts rendering with `msg` as the error.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps` float formatting for finite values: integral
/// values keep a `.0`, others use the shortest round-tripping digits.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if f.fract() == 0.0 && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

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
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Options of the `tojson` filter, named as in Python's `json.dumps`.
struct JsonStyle {
    indent: Option<String>,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn write_json(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    if depth > 256 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nests too deeply",
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    let item_sep = if style.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => json_string(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_owned(),
                    None => k.to_string(),
                };
                json_string(out, &key, style.ensure_ascii);
                out.push_str(": ");
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
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => json_string(out, &v.to_string(), style.ensure_ascii),
    }
    Ok(())
}

/// `tojson(value, indent=None, ensure_ascii=False, sort_keys=False)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let style = JsonStyle {
        indent,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Days since 1970-01-01 → (year, month 1–12, day 1–31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so that leap days end each 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year from March 1
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month 1–12, day 1–31) → days since 1970-01-01; inverse of
/// [`civil_from_days`].
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((month + 9) % 12); // March = 0
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats `secs` since the Unix epoch (UTC) with a C `strftime` format
/// (`%Y %m %d %e %H %I %M %S %p %y %B %b %A %a %j %%`; others are copied).
fn strftime_utc(secs: i64, fmt: &str) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month as usize).saturating_sub(1).min(11)];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `strftime_now(fmt)`: the current UTC time formatted with `fmt`.
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime_utc(secs, &fmt)))
}

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template as found in
    /// `tokenizer.chat_template` / `tokenizer_config.json`). `bos_token` and
    /// `eos_token` are exposed to the template under those names (empty
    /// strings when absent). A syntax error is reported here, not at render.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| anyhow!("chat template: {e}"))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| anyhow!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
        })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends
    /// the header of an assistant turn. Errors raised by the template with
    /// `raise_exception(msg)` carry `msg`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let msgs = Value::from(messages.iter().map(message_value).collect::<Vec<_>>());
        self.render_values(msgs, add_generation_prompt, &serde_json::Map::new())
    }

    /// Like [`render`](Self::render), for messages given as JSON (so they may
    /// carry extra fields such as `tool_calls` or a list-valued `content`),
    /// with `extra` variables (e.g. `tools`, `enable_thinking`) added to the
    /// template's context.
    pub fn render_json(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        if !messages.is_array() {
            return Err(anyhow!("chat template: messages must be a JSON array"));
        }
        self.render_values(json_to_value(messages), add_generation_prompt, extra)
    }

    fn render_values(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("chat template: {e}"))?;
        let mut ctx: Vec<(String, Value)> = extra
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect();
        ctx.retain(|(k, _)| {
            !matches!(
                k.as_str(),
                "messages" | "add_generation_prompt" | "bos_token" | "eos_token"
            )
        });
        ctx.push(("messages".into(), messages));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        ctx.push(("bos_token".into(), Value::from(self.bos_token.as_str())));
        ctx.push(("eos_token".into(), Value::from(self.eos_token.as_str())));
        tmpl.render(Value::from_object(OrderedMap(ctx)))
            .map_err(|e| anyhow!("chat template: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect()
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        for d in [-800_000i64, -1, 0, 59, 60, 11_016, 19_723, 2_000_000] {
            let (y, m, dd) = civil_from_days(d);
            assert_eq!(days_from_civil(y, m, dd), d);
        }
        // 2024-07-26 12:34:56 UTC, a Friday.
        let t = 1_721_997_296;
        assert_eq!(
            strftime_utc(t, "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %%"),
            "2024-07-26 12:34:56 Fri Friday Jul July 208 24 12PM %"
        );
        assert_eq!(strftime_utc(t, "%d %b %Y"), "26 Jul 2024");
    }

    #[test]
    fn tojson_matches_python() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ s | tojson }}",
            None,
            None,
        )
        .expect("compile");
        let mut extra = serde_json::Map::new();
        extra.insert(
            "x".into(),
            serde_json::json!({"name": "f", "args": [1, 2.5, 3.0, true, null], "a": {}}),
        );
        extra.insert("s".into(), serde_json::json!("é<b>\"\n"));
        let out = t
            .render_json(&serde_json::json!([]), false, &extra)
            .expect("render");
        assert_eq!(
            out,
            "{\"a\": {}, \"args\": [1, 2.5, 3.0, true, null], \"name\": \"f\"}|{\n  \"a\": {},\n  \"args\": [\n    1,\n    2.5,\n    3.0,\n    true,\n    null\n  ],\n  \"name\": \"f\"\n}|\"é<b>\\\"\\n\""
        );
    }

    #[test]
    fn messages_keep_field_order() {
        let t = ChatTemplate::new("{{ messages[0] | tojson }}", None, None).expect("compile");
        let out = t.render(&msgs(&[("user", "hi")]), false).expect("render");
        assert_eq!(out, "{\"role\": \"user\", \"content\": \"hi\"}");
    }

    #[test]
    fn raise_exception_carries_message() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
            None,
            None,
        )
        .expect("compile");
        let err = t
            .render(&msgs(&[("assistant", "x")]), false)
            .expect_err("must fail");
        assert!(
            err.to_string()
                .contains("Conversation must start with user"),
            "{err}"
        );
        assert_eq!(t.render(&msgs(&[("user", "x")]), false).expect("ok"), "ok");
    }

    #[test]
    fn syntax_error_at_compile_time() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }

    #[test]
    fn pycompat_methods_and_trim_blocks() {
        let src = "{% for m in messages %}\n  {% if m.content.strip().startswith('x') %}\n[{{ m['content'].strip() | upper }}]\n  {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, None, None).expect("compile");
        let out = t
            .render(&msgs(&[("user", "  xy "), ("user", "no")]), false)
            .expect("render");
        assert_eq!(out, "[XY]\n");
    }
}
