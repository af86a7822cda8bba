//! `POST /v1/responses`: OpenAI's Responses API over the same engine as
//! chat. A request (`instructions`, `input` as text or messages,
//! `max_output_tokens`, `temperature`, `top_p`, `text.format`) becomes a
//! chat request; the answer is a `response` object, or, streamed, its
//! events (`response.created` … `response.output_text.delta` …
//! `response.completed`). `previous_response_id` continues a conversation
//! kept in a bounded in-memory store per tenant, whose input items
//! `GET /v1/responses/{id}/input_items` lists. `background: true` (with
//! `store`) answers at once with a queued response that generation
//! completes in the store, and `POST /v1/responses/{id}/cancel` stops.
//! Function tools may come grouped in `namespace` tools (as Codex sends
//! them); `reasoning` input items continue a reasoning model's turn;
//! `include: ["message.output_text.logprobs"]` returns (and streams) the
//! answer's logprobs. `POST /v1/responses/render` gives the prompt's token
//! ids without generating. Built-in tools, files and images are refused
//! with a 400.

use super::protocol::{
    chat_tools, function_call_item, input_item_list, input_messages, invalid, response_format,
    Namespaces, ResponsesRequest,
};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::chat_completion::protocol::{ChatCompletionRequest, ChatFields};
use crate::server::openai::engine_io::{collect, sse_response, start_run, Api, Run};
use crate::server::openai::pipeline::{prepare, ChatPrompt, PromptRequest};
use crate::server::openai::protocol::{parse_common, SamplingRequest};
use crate::server::openai::wire::from_body;
use crate::server::openai::{admit, now_secs, structured, tools};
use crate::server::{AppState, Body};
use bytes::Bytes;
use hyper::body::Frame;
use hyper::Response;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// A 404 in OpenAI's shape for a response id this tenant has not stored.
fn response_not_found(id: &str) -> ApiError {
    let mut e = ApiError::invalid(
        Some("response_id".to_string()),
        format!("Response with id '{id}' not found."),
    );
    e.status = hyper::StatusCode::NOT_FOUND;
    e
}

/// `GET /v1/responses/{id}`: a stored response of the caller's tenant.
pub fn retrieve(
    state: &AppState,
    id: &str,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    match state.responses.response(key, id) {
        Some(r) => Ok(json_response(&r)),
        None => Err(response_not_found(id)),
    }
}

/// `GET /v1/responses/{id}/input_items`: the items of the request's
/// `input`, as OpenAI lists them: `order` (`desc`, the default, or `asc`),
/// `limit` (1 to 100, default 20) and `after` (an item id) from `query`.
pub fn input_items(
    state: &AppState,
    id: &str,
    query: Option<&str>,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    let mut items = state
        .responses
        .input_items(key, id)
        .ok_or_else(|| response_not_found(id))?;
    let (mut order, mut limit, mut after) = ("desc".to_string(), 20usize, None);
    for (k, v) in query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| p.split_once('='))
    {
        match k {
            "order" if v == "asc" || v == "desc" => order = v.to_string(),
            "order" => return Err(invalid("order", "'order' must be 'asc' or 'desc'")),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=100).contains(l))
                    .ok_or_else(|| invalid("limit", "'limit' must be an integer from 1 to 100"))?
            }
            "after" => after = Some(crate::server::percent_decode(v)),
            _ => {}
        }
    }
    if order == "desc" {
        items.reverse();
    }
    if let Some(a) = after {
        let at = items
            .iter()
            .position(|i| i["id"] == a.as_str())
            .ok_or_else(|| invalid("after", format!("no input item '{a}' in this response")))?;
        items.drain(..=at);
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    Ok(json_response(&json!({
        "object": "list",
        "first_id": items.first().map(|i| i["id"].clone()),
        "last_id": items.last().map(|i| i["id"].clone()),
        "has_more": has_more,
        "data": items,
    })))
}

