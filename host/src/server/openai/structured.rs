//! The request fields that ask for structured output, mapped onto one
//! [`StructuredOutputs`]: OpenAI's `response_format`, vLLM's
//! `structured_outputs`, and the `guided_*` fields older clients still send.

use crate::engine::structured_output::{OutputConstraint, StructuredOutputs};
use crate::server::errors::ApiError;
use crate::server::openai::fields::Fields;
use serde_json::Value;

/// A constraint and the request field it came from (the `param` of the
/// error if it does not compile).
#[derive(Clone, Debug, PartialEq)]
pub struct RequestedStructure {
    pub spec: StructuredOutputs,
    pub param: String,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.to_string()), message)
}

/// A JSON schema given as an object or as a string holding one.
fn schema_value(v: &Value, param: &str) -> Result<Value, ApiError> {
    match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| invalid(param, format!("'{param}' is not valid JSON: {e}"))),
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => Err(invalid(
            param,
            format!("'{param}' must be a JSON schema object"),
        )),
    }
}

fn strings(v: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let bad = || {
        invalid(
            param,
            format!("'{param}' must be a non-empty list of strings"),
        )
    };
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(bad)?;
    list.iter()
        .map(|x| x.as_str().map(str::to_owned).ok_or_else(bad))
        .collect()
}

/// `response_format`: `text` (none), `json_object`, or `json_schema`.
fn response_format(f: &Fields<'_>) -> Result<Option<RequestedStructure>, ApiError> {
    match f.object("response_format")? {
        Some(rf) => from_response_format(rf),
        None => Ok(None),
    }
}

