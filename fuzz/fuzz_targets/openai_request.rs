//! An OpenAI request body, as `/v1/completions`, `/v1/chat/completions`
//! and `/v1/responses` read it into their typed requests: the sampling
//! fields, prompts, messages, structured-output and tool fields; then the tool-call parsers over the
//! body's text, as they read a model's output. Any input may be refused;
//! none may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagoda::server::openai::chat_completion::protocol::{parse_messages, ChatCompletionRequest};
use pagoda::server::openai::completion::protocol::{parse_prompts, CompletionRequest};
use pagoda::server::openai::fields::Fields;
use pagoda::server::openai::responses::protocol::ResponsesRequest;
use pagoda::server::openai::structured;
use pagoda::server::openai::tool_parsers::ToolCallParser;
use pagoda::server::openai::wire::from_body;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(f) = Fields::of(&v) {
        let _ = structured::parse(&f);
    }
    if let Ok(c) = CompletionRequest::from_body(&v) {
        let _ = c.common(&v, Some("m"));
        let _ = c.common(&v, None);
        let _ = parse_prompts(c.completion.prompt.as_ref());
    }
    if let Ok(c) = ChatCompletionRequest::from_body(&v) {
        let _ = c.common(&v, Some("m"));
        let _ = c.common(&v, None);
        let _ = parse_messages(c.chat.messages.as_ref());
        for parser in [
            None,
            Some(ToolCallParser::Hermes),
            Some(ToolCallParser::Llama3Json),
            Some(ToolCallParser::Mistral),
            Some(ToolCallParser::Pythonic),
        ] {
            let _ = c.chat.tools(parser);
        }
    }
    let _ = from_body::<ResponsesRequest>(&v);
    let text = String::from_utf8_lossy(data);
    for parser in [
        ToolCallParser::Hermes,
        ToolCallParser::Llama3Json,
        ToolCallParser::Mistral,
        ToolCallParser::Pythonic,
    ] {
        let _ = parser.parse(&text);
    }
});