/// `POST /v1/responses/{id}/cancel`: stops a background response that is
/// still generating (its status becomes `cancelled`); one that finished is
/// returned as it is. Only background responses can be cancelled.
pub fn cancel(
    state: &AppState,
    id: &str,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    let mut response = state
        .responses
        .response(key, id)
        .ok_or_else(|| response_not_found(id))?;
    if response["background"] != json!(true) {
        return Err(invalid(
            "response_id",
            "Only responses created with background: true can be cancelled.",
        ));
    }
    if let Some(wake) = state.responses.finish_background(key, id) {
        response["status"] = json!("cancelled");
        state.responses.set_response(key, id, response.clone());
        // The generation stops (and its engine requests are aborted).
        wake.notify_one();
    }
    Ok(json_response(&response))
}

/// `DELETE /v1/responses/{id}`.
pub fn delete(
    state: &AppState,
    id: &str,
    tenant: Option<&crate::tenants::Tenant>,
) -> Result<Response<Body>, ApiError> {
    let key = tenant.map_or("", |t| t.id.as_str());
    if state.responses.delete(key, id) {
        Ok(json_response(
            &json!({"id": id, "object": "response", "deleted": true}),
        ))
    } else {
        Err(response_not_found(id))
    }
}

/// What the response object echoes of the request.
struct Echo {
    id: String,
    model: String,
    created: u64,
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    previous: Value,
    text: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    background: bool,
    /// `namespace` tools' functions, to name their calls apart.
    namespaces: Namespaces,
    /// `include` asked for the answer's logprobs.
    logprobs: bool,
}

impl Echo {
    /// The response object with this status, output, usage and
    /// `incomplete_details`.
    fn object(&self, status: &str, output: Vec<Value>, usage: Value, incomplete: Value) -> Value {
        json!({
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output,
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "previous_response_id": self.previous, "text": self.text,
            "tools": self.tools, "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls, "background": self.background,
            "incomplete_details": incomplete, "error": null, "metadata": {},
            "usage": usage,
        })
    }
}

fn usage_of(run: &Run) -> Value {
    let output: usize = run.choices.iter().map(|c| c.tokens).sum();
    json!({
        "input_tokens": run.prompt_tokens,
        "input_tokens_details": {"cached_tokens": run.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens()},
        "total_tokens": run.prompt_tokens + output,
    })
}

