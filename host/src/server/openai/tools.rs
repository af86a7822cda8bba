//! OpenAI tool calling on chat: the `tools` / `tool_choice` /
//! `parallel_tool_calls` fields, the prompt they put in front of the model,
//! and the `tool_calls` the response carries.
//!
//! A named `tool_choice` and `required` are enforced by structured output:
//! the output is constrained to the function's parameters (named) or to a
//! JSON list of `{name, parameters}` calls (required), the schemas vLLM
//! builds. `auto` lets the model write freely and parses its output with
//! the server's `--tool-call-parser` ([`ToolCallParser`]).

use crate::engine::structured_output::{OutputConstraint, StructuredOutputs};
use crate::server::errors::ApiError;
use crate::server::openai::tool_parsers::{ParsedOutput, ParsedToolCall, ToolCallParser};
use serde_json::{json, Map, Value};

/// One function the client offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The JSON schema of its arguments (`{"type": "object"}` if none).
    pub parameters: Value,
}

/// How the response turns output into tool calls.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolMode {
    /// The output is the arguments of this function.
    Named(String),
    /// The output is a JSON list of `{"name", "parameters"}` calls.
    Required,
    /// The output is free text that the parser searches for calls.
    Auto(ToolCallParser),
}

/// The tool fields of a chat request, validated.
#[derive(Clone, Debug)]
pub struct ToolRequest {
    pub tools: Vec<Tool>,
    /// `None` when the tools are only described (`tool_choice: "none"`).
    pub mode: Option<ToolMode>,
    /// The `tools` list as sent, for chat templates that render it.
    pub raw: Value,
    pub parallel: bool,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(Some(param.to_string()), message)
}

/// Parses `tools`, `tool_choice` and `parallel_tool_calls`. `auto_parser`
/// is the server's `--tool-call-parser` under `--enable-auto-tool-choice`.
/// Without tools, a `tool_choice` other than `none` is refused.
pub fn parse_fields(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
    auto_parser: Option<ToolCallParser>,
) -> Result<Option<ToolRequest>, ApiError> {
    let parallel = parallel_tool_calls.unwrap_or(true);
    let choice = tool_choice.filter(|v| !v.is_null());
    let raw = match tools.filter(|v| !v.is_null()) {
        None => {
            return match choice {
                None => Ok(None),
                Some(Value::String(s)) if s == "none" => Ok(None),
                Some(_) => Err(invalid(
                    "tool_choice",
                    "'tool_choice' needs 'tools': the request offers no function to call",
                )),
            }
        }
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid("tools", "'tools' must be a list of tools")),
    };
    let mut tools = Vec::with_capacity(raw.len());
    for (i, t) in raw.iter().enumerate() {
        let param = format!("tools[{i}]");
        let kind = t.get("type").and_then(Value::as_str);
        if kind != Some("function") {
            return Err(invalid(
                &format!("{param}.type"),
                format!("{param}.type must be 'function'; other tool types are not supported"),
            ));
        }
        let func = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                invalid(
                    &format!("{param}.function"),
                    format!("{param}.function must be an object"),
                )
            })?;
        let name = func
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                invalid(
                    &format!("{param}.function.name"),
                    format!("{param}.function.name must be a non-empty string"),
                )
            })?;
        let parameters = match func.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(invalid(
                    &format!("{param}.function.parameters"),
                    format!("{param}.function.parameters must be a JSON schema object"),
                ))
            }
        };
        tools.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    let mode = match choice {
        None => auto_parser.map(ToolMode::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => None,
            "required" => Some(ToolMode::Required),
            "auto" => Some(ToolMode::Auto(auto_parser.ok_or_else(|| {
                invalid(
                    "tool_choice",
                    "\"auto\" tool choice needs the server to run with --enable-auto-tool-choice and --tool-call-parser",
                )
            })?)),
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!("'tool_choice' must be 'none', 'auto', 'required' or a named function, not '{other}'"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    invalid(
                        "tool_choice",
                        "a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(invalid(
                    "tool_choice",
                    format!("'tool_choice' names the function '{name}', which is not in 'tools'"),
                ));
            }
            Some(ToolMode::Named(name.to_string()))
        }
        Some(_) => {
            return Err(invalid(
                "tool_choice",
                "'tool_choice' must be a string or an object",
            ))
        }
    };
    Ok(Some(ToolRequest {
        tools,
        mode,
        raw: Value::Array(raw.clone()),
        parallel,
    }))
}

