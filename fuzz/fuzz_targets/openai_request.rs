//! An OpenAI request body, as `/v1/completions`, `/v1/chat/completions`
//! and `/v1/responses` parse it: the common fields, prompts, messages,
//! structured-output and tool fields; then the tool-call parsers over the
//! body's text, as they read a model's output. Any input may be refused;
//! none may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagoda::server::openai::fields::Fields;
use pagoda::server::openai::protocol::{parse_common, parse_messages, parse_prompts};
use pagoda::server::openai::tool_parsers::ToolCallParser;
use pagoda::server::openai::{structured, tools};

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(f) = Fields::of(&v) else {
        return;
    };
    let _ = parse_common(&f, false, Some("m"));
    let _ = parse_common(&f, true, None);
    let _ = parse_prompts(&f);
    let _ = parse_messages(&f);
    let _ = structured::parse(&f);
    for parser in [
        None,
        Some(ToolCallParser::Hermes),
        Some(ToolCallParser::Llama3Json),
        Some(ToolCallParser::Mistral),
        Some(ToolCallParser::Pythonic),
    ] {
        let _ = tools::parse(&f, parser);
    }
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