fn message_item(id: &str, status: &str, text: Option<&str>, logprobs: Value) -> Value {
    let content: Vec<Value> = text
        .map(|t| json!({"type": "output_text", "text": t, "annotations": [], "logprobs": logprobs}))
        .into_iter()
        .collect();
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

/// `(status, incomplete_details)` for a finish reason.
fn status_of(finish: Option<&str>) -> (&'static str, Value) {
    match finish {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some("abort") => ("cancelled", Value::Null),
        _ => ("completed", Value::Null),
    }
}

/// `POST /v1/responses`.
pub async fn responses(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    respond(state, body, tenant, false).await
}

/// `POST /v1/responses/render`: the token ids a Responses request's prompt
/// would have (its conversation, instructions and tools as the chat
/// template renders them), generating nothing; the shape of
/// `/v1/chat/completions/render`'s answer.
pub async fn render(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    respond(state, body, tenant, true).await
}

/// A Responses request served (or, with `render_only`, only rendered): read
/// into its typed request, turned into the typed chat request it is
/// served as, and run through the pipeline every generation takes.
async fn respond(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    render_only: bool,
) -> Result<Response<Body>, ApiError> {
    let id = format!("resp_{:032x}", rand::random::<u128>());
    let store_key = tenant.as_ref().map_or_else(String::new, |t| t.id.clone());
    let (body, mut ctx) = admit(&state, tenant, &id, "/v1/responses", body).await?;
    let request: ResponsesRequest = from_body(&body)?;
    request.refuse_unsupported(state.reasoning_parser().is_some())?;
    // No model: the first served name, as chat and completions (and
    // vLLM) do.
    let model = match &request.model {
        Some(m) => m.clone(),
        None => state
            .default_model()
            .ok_or_else(|| invalid("model", "'model' is required"))?
            .to_string(),
    };
    let previous = request.previous_response_id.clone();
    let mut messages: Vec<Value> = match &previous {
        Some(p) => state.responses.conversation(&store_key, p).ok_or_else(|| {
            invalid(
                "previous_response_id",
                format!("Previous response with id '{p}' not found."),
            )
        })?,
        None => Vec::new(),
    };
    // Instructions apply to this turn only, as OpenAI's do.
    if let Some(i) = &request.instructions {
        messages.retain(|m| m.get("role").and_then(Value::as_str) != Some("system"));
        messages.insert(0, json!({"role": "system", "content": i}));
    }
    messages.extend(input_messages(request.input.as_ref())?);
    let input_items = input_item_list(request.input.as_ref());
    let stream = request.stream.unwrap_or(false);
    let store = request.store.unwrap_or(true);
    let background = request.background.unwrap_or(false);
    // `include: ["message.output_text.logprobs"]` (with `top_logprobs`
    // alternatives per token): the answer's logprobs, as chat's.
    let logprobs = request.wants_logprobs();
    let (chat_tools, chat_choice, namespaces) =
        chat_tools(request.tools.as_ref(), request.tool_choice.as_ref())?;
    // A forced call (named or required) is the whole output, so a
    // `text.format` beside it has no text to shape; instructor's
    // RESPONSES_TOOLS mode sends both, the format being the tool's own
    // schema. The tool's constraint applies.
    let forced = chat_choice
        .as_ref()
        .is_some_and(|c| c.is_object() || c == "required");
    let structured = match response_format(request.text.as_ref())?.filter(|_| !forced) {
        Some(rf) => structured::from_response_format(&rf)?,
        None => None,
    };
    // The chat request this response is served as.
    let chat = ChatCompletionRequest {
        sampling: SamplingRequest {
            model: Some(model.clone()),
            temperature: request.temperature,
            top_p: request.top_p,
            max_tokens: request.max_output_tokens,
            ..Default::default()
        },
        chat: ChatFields {
            messages: Some(Value::Array(messages.clone())),
            logprobs: logprobs.then_some(true),
            top_logprobs: request.top_logprobs.filter(|_| logprobs),
            // `reasoning.effort`, as chat's `reasoning_effort` (which
            // gpt-oss's template reads).
            reasoning_effort: request.reasoning.as_ref().and_then(|r| r.effort.clone()),
            tools: chat_tools,
            tool_choice: chat_choice,
            parallel_tool_calls: request.parallel_tool_calls,
            ..Default::default()
        },
    };
    let common = parse_common(
        &chat.sampling,
        chat.endpoint_sampling(),
        structured,
        state.default_model(),
    )?;
    // What a tenant's render-prompt plugin renders: the chat, as JSON.
    let chat_json = chat.to_json();
    let prompt = PromptRequest::Chat(ChatPrompt {
        request: &chat,
        json: &chat_json,
        format_field: "text.format",
        size_param: "input",
    });
    let prepared = prepare(&state, common, prompt, &mut ctx, "/v1/responses").await?;
    if render_only {
        let common = &prepared.common;
        let mut sampling = Map::new();
        if let Some(m) = common.params.max_tokens {
            sampling.insert("max_tokens".into(), json!(m));
        }
        if let Some(t) = common.params.temperature {
            sampling.insert("temperature".into(), json!(t));
        }
        let ids = prepared.prompts.first().map(|p| &p.ids);
        return Ok(json_response(
            &json!({"request_id": id, "model": common.model,
            "token_ids": ids, "sampling_params": sampling, "features": null}),
        ));
    }
    // The response echoes these as the request wrote them.
    let given = |k: &str| body.get(k).cloned().filter(|v| !v.is_null());
    let echo = Echo {
        id: id.clone(),
        model: model.clone(),
        created: now_secs(),
        instructions: json!(request.instructions),
        max_output_tokens: body
            .get("max_output_tokens")
            .cloned()
            .unwrap_or(Value::Null),
        temperature: body.get("temperature").cloned().unwrap_or(Value::Null),
        top_p: body.get("top_p").cloned().unwrap_or(Value::Null),
        previous: json!(previous),
        text: body
            .get("text")
            .cloned()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
        tools: given("tools").unwrap_or(json!([])),
        tool_choice: given("tool_choice").unwrap_or(json!("auto")),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        background,
        namespaces,
        logprobs,
    };
    let run = start_run(
        state.clone(),
        prepared.common,
        prepared.prompts,
        Api::Chat,
        id.clone(),
        ctx,
        prepared.tools,
    )
    .await?;
    if background {
        return Ok(json_response(&run_in_background(
            state,
            run,
            echo,
            store_key,
            messages,
            input_items,
        )));
    }
    let remember = move |assistant: Value, response: &Value| {
        if store {
            let mut conversation = messages;
            conversation.push(assistant);
            state
                .responses
                .put(&store_key, id, response.clone(), conversation, input_items);
        }
    };
    if !stream {
        let run = collect(run).await?;
        let (status, incomplete) = status_of(run.choices[0].finish_reason);
        let msg_id = format!("msg_{:032x}", rand::random::<u128>());
        let (items, assistant) = final_output(&run, &msg_id, &echo);
        let out = echo.object(status, items, usage_of(&run), incomplete);
        remember(assistant, &out);
        return Ok(json_response(&out));
    }
    Ok(stream_events(run, echo, remember))
}

/// `background: true`: stores the response as `queued` and answers with
/// it at once; the generation goes on in a task that stores the finished
/// response, unless `cancel` (which wakes the task) got there first. The
/// task drops the run when cancelled, which aborts its engine requests.
fn run_in_background(
    state: Arc<AppState>,
    run: Run,
    echo: Echo,
    store_key: String,
    messages: Vec<Value>,
    input_items: Vec<Value>,
) -> Value {
    let queued = echo.object("queued", vec![], Value::Null, Value::Null);
    let id = echo.id.clone();
    state.responses.put(
        &store_key,
        id.clone(),
        queued.clone(),
        messages.clone(),
        input_items.clone(),
    );
    let wake = state.responses.start_background(&store_key, &id);
    let answer = queued.clone();
    tokio::spawn(async move {
        let mut in_progress = queued;
        in_progress["status"] = json!("in_progress");
        state
            .responses
            .set_response(&store_key, &id, in_progress.clone());
        let result = tokio::select! {
            r = collect(run) => r,
            // Cancelled: `cancel` wrote the final state.
            _ = wake.notified() => return,
        };
        if state.responses.finish_background(&store_key, &id).is_none() {
            return;
        }
        match result {
            Ok(run) => {
                let (status, incomplete) = status_of(run.choices[0].finish_reason);
                let msg_id = format!("msg_{:032x}", rand::random::<u128>());
                let (items, assistant) = final_output(&run, &msg_id, &echo);
                let out = echo.object(status, items, usage_of(&run), incomplete);
                let mut conversation = messages;
                conversation.push(assistant);
                state
                    .responses
                    .put(&store_key, id, out, conversation, input_items);
            }
            Err(e) => {
                let mut failed = in_progress;
                failed["status"] = json!("failed");
                failed["error"] = json!({"code": e.code, "message": e.message});
                state.responses.set_response(&store_key, &id, failed);
            }
        }
    });
    answer
}

/// The output items of a finished run (its text as a message, or the
/// function calls its output holds, after any text), and the assistant
/// turn that `previous_response_id` continues from.
fn final_output(run: &Run, msg_id: &str, echo: &Echo) -> (Vec<Value>, Value) {
    let c = &run.choices[0];
    let (mut items, assistant) = answer_output(run, msg_id, echo);
    // A reasoning model's thinking comes first, as its own item.
    if !c.reasoning.is_empty() {
        items.insert(
            0,
            json!({"type": "reasoning", "id": format!("rs_{:032x}", rand::random::<u128>()),
                "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": c.reasoning}]}),
        );
    }
    (items, assistant)
}