impl ToolRequest {
    /// The constraint that enforces a named or required choice. Objects
    /// of the parameters that do not say otherwise take no properties
    /// beyond those listed: a function's arguments are its parameters, and
    /// small models otherwise wander into keys nobody asked for.
    pub fn constraint(&self) -> Option<(StructuredOutputs, &'static str)> {
        let (mut spec, param) = self.unclosed_constraint()?;
        spec.disable_additional_properties = true;
        Some((spec, param))
    }

    fn unclosed_constraint(&self) -> Option<(StructuredOutputs, &'static str)> {
        match self.mode.as_ref()? {
            ToolMode::Named(name) => {
                let tool = self.tools.iter().find(|t| &t.name == name)?;
                Some((
                    StructuredOutputs::new(OutputConstraint::JsonSchema(tool.parameters.clone())),
                    "tools",
                ))
            }
            ToolMode::Required => {
                let mut defs = Map::new();
                let mut definitions = Map::new();
                let options: Vec<Value> = self
                    .tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let parameters =
                            hoist_definitions(i, &t.parameters, &mut defs, &mut definitions);
                        json!({
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "enum": [t.name]},
                                "parameters": parameters,
                            },
                            "required": ["name", "parameters"],
                        })
                    })
                    .collect();
                let mut schema = json!({
                    "type": "array",
                    "minItems": 1,
                    // One alternative per tool; each closes its own
                    // object (a closed object around them would allow no
                    // property at all).
                    "items": {"anyOf": options},
                });
                if !defs.is_empty() {
                    schema["$defs"] = Value::Object(defs);
                }
                if !definitions.is_empty() {
                    schema["definitions"] = Value::Object(definitions);
                }
                if !self.parallel {
                    schema["maxItems"] = json!(1);
                }
                Some((
                    StructuredOutputs::new(OutputConstraint::JsonSchema(schema)),
                    "tools",
                ))
            }
            ToolMode::Auto(_) => None,
        }
    }
}

/// The key under the combined schema's `$defs` that holds tool `index`'s
/// parameters, when its own references need them (`#`, `#/properties/..`).
fn tool_root_name(index: usize) -> String {
    format!("tool{index}")
}

/// The prefix of tool `index`'s definitions under the combined schema's
/// `$defs` and `definitions`. No tool's prefixed name can equal another
/// tool's, nor a [`tool_root_name`] (which has no `__`).
fn tool_def_prefix(index: usize) -> String {
    format!("tool{index}__")
}

/// Tool `index`'s parameters as they sit inside the schema that combines
/// all tools, where a local `$ref` (`#/...`) resolves against that
/// schema's root rather than the tool's. Its `$defs` and `definitions`
/// move to `defs` and `definitions` (the combined root's) under prefixed
/// names, and its local references are rewritten to match: `#/$defs/X`
/// becomes `#/$defs/tool<index>__X`, `#/definitions/X` becomes
/// `#/definitions/tool<index>__X`, and any other local pointer (`#`
/// itself, a recursive reference to the root, or `#/properties/...`)
/// points into a copy of the parameters at `#/$defs/tool<index>`, which
/// the returned schema then references. References elsewhere (another
/// document, an anchor) are left as sent: the compiler refuses them.
fn hoist_definitions(
    index: usize,
    parameters: &Value,
    defs: &mut Map<String, Value>,
    definitions: &mut Map<String, Value>,
) -> Value {
    let mut params = parameters.clone();
    let (mut own_defs, mut own_definitions) = (Map::new(), Map::new());
    if let Some(o) = params.as_object_mut() {
        // `$id` would set a base URI for references that now resolve
        // against the combined root.
        o.remove("$id");
        if let Some(Value::Object(d)) = o.remove("$defs") {
            own_defs = d;
        }
        if let Some(Value::Object(d)) = o.remove("definitions") {
            own_definitions = d;
        }
    }
    let mut needs_root = false;
    rewrite_refs(&mut params, index, &mut needs_root);
    let prefix = tool_def_prefix(index);
    for (target, entries) in [(&mut *defs, own_defs), (&mut *definitions, own_definitions)] {
        for (name, mut schema) in entries {
            rewrite_refs(&mut schema, index, &mut needs_root);
            target.insert(format!("{prefix}{name}"), schema);
        }
    }
    if needs_root {
        defs.insert(tool_root_name(index), params);
        json!({"$ref": format!("#/$defs/{}", tool_root_name(index))})
    } else {
        params
    }
}

