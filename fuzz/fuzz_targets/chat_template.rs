//! Chat messages (any JSON: roles, content as text or parts, tool calls)
//! rendered by real chat templates, and the rendering tokenized as chat
//! requests tokenize it; the first input byte picks the template. A
//! template may refuse messages; nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagoda::tokenizer::chat_template::ChatTemplate;
use std::sync::OnceLock;

/// ChatML as SmolLM2 and Qwen2.5 ship it, and a Llama 3 style template
/// with tools and `raise_exception`.
const TEMPLATES: [&str; 2] = [
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{{- bos_token }}{%- if tools is defined and tools %}{{- '<|start_header_id|>system<|end_header_id|>\n\nTools: ' + tools | tojson + '<|eot_id|>' }}{%- endif %}{%- for message in messages %}{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + message['role']) }}{%- endif %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}{%- if message['content'] is string %}{{- message['content'] | trim }}{%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}{%- endif %}{%- if message.tool_calls %}{%- for call in message.tool_calls %}{{- call.function.name + call.function.arguments | tojson }}{%- endfor %}{%- endif %}{{- '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}",
];

fn templates() -> &'static Vec<ChatTemplate> {
    static T: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| {
        TEMPLATES
            .iter()
            .map(|s| ChatTemplate::new(s, Some("<s>"), Some("</s>")).expect("template"))
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) else {
        return;
    };
    let (messages, extra) = match v {
        serde_json::Value::Object(mut o) => {
            let m = o.remove("messages").unwrap_or(serde_json::Value::Null);
            (m, o)
        }
        other => (other, serde_json::Map::new()),
    };
    let t = &templates()[which as usize % TEMPLATES.len()];
    let _ = t.render_json(&messages, which & 0x80 != 0, &extra);
});