/// The answer's logprobs in an `output_text` part: with `include`, its
/// tokens' (as chat's `logprobs.content`), else an empty list.
fn text_logprobs(run: &Run, lps: &[crate::engine::request::TokenLogprob], echo: &Echo) -> Value {
    if !echo.logprobs {
        return json!([]);
    }
    match run.logprobs_json(None, lps, 0) {
        Value::Object(mut o) => o.remove("content").unwrap_or(json!([])),
        _ => json!([]),
    }
}

/// [`final_output`]'s answer: its text as a message, or its function calls.
fn answer_output(run: &Run, msg_id: &str, echo: &Echo) -> (Vec<Value>, Value) {
    let c = &run.choices[0];
    let lp = || text_logprobs(run, &c.logprobs, echo);
    let parsed = run.tools.as_ref().map(|m| tools::extract(m, &c.text));
    match parsed {
        Some(p) if !p.calls.is_empty() => {
            let mut items = Vec::new();
            if let Some(text) = p.content.as_deref().filter(|t| !t.is_empty()) {
                items.push(message_item(msg_id, "completed", Some(text), json!([])));
            }
            let mut calls = Vec::new();
            for call in &p.calls {
                let (item, chat) = function_call_item(call, "completed", &echo.namespaces);
                items.push(item);
                calls.push(chat);
            }
            (
                items,
                json!({"role": "assistant", "content": p.content, "tool_calls": calls}),
            )
        }
        // A forced call (named or required) that max_tokens cut is no
        // call, and its fragment of JSON is no answer either.
        Some(_) if !matches!(run.tools, Some(tools::ToolMode::Auto(_))) => (
            vec![message_item(msg_id, "completed", Some(""), json!([]))],
            json!({"role": "assistant", "content": ""}),
        ),
        _ => {
            let text = tools::uncalled_text(run.tools.as_ref(), &c.text);
            (
                vec![message_item(msg_id, "completed", Some(&text), lp())],
                json!({"role": "assistant", "content": text}),
            )
        }
    }
}