/// Keywords whose values are data, not schemas: a `$ref` inside them is
/// left alone.
const DATA_KEYWORDS: [&str; 5] = ["const", "enum", "default", "examples", "example"];

/// Keywords whose values map names to schemas (the names are not
/// keywords).
const SCHEMA_MAPS: [&str; 5] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];

/// Rewrites the local `$ref`s of one schema of tool `index` as
/// [`hoist_definitions`] describes; sets `needs_root` where one points
/// into the tool's root.
fn rewrite_refs(schema: &mut Value, index: usize, needs_root: &mut bool) {
    match schema {
        Value::Object(o) => {
            for (key, value) in o.iter_mut() {
                let key = key.as_str();
                match value {
                    Value::String(r) if key == "$ref" => {
                        if let Some(new) = rewritten_ref(r, index, needs_root) {
                            *r = new;
                        }
                    }
                    _ if DATA_KEYWORDS.contains(&key) => {}
                    // The names of a schema map are not keywords: a
                    // property called `enum` is a schema.
                    Value::Object(m) if SCHEMA_MAPS.contains(&key) => {
                        for v in m.values_mut() {
                            rewrite_refs(v, index, needs_root);
                        }
                    }
                    _ => rewrite_refs(value, index, needs_root),
                }
            }
        }
        Value::Array(a) => {
            for v in a.iter_mut() {
                rewrite_refs(v, index, needs_root);
            }
        }
        _ => {}
    }
}

/// One local reference of tool `index`, pointed at the combined schema;
/// `None` for one that is not local (left as sent).
fn rewritten_ref(r: &str, index: usize, needs_root: &mut bool) -> Option<String> {
    let pointer = r.strip_prefix('#')?;
    if !(pointer.is_empty() || pointer.starts_with('/')) {
        // `#anchor`: not a JSON pointer.
        return None;
    }
    for keyword in ["$defs", "definitions"] {
        if let Some(rest) = pointer
            .strip_prefix('/')
            .and_then(|p| p.strip_prefix(keyword))
            .and_then(|p| p.strip_prefix('/'))
        {
            // The name's escapes (`~0`, `~1`, `%xx`) carry over: the
            // prefix has none.
            return Some(format!("#/{keyword}/{}{rest}", tool_def_prefix(index)));
        }
    }
    *needs_root = true;
    // `#/` is the root too.
    let pointer = if pointer == "/" { "" } else { pointer };
    Some(format!("#/$defs/{}{pointer}", tool_root_name(index)))
}

/// A choice's text as content when it holds no call: as written, but
/// without the markers of an auto parser's format that are never content
/// (harmony's).
pub fn uncalled_text<'a>(mode: Option<&ToolMode>, text: &'a str) -> std::borrow::Cow<'a, str> {
    match mode {
        Some(ToolMode::Auto(p)) => p.plain(text),
        _ => std::borrow::Cow::Borrowed(text),
    }
}

/// Splits a choice's finished text into content and calls.
pub fn extract(mode: &ToolMode, text: &str) -> ParsedOutput {
    match mode {
        // The output is constrained to the arguments, so it is complete
        // JSON unless max_tokens cut it: a cut call is no call (the
        // arguments would be `{"a` or less), as with `required` below.
        ToolMode::Named(name) => match serde_json::from_str::<Value>(text) {
            Err(e) if e.is_eof() => ParsedOutput {
                content: None,
                calls: Vec::new(),
            },
            _ => ParsedOutput {
                content: None,
                calls: vec![ParsedToolCall {
                    name: name.clone(),
                    arguments: text.to_string(),
                }],
            },
        },
        ToolMode::Required => {
            let calls: Option<Vec<ParsedToolCall>> = serde_json::from_str::<Value>(text)
                .ok()
                .and_then(|v| v.as_array().cloned())
                .and_then(|list| {
                    list.iter()
                        .map(|c| {
                            Some(ParsedToolCall {
                                name: c.get("name")?.as_str()?.to_string(),
                                arguments: serde_json::to_string(c.get("parameters")?).ok()?,
                            })
                        })
                        .collect()
                });
            match calls {
                Some(calls) if !calls.is_empty() => ParsedOutput {
                    content: None,
                    calls,
                },
                // Cut short by max_tokens: no call, and no content either
                // (the text is a fragment of the call list, not an answer).
                _ => ParsedOutput {
                    content: None,
                    calls: Vec::new(),
                },
            }
        }
        ToolMode::Auto(parser) => parser.parse(text),
    }
}

