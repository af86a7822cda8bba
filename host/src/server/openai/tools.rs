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
use crate::server::openai::protocol::Fields;
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
pub fn parse(
    f: &Fields<'_>,
    auto_parser: Option<ToolCallParser>,
) -> Result<Option<ToolRequest>, ApiError> {
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let choice = f.0.get("tool_choice").filter(|v| !v.is_null());
    let raw = match f.0.get("tools").filter(|v| !v.is_null()) {
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
                let options: Vec<Value> = self
                    .tools
                    .iter()
                    .map(|t| {
                        json!({
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "enum": [t.name]},
                                "parameters": t.parameters,
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

/// Splits a choice's finished text into content and calls.
pub fn extract(mode: &ToolMode, text: &str) -> ParsedOutput {
    match mode {
        ToolMode::Named(name) => ParsedOutput {
            content: None,
            calls: vec![ParsedToolCall {
                name: name.clone(),
                arguments: text.to_string(),
            }],
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
                // Cut short by max_tokens: the text stays as content.
                _ => ParsedOutput {
                    content: Some(text.to_string()),
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
        parse(&Fields::of(&body).unwrap(), auto)
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
    fn required_output_becomes_calls_and_truncation_stays_text() {
        let out = extract(
            &ToolMode::Required,
            r#"[{"name": "get_time", "parameters": {}}]"#,
        );
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].name, "get_time");
        assert_eq!(out.calls[0].arguments, "{}");
        let cut = extract(&ToolMode::Required, r#"[{"name": "get_ti"#);
        assert!(cut.calls.is_empty());
        assert_eq!(cut.content.as_deref(), Some(r#"[{"name": "get_ti"#));
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