/// The constraint a `response_format` object asks for (a Responses
/// request's `text.format` is one too, once renamed).
pub fn from_response_format(
    rf: &serde_json::Map<String, Value>,
) -> Result<Option<RequestedStructure>, ApiError> {
    let rf = Fields(rf);
    let kind = rf.str("type")?.ok_or_else(|| {
        invalid(
            "response_format.type",
            "'response_format.type' is required: 'text', 'json_object' or 'json_schema'",
        )
    })?;
    let constraint = match kind {
        "text" => return Ok(None),
        "json_object" => match rf.0.get("schema").filter(|v| !v.is_null()) {
            // llama.cpp's server takes a schema here; honour it too.
            Some(s) => OutputConstraint::JsonSchema(schema_value(s, "response_format.schema")?),
            None => OutputConstraint::JsonObject,
        },
        "json_schema" => {
            let js = rf.object("json_schema")?.ok_or_else(|| {
                invalid(
                    "response_format.json_schema",
                    "'response_format.json_schema' is required when the type is 'json_schema'",
                )
            })?;
            let schema = js.get("schema").filter(|v| !v.is_null()).ok_or_else(|| {
                invalid(
                    "response_format.json_schema.schema",
                    "'response_format.json_schema.schema' is required",
                )
            })?;
            OutputConstraint::JsonSchema(schema_value(schema, "response_format.json_schema.schema")?)
        }
        other => {
            return Err(invalid(
                "response_format.type",
                format!("'response_format.type' must be 'text', 'json_object' or 'json_schema', not '{other}'"),
            ))
        }
    };
    let param = match &constraint {
        OutputConstraint::JsonObject => "response_format",
        _ if kind == "json_object" => "response_format.schema",
        _ => "response_format.json_schema.schema",
    };
    Ok(Some(RequestedStructure {
        spec: StructuredOutputs::new(constraint),
        param: param.into(),
    }))
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`,
/// `grammar` or `json_object`, with its JSON options.
fn structured_outputs(f: &Fields<'_>) -> Result<Option<RequestedStructure>, ApiError> {
    let Some(so) = f.object("structured_outputs")? else {
        return Ok(None);
    };
    let so_f = Fields(so);
    let mut found: Vec<(OutputConstraint, &str)> = Vec::new();
    if let Some(v) = so.get("json").filter(|v| !v.is_null()) {
        found.push((
            OutputConstraint::JsonSchema(schema_value(v, "structured_outputs.json")?),
            "structured_outputs.json",
        ));
    }
    if let Some(rx) = so_f.str("regex")? {
        found.push((
            OutputConstraint::Regex(rx.into()),
            "structured_outputs.regex",
        ));
    }
    if let Some(v) = so.get("choice").filter(|v| !v.is_null()) {
        found.push((
            OutputConstraint::Choice(strings(v, "structured_outputs.choice")?),
            "structured_outputs.choice",
        ));
    }
    if let Some(g) = so_f.str("grammar")? {
        found.push((
            OutputConstraint::Grammar(g.into()),
            "structured_outputs.grammar",
        ));
    }
    if so_f.bool("json_object")?.unwrap_or(false) {
        found.push((
            OutputConstraint::JsonObject,
            "structured_outputs.json_object",
        ));
    }
    if found.len() > 1 {
        return Err(invalid(
            "structured_outputs",
            "'structured_outputs' takes exactly one of 'json', 'regex', 'choice', 'grammar' and 'json_object'",
        ));
    }
    let Some((constraint, param)) = found.pop() else {
        return Err(invalid(
            "structured_outputs",
            "'structured_outputs' needs one of 'json', 'regex', 'choice', 'grammar' or 'json_object'",
        ));
    };
    let mut spec = StructuredOutputs::new(constraint);
    spec.disable_any_whitespace = so_f.bool("disable_any_whitespace")?.unwrap_or(false);
    spec.disable_additional_properties =
        so_f.bool("disable_additional_properties")?.unwrap_or(false);
    Ok(Some(RequestedStructure {
        spec,
        param: param.into(),
    }))
}

/// The `guided_*` fields vLLM removed in favour of `structured_outputs`,
/// which older clients still send.
fn guided(f: &Fields<'_>) -> Result<Option<RequestedStructure>, ApiError> {
    let mut found: Vec<(OutputConstraint, &str)> = Vec::new();
    if let Some(v) = f.0.get("guided_json").filter(|v| !v.is_null()) {
        found.push((
            OutputConstraint::JsonSchema(schema_value(v, "guided_json")?),
            "guided_json",
        ));
    }
    if let Some(rx) = f.str("guided_regex")? {
        found.push((OutputConstraint::Regex(rx.into()), "guided_regex"));
    }
    if let Some(v) = f.0.get("guided_choice").filter(|v| !v.is_null()) {
        found.push((
            OutputConstraint::Choice(strings(v, "guided_choice")?),
            "guided_choice",
        ));
    }
    if let Some(g) = f.str("guided_grammar")? {
        found.push((OutputConstraint::Grammar(g.into()), "guided_grammar"));
    }
    if found.len() > 1 {
        return Err(invalid(
            found[1].1,
            "give only one of 'guided_json', 'guided_regex', 'guided_choice' and 'guided_grammar'",
        ));
    }
    Ok(found.pop().map(|(c, param)| RequestedStructure {
        spec: StructuredOutputs::new(c),
        param: param.into(),
    }))
}

/// The request's constraint, if it asks for one. Asking in two ways at
/// once (say `response_format` and `structured_outputs`) is refused rather
/// than resolved silently.
pub fn parse(f: &Fields<'_>) -> Result<Option<RequestedStructure>, ApiError> {
    let mut all: Vec<RequestedStructure> =
        [response_format(f)?, structured_outputs(f)?, guided(f)?]
            .into_iter()
            .flatten()
            .collect();
    if all.len() > 1 {
        return Err(invalid(
            &all[1].param,
            format!(
                "the request asks for structured output twice ('{}' and '{}'); give one",
                all[0].param, all[1].param
            ),
        ));
    }
    Ok(all.pop())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(body: Value) -> Result<Option<RequestedStructure>, ApiError> {
        parse(&Fields::of(&body).unwrap())
    }

    #[test]
    fn response_format_maps_onto_constraints() {
        assert_eq!(
            parsed(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        let o = parsed(json!({"response_format": {"type": "json_object"}}))
            .unwrap()
            .unwrap();
        assert_eq!(o.spec.constraint, OutputConstraint::JsonObject);
        let s = parsed(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": true}}}))
        .unwrap()
        .unwrap();
        assert_eq!(
            s.spec.constraint,
            OutputConstraint::JsonSchema(json!({"type": "integer"}))
        );
        assert_eq!(s.param, "response_format.json_schema.schema");
    }

    #[test]
    fn vllm_fields_and_options() {
        let s = parsed(
            json!({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": true}}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            s.spec.constraint,
            OutputConstraint::Choice(vec!["a".into(), "b".into()])
        );
        assert!(s.spec.disable_any_whitespace);
        let g = parsed(json!({"guided_json": "{\"type\": \"object\"}"}))
            .unwrap()
            .unwrap();
        assert_eq!(
            g.spec.constraint,
            OutputConstraint::JsonSchema(json!({"type": "object"}))
        );
        assert_eq!(g.param, "guided_json");
    }

    #[test]
    fn bad_or_doubled_requests_name_the_field() {
        let e = parsed(json!({"response_format": {"type": "xml"}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.type"));
        let e = parsed(json!({"response_format": {"type": "json_schema"}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.json_schema"));
        let e = parsed(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("structured_outputs"));
        let e = parsed(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_regex"));
        let e = parsed(json!({"guided_choice": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_choice"));
        let e = parsed(json!({"guided_json": "{not json"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_json"));
    }
}
