//! Reading a request body into its typed struct ([`from_body`]), and the
//! value types those structs' fields share. Each type accepts what
//! OpenAI's and vLLM's servers accept (an integer written `5.0`, a negative
//! seed, one string where a list of strings may stand) and, when it
//! refuses a value, says what it expected; [`from_body`] names the field
//! (its path, `stream_options.include_usage`) in the 400's `param` and
//! message. Unknown fields are ignored and `null` reads as absent, as
//! OpenAI treats them.

use crate::server::errors::ApiError;
use crate::server::openai::fields::ALL_LOGPROBS;
use serde::de::{self, DeserializeOwned, Deserializer, SeqAccess, Unexpected, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};
use std::fmt;

/// Reads a request body into `T`. A body that is not an object is refused
/// as a whole; a field of the wrong type, or out of its range, gets a 400
/// whose `param` is the field's path and whose message says what was
/// expected ("'temperature' must be a number").
pub fn from_body<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    if !body.is_object() {
        return Err(ApiError::invalid(
            None,
            "The request body must be a JSON object.",
        ));
    }
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = field_path(e.path());
        let inner = e.into_inner().to_string();
        // serde's "invalid type: integer `1`, expected a boolean": what was
        // expected is what the client needs to read; a range error of the
        // types below ("must be non-negative, got -1") is said as it is.
        let message = match inner.split_once(", expected ") {
            Some((_, want)) => format!("'{path}' must be {want}"),
            None => format!("'{path}' {inner}"),
        };
        ApiError::invalid(Some(path), message)
    })
}

/// A field's path as OpenAI's `param` writes it: `a.b[0].c`.
fn field_path(p: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut s = String::new();
    for seg in p.iter() {
        let key = match seg {
            Segment::Seq { index } => {
                s.push_str(&format!("[{index}]"));
                continue;
            }
            Segment::Map { key } => key.as_str(),
            Segment::Enum { variant } => variant.as_str(),
            Segment::Unknown => "?",
        };
        if !s.is_empty() {
            s.push('.');
        }
        s.push_str(key);
    }
    s
}

/// A JSON number of any kind, read as `f32` (`temperature`, `top_p`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Number(pub f32);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Number;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Number, E> {
                Ok(Number(v as f32))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Number, E> {
                Ok(Number(v as f32))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Number, E> {
                Ok(Number(v as f32))
            }
        }
        d.deserialize_any(V)
    }
}

/// An integer, which may be written as a float with no fraction (`5.0`,
/// as some clients send), within ±9e15 where floats hold it exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Int(pub i64);

struct IntVisitor;

impl Visitor<'_> for IntVisitor {
    type Value = i64;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an integer")
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i64, E> {
        Ok(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i64, E> {
        i64::try_from(v).map_err(|_| E::invalid_type(Unexpected::Unsigned(v), &self))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<i64, E> {
        if v.fract() == 0.0 && v.abs() < 9e15 {
            Ok(v as i64)
        } else {
            Err(E::invalid_type(Unexpected::Float(v), &self))
        }
    }
}

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(IntVisitor).map(Int)
    }
}

/// A count: an integer of at least 0 (`n`, `max_tokens`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Count(pub usize);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match d.deserialize_any(IntVisitor)? {
            x if x >= 0 => Ok(Count(x as usize)),
            x => Err(de::Error::custom(format!("must be non-negative, got {x}"))),
        }
    }
}

/// A count of logprobs per token (`logprobs`, `top_logprobs`,
/// `prompt_logprobs`): at least 0, or vLLM's `-1` for the whole
/// vocabulary ([`ALL_LOGPROBS`] until the vocabulary's size is known).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogprobCount(pub usize);

/// Written back as the client wrote it: `-1` for the whole vocabulary.
impl Serialize for LogprobCount {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            ALL_LOGPROBS => s.serialize_i64(-1),
            k => s.serialize_u64(k as u64),
        }
    }
}

impl<'de> Deserialize<'de> for LogprobCount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match d.deserialize_any(IntVisitor)? {
            -1 => Ok(LogprobCount(ALL_LOGPROBS)),
            x if x >= 0 => Ok(LogprobCount(x as usize)),
            x => Err(de::Error::custom(format!(
                "must be a non-negative value or -1 (the whole vocabulary), got {x}"
            ))),
        }
    }
}

/// A seed: any integer; a negative one (which OpenAI accepts) keeps its
/// bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Seed(pub u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seed;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                Ok(Seed(v as u64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A string or a list of strings (`stop`, `bad_words`), as a list.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Strings(pub Vec<String>);