/// One SSE event of the Responses API.
fn event(kind: &str, seq: &mut u64, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(*seq);
    *seq += 1;
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// The events that announce, fill and close one finished output item, at
/// `index`: a message's text part, or a function call's arguments (each
/// sent whole, as one delta).
fn item_events(item: &Value, index: usize) -> Vec<(&'static str, Value)> {
    let id = item["id"].clone();
    let mut open = item.clone();
    open["status"] = json!("in_progress");
    let mut ev = Vec::new();
    if item["type"] == "reasoning" {
        open["content"] = json!([]);
        ev.push((
            "response.output_item.added",
            json!({"output_index": index, "item": open}),
        ));
    } else if item["type"] == "function_call" {
        open["arguments"] = json!("");
        let args = item["arguments"].clone();
        ev.push((
            "response.output_item.added",
            json!({"output_index": index, "item": open}),
        ));
        ev.push((
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": args}),
        ));
        ev.push((
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "arguments": args}),
        ));
    } else {
        open["content"] = json!([]);
        let part = item["content"][0].clone();
        let text = part["text"].clone();
        ev.push((
            "response.output_item.added",
            json!({"output_index": index, "item": open}),
        ));
        ev.push((
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
        ));
        let logprobs = part.get("logprobs").cloned().unwrap_or_else(|| json!([]));
        ev.push((
            "response.output_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "delta": text, "logprobs": logprobs}),
        ));
        ev.extend(text_closing(&id, index, &text, &part));
    }
    ev.push((
        "response.output_item.done",
        json!({"output_index": index, "item": item}),
    ));
    ev
}

/// The events that close a message's text part.
fn text_closing(
    id: &Value,
    index: usize,
    text: &Value,
    part: &Value,
) -> [(&'static str, Value); 2] {
    [
        (
            "response.output_text.done",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                "text": text, "logprobs": part.get("logprobs").cloned().unwrap_or_else(|| json!([]))}),
        ),
        (
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        ),
    ]
}