/// A call as OpenAI's `tool_calls` entries carry it.
pub fn call_json(id: &str, call: &ParsedToolCall) -> Value {
    json!({
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

/// A fresh tool-call id, in vLLM's shape.
pub fn new_call_id() -> String {
    format!("chatcmpl-tool-{:032x}", rand::random::<u128>())
}

/// The messages as a chat template takes them, and the extra template
/// variables (`tools`).
///
/// Assistant `tool_calls` carry their `arguments` as objects, as Hugging
/// Face templates expect (OpenAI sends them as JSON strings). A template
/// that knows nothing of tools (its source never mentions them) gets a
/// generic prompt instead: the functions described in the system message,
/// past calls written as `<tool_call>` blocks and tool results as
/// `<tool_response>` user turns, the format the hermes parser reads.
pub fn template_input(
    messages: &Value,
    tools: Option<&ToolRequest>,
    template_source: &str,
) -> (Value, Map<String, Value>) {
    let knows_tools = template_source.contains("tools") || template_source.contains("tool_calls");
    let list = messages.as_array().cloned().unwrap_or_default();
    let mut out: Vec<Value> = Vec::with_capacity(list.len() + 1);
    for m in list {
        let mut m = m;
        if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for c in calls.iter_mut() {
                if let Some(args) = c.pointer_mut("/function/arguments") {
                    if let Some(parsed) = args
                        .as_str()
                        .and_then(|s| serde_json::from_str::<Value>(s).ok())
                    {
                        *args = parsed;
                    }
                }
            }
        }
        if !knows_tools {
            m = generic_message(m);
        }
        out.push(m);
    }
    let mut extra = Map::new();
    if let Some(t) = tools {
        if knows_tools {
            extra.insert("tools".into(), t.raw.clone());
        } else {
            let prompt = generic_tool_prompt(t);
            match out.first_mut() {
                Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => {
                    let content = first.get("content").and_then(Value::as_str).unwrap_or("");
                    first["content"] = json!(format!("{content}\n\n{prompt}"));
                }
                _ => out.insert(0, json!({"role": "system", "content": prompt})),
            }
        }
    }
    (Value::Array(out), extra)
}

/// One history message rewritten for a template without tool support.
fn generic_message(mut m: Value) -> Value {
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let content = m
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if role == "tool" {
        return json!({"role": "user", "content": format!("<tool_response>\n{content}\n</tool_response>")});
    }
    if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
        let mut text = content;
        for c in calls {
            let call = json!({
                "name": c.pointer("/function/name").cloned().unwrap_or(Value::Null),
                "arguments": c.pointer("/function/arguments").cloned().unwrap_or(json!({})),
            });
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
        }
        m = json!({"role": role, "content": text});
    }
    m
}

/// The system-prompt text that describes the tools to a model whose
/// template does not.
fn generic_tool_prompt(t: &ToolRequest) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to help with the user's request. \
         The functions are described in JSON schema inside <tools></tools>:\n<tools>\n",
    );
    if let Some(list) = t.raw.as_array() {
        for tool in list {
            s.push_str(&tool.to_string());
            s.push('\n');
        }
    }
    s.push_str(
        "</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments \
         inside <tool_call></tool_call>:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::openai::fields::Fields;

    fn tools_body(extra: Value) -> Value {
        let mut b = json!({"tools": [
            {"type": "function", "function": {"name": "get_weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}
        ]});
        if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        b
    }

    fn parsed(body: Value, auto: Option<ToolCallParser>) -> Result<Option<ToolRequest>, ApiError> {
        let f = Fields::of(&body).unwrap();
        parse_fields(
            f.0.get("tools"),
            f.0.get("tool_choice"),
            f.bool("parallel_tool_calls")?,
            auto,
        )
    }

    #[test]
    fn tool_choice_decides_the_mode() {
        let named = parsed(
            tools_body(
                json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
            ),
            None,
        )
        .unwrap()
        .unwrap();
        assert_eq!(named.mode, Some(ToolMode::Named("get_time".into())));
        let (c, _) = named.constraint().unwrap();
        assert_eq!(
            c.constraint,
            OutputConstraint::JsonSchema(json!({"type": "object"}))
        );
        let req = parsed(
            tools_body(json!({"tool_choice": "required", "parallel_tool_calls": false})),
            None,
        )
        .unwrap()
        .unwrap();
        let (c, _) = req.constraint().unwrap();
        let OutputConstraint::JsonSchema(s) = c.constraint else {
            panic!()
        };
        assert_eq!(s["maxItems"], json!(1));
        assert_eq!(
            s["items"]["anyOf"][0]["properties"]["name"]["enum"],
            json!(["get_weather"])
        );
        // Unset: auto where the server parses tool calls, else none.
        assert_eq!(
            parsed(tools_body(json!({})), None).unwrap().unwrap().mode,
            None
        );
        assert_eq!(
            parsed(tools_body(json!({})), Some(ToolCallParser::Hermes))
                .unwrap()
                .unwrap()
                .mode,
            Some(ToolMode::Auto(ToolCallParser::Hermes))
        );
    }

    #[test]
    fn bad_tool_requests_name_the_field() {
        let e = parsed(
            tools_body(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})),
            None,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert!(e.message.contains("nope"));
        let e = parsed(tools_body(json!({"tool_choice": "auto"})), None).unwrap_err();
        assert!(e.message.contains("--enable-auto-tool-choice"));
        let e = parsed(json!({"tool_choice": "required"}), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = parsed(json!({"tools": [{"type": "retrieval"}]}), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        let e = parsed(
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            None,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.parameters"));
    }

    #[test]
    fn forced_output_becomes_calls_and_truncation_is_no_call() {
        let out = extract(
            &ToolMode::Required,
            r#"[{"name": "get_time", "parameters": {}}]"#,
        );
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].name, "get_time");
        assert_eq!(out.calls[0].arguments, "{}");
        let cut = extract(&ToolMode::Required, r#"[{"name": "get_ti"#);
        assert!(cut.calls.is_empty());
        assert_eq!(cut.content, None);
        // A named call cut by max_tokens is no call; a complete one is.
        let named = ToolMode::Named("get_weather".into());
        for cut in ["", "{", "{\"city\": \"Par"] {
            let out = extract(&named, cut);
            assert!(out.calls.is_empty(), "{cut:?}");
            assert_eq!(out.content, None);
        }
        let out = extract(&named, "{\"city\": \"Paris\"}");
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].arguments, "{\"city\": \"Paris\"}");
    }

    /// Two tools whose parameters each carry a `$defs` entry `Item` of a
    /// different shape, as Pydantic writes nested models.
    fn defs_tools() -> Value {
        json!({"tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "add_order", "parameters": {
                "type": "object",
                "$defs": {"Item": {"type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"]}},
                "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
                "required": ["items"]}}},
            {"type": "function", "function": {"name": "tag", "parameters": {
                "type": "object",
                "definitions": {"Label": {"type": "string", "enum": ["a", "b"]}},
                "$defs": {"Item": {"type": "object",
                    "properties": {"label": {"$ref": "#/definitions/Label"},
                                   "child": {"$ref": "#/$defs/Item"}},
                    "required": ["label"]}},
                "properties": {"item": {"$ref": "#/$defs/Item"}},
                "required": ["item"]}}}
        ]})
    }

    fn required_schema(body: Value) -> Value {
        let req = parsed(body, None).unwrap().unwrap();
        let (c, _) = req.constraint().unwrap();
        let OutputConstraint::JsonSchema(s) = c.constraint else {
            panic!()
        };
        s
    }

    #[test]
    fn required_hoists_each_tools_definitions_to_the_root() {
        let s = required_schema(defs_tools());
        // Each tool's definitions sit at the root under its own names...
        assert_eq!(
            s["$defs"]["tool0__Item"]["properties"]["sku"],
            json!({"type": "string"})
        );
        assert_eq!(
            s["$defs"]["tool1__Item"]["properties"]["child"],
            json!({"$ref": "#/$defs/tool1__Item"})
        );
        assert_eq!(
            s["$defs"]["tool1__Item"]["properties"]["label"],
            json!({"$ref": "#/definitions/tool1__Label"})
        );
        assert_eq!(s["definitions"]["tool1__Label"]["enum"], json!(["a", "b"]));
        // ...and each tool's references point at its own.
        let p0 = &s["items"]["anyOf"][0]["properties"]["parameters"];
        assert_eq!(
            p0["properties"]["items"]["items"],
            json!({"$ref": "#/$defs/tool0__Item"})
        );
        assert!(p0.get("$defs").is_none());
        let p1 = &s["items"]["anyOf"][1]["properties"]["parameters"];
        assert_eq!(
            p1["properties"]["item"],
            json!({"$ref": "#/$defs/tool1__Item"})
        );
        assert!(p1.get("$defs").is_none() && p1.get("definitions").is_none());
        // The combined schema resolves: calls to either tool validate, and
        // arguments of one tool's shape do not pass for the other.
        let v = jsonschema::validator_for(&s).unwrap();
        assert!(v.is_valid(&json!([
            {"name": "add_order", "parameters": {"items": [{"sku": "x", "qty": 2}]}},
            {"name": "tag", "parameters": {"item": {"label": "a", "child": {"label": "b"}}}}
        ])));
        assert!(!v.is_valid(&json!([
            {"name": "add_order", "parameters": {"items": [{"label": "a"}]}}
        ])));
        assert!(!v.is_valid(&json!([
            {"name": "tag", "parameters": {"item": {"label": "c"}}}
        ])));
    }

    #[test]
    fn root_references_and_foreign_references() {
        // A recursive reference to the tool's root (`#`) and a pointer
        // into it go to a copy of the parameters; an external reference
        // and an anchor stay as sent; `$ref`s inside data are data.
        let body = json!({"tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "tree", "parameters": {
                "$id": "https://example.com/tree",
                "type": "object",
                "properties": {
                    "value": {"type": "integer", "default": {"$ref": "#/x"}},
                    "same": {"$ref": "#/properties/value"},
                    "children": {"type": "array", "items": {"$ref": "#"}},
                    "ext": {"$ref": "https://example.com/other.json"},
                    "anchor": {"$ref": "#node"}
                },
                "required": ["value"]}}},
            {"type": "function", "function": {"name": "plain",
                "parameters": {"type": "object", "properties": {"a": {"$ref": "#/"}}}}}
        ]});
        let s = required_schema(body);
        assert_eq!(
            s["items"]["anyOf"][0]["properties"]["parameters"],
            json!({"$ref": "#/$defs/tool0"})
        );
        let root = &s["$defs"]["tool0"];
        assert!(root.get("$id").is_none());
        let props = &root["properties"];
        assert_eq!(props["children"]["items"], json!({"$ref": "#/$defs/tool0"}));
        assert_eq!(
            props["same"],
            json!({"$ref": "#/$defs/tool0/properties/value"})
        );
        assert_eq!(props["value"]["default"], json!({"$ref": "#/x"}));
        assert_eq!(
            props["ext"],
            json!({"$ref": "https://example.com/other.json"})
        );
        assert_eq!(props["anchor"], json!({"$ref": "#node"}));
        assert_eq!(
            s["$defs"]["tool1"]["properties"]["a"],
            json!({"$ref": "#/$defs/tool1"})
        );
        // Tools without references are inlined as before.
        let plain = required_schema(tools_body(json!({"tool_choice": "required"})));
        assert!(plain.get("$defs").is_none() && plain.get("definitions").is_none());
        assert_eq!(
            plain["items"]["anyOf"][0]["properties"]["parameters"]["properties"]["city"],
            json!({"type": "string"})
        );
    }

    #[test]
    fn hoisted_names_keep_pointer_escapes() {
        let mut needs_root = false;
        assert_eq!(
            rewritten_ref("#/$defs/a~1b/properties/x", 3, &mut needs_root).as_deref(),
            Some("#/$defs/tool3__a~1b/properties/x")
        );
        assert!(!needs_root);
        assert_eq!(
            rewritten_ref("other.json#/$defs/A", 0, &mut needs_root),
            None
        );
        assert!(!needs_root);
        assert_eq!(
            rewritten_ref("#", 12, &mut needs_root).as_deref(),
            Some("#/$defs/tool12")
        );
        assert!(needs_root);
    }

    #[test]
    fn templates_without_tools_get_the_generic_prompt_and_history() {
        let t = parsed(tools_body(json!({})), None).unwrap().unwrap();
        let msgs = json!([
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
        ]);
        let (out, extra) = template_input(&msgs, Some(&t), "{{ messages }}");
        assert!(extra.is_empty());
        let out = out.as_array().unwrap();
        assert_eq!(out[0]["role"], "system");
        assert!(out[0]["content"].as_str().unwrap().contains("get_weather"));
        assert!(out[2]["content"].as_str().unwrap().contains(
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}"
        ));
        assert_eq!(
            out[3],
            json!({"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"})
        );
        // A template that renders tools gets them, and arguments as objects.
        let (out, extra) = template_input(&msgs, Some(&t), "{% for t in tools %}{% endfor %}");
        assert_eq!(extra["tools"], t.raw);
        assert_eq!(
            out[1]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
    }
}