impl<'de> Deserialize<'de> for Strings {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Strings;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Strings, E> {
                Ok(Strings(vec![v.to_string()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strings, A::Error> {
                // The whole field is what is wrong when one item is not a
                // string, as the field-by-field reader said.
                let mut out = Vec::new();
                while let Some(v) = seq.next_element::<Value>()? {
                    match v {
                        Value::String(s) => out.push(s),
                        _ => return Err(de::Error::invalid_type(Unexpected::Seq, &self)),
                    }
                }
                Ok(Strings(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// A list of token ids (`stop_token_ids`, `allowed_token_ids`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct TokenIds(pub Vec<u32>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenIds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of token ids")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TokenIds, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = seq.next_element::<Value>()? {
                    match v.as_u64().and_then(|x| u32::try_from(x).ok()) {
                        Some(t) => out.push(t),
                        None => return Err(de::Error::invalid_type(Unexpected::Seq, &self)),
                    }
                }
                Ok(TokenIds(out))
            }
        }
        d.deserialize_seq(V)
    }
}

/// A JSON object kept as it is (`logit_bias`, `chat_template_kwargs`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Object(pub Map<String, Value>);

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Object(m) => Ok(Object(m)),
            other => Err(de::Error::invalid_type(unexpected(&other), &"an object")),
        }
    }
}

/// How serde names a JSON value that was not what a field expected.
fn unexpected(v: &Value) -> Unexpected<'_> {
    match v {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Unexpected::Unsigned(u),
            (None, Some(i)) => Unexpected::Signed(i),
            _ => Unexpected::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Deserialize, Debug)]
    struct Probe {
        temperature: Option<Number>,
        n: Option<Count>,
        top_k: Option<Int>,
        seed: Option<Seed>,
        logprobs: Option<LogprobCount>,
        stop: Option<Strings>,
        ids: Option<TokenIds>,
        bias: Option<Object>,
        stream: Option<bool>,
        inner: Option<Inner>,
    }

    #[derive(Deserialize, Debug)]
    #[serde(expecting = "an object")]
    struct Inner {
        flag: Option<bool>,
    }

    fn err(body: Value) -> (String, String) {
        let e = from_body::<Probe>(&body).expect_err("refused");
        (e.param.unwrap_or_default(), e.message)
    }

    #[test]
    fn values_read_as_the_field_by_field_reader_read_them() {
        let p: Probe = from_body(&json!({
            "temperature": 1, "n": 2.0, "top_k": -1, "seed": -1, "logprobs": -1,
            "stop": "x", "ids": [1, 2], "bias": {"5": 1.0}, "stream": null,
            "unknown": {"ignored": true}, "inner": {"flag": true},
        }))
        .expect("read");
        assert_eq!(p.temperature, Some(Number(1.0)));
        assert_eq!(p.n, Some(Count(2)));
        assert_eq!(p.top_k, Some(Int(-1)));
        assert_eq!(p.seed, Some(Seed(u64::MAX)));
        assert_eq!(p.logprobs, Some(LogprobCount(ALL_LOGPROBS)));
        assert_eq!(p.stop, Some(Strings(vec!["x".into()])));
        assert_eq!(p.ids, Some(TokenIds(vec![1, 2])));
        assert_eq!(p.bias.map(|b| b.0.len()), Some(1));
        assert_eq!(p.stream, None);
        assert_eq!(p.inner.and_then(|i| i.flag), Some(true));
    }

    #[test]
    fn a_wrong_value_is_named_with_what_was_expected() {
        for (body, param, message) in [
            (
                json!({"temperature": "hot"}),
                "temperature",
                "'temperature' must be a number",
            ),
            (json!({"n": -1}), "n", "'n' must be non-negative, got -1"),
            (json!({"n": 1.5}), "n", "'n' must be an integer"),
            (json!({"top_k": "1"}), "top_k", "'top_k' must be an integer"),
            (json!({"seed": 1.5}), "seed", "'seed' must be an integer"),
            (
                json!({"logprobs": -2}),
                "logprobs",
                "'logprobs' must be a non-negative value or -1 (the whole vocabulary), got -2",
            ),
            (
                json!({"stop": ["a", 1]}),
                "stop",
                "'stop' must be a string or a list of strings",
            ),
            (
                json!({"stop": 3}),
                "stop",
                "'stop' must be a string or a list of strings",
            ),
            (
                json!({"ids": [1, -1]}),
                "ids",
                "'ids' must be a list of token ids",
            ),
            (
                json!({"ids": "1"}),
                "ids",
                "'ids' must be a list of token ids",
            ),
            (json!({"bias": [1]}), "bias", "'bias' must be an object"),
            (
                json!({"stream": "yes"}),
                "stream",
                "'stream' must be a boolean",
            ),
            (json!({"inner": 1}), "inner", "'inner' must be an object"),
            (
                json!({"inner": {"flag": 1}}),
                "inner.flag",
                "'inner.flag' must be a boolean",
            ),
        ] {
            assert_eq!(
                err(body.clone()),
                (param.to_string(), message.to_string()),
                "{body}"
            );
        }
        let e = from_body::<Probe>(&json!([1])).expect_err("not an object");
        assert_eq!(e.param, None);
    }
}