/// Streams the response's events: a task reads the engine outputs (through
/// the tenant's `on-chunk` plugins) and sends the frames; a client that
/// goes away drops the receiver, the task ends and the run's guard aborts
/// the engine request. Plain text is streamed as it is generated; with
/// function tools the output is only known to be calls or text once it is
/// complete, so its items are sent at the end.
fn stream_events(
    mut run: Run,
    echo: Echo,
    remember: impl FnOnce(Value, &Value) + Send + 'static,
) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    // Text streams as it comes unless it may turn out to be tool calls or
    // hold reasoning, whose items go out at the end.
    let live_text = run.tools.is_none() && run.reasoning.is_none();
    tokio::spawn(async move {
        let mut seq = 0u64;
        let msg_id = format!("msg_{:032x}", rand::random::<u128>());
        let mut opening = vec![
            (
                "response.created",
                json!({"response": echo.object("in_progress", vec![], Value::Null, Value::Null)}),
            ),
            (
                "response.in_progress",
                json!({"response": echo.object("in_progress", vec![], Value::Null, Value::Null)}),
            ),
        ];
        if live_text {
            opening.push((
                "response.output_item.added",
                json!({"output_index": 0, "item": message_item(&msg_id, "in_progress", None, json!([]))}),
            ));
            opening.push((
                "response.content_part.added",
                json!({"item_id": msg_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
            ));
        }
        for (kind, data) in opening {
            if tx.send(event(kind, &mut seq, data)).await.is_err() {
                return;
            }
        }
        while run.remaining > 0 {
            let Some(mut o) = run.rx.recv().await else {
                let err = ApiError::unavailable("the engine stopped before the response finished");
                let _ = tx
                    .send(event(
                        "error",
                        &mut seq,
                        json!({"code": err.code, "message": err.message, "param": null}),
                    ))
                    .await;
                return;
            };
            if let Err(e) = run.on_chunk(&mut o).await {
                let data = json!({"code": e.code, "message": e.message, "param": null});
                let _ = tx.send(event("error", &mut seq, data)).await;
                return;
            }
            if run.absorb(&mut o).is_none() {
                continue;
            }
            if live_text && !o.new_text.is_empty() {
                // With `include`, each delta carries its tokens' logprobs.
                let delta = json!({"item_id": msg_id, "output_index": 0, "content_index": 0,
                    "delta": o.new_text, "logprobs": text_logprobs(&run, &o.logprobs, &echo)});
                if tx
                    .send(event("response.output_text.delta", &mut seq, delta))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        run.guard.disarm();
        if let Err(e) = run.meter().await {
            let data = json!({"code": e.code, "message": e.message, "param": null});
            let _ = tx.send(event("error", &mut seq, data)).await;
            return;
        }
        let (status, incomplete) = status_of(run.choices[0].finish_reason);
        let (items, assistant) = final_output(&run, &msg_id, &echo);
        let mut closing: Vec<(&'static str, Value)> = Vec::new();
        if live_text {
            let item = &items[0];
            let part = item["content"][0].clone();
            closing.extend(text_closing(&json!(msg_id), 0, &part["text"], &part));
            closing.push((
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ));
        } else {
            for (i, item) in items.iter().enumerate() {
                closing.extend(item_events(item, i));
            }
        }
        // `response.completed` whatever the status (an `incomplete` one
        // cut by max_output_tokens included), as vLLM ends its streams:
        // the openai SDK's `responses.stream().get_final_response()`
        // returns only after that event, and raises without it.
        let response = echo.object(status, items, usage_of(&run), incomplete);
        remember(assistant, &response);
        closing.push(("response.completed", json!({"response": response})));
        for (kind, data) in closing {
            if tx.send(event(kind, &mut seq, data)).await.is_err() {
                return;
            }
        }
    });
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(Frame::data(b)), rx))
    });
    sse_response(frames)
}
