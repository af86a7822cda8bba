#!/usr/bin/env python3
"""The official `anthropic` package, unmodified, against a running Pagoda's
Messages API.

usage: anthropic_sdk.py BASE_URL MODEL
Covers messages.create (plain; with tools, a tool_use block parsed and a
tool_result continued), messages.stream, count_tokens and the SDK's error
classes. Exits non-zero on failure; the last line is a summary
('N passed, 0 failed').
"""
import sys

import anthropic

from checks import check, summary

base, model = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)

# Newer releases of the SDK no longer take `temperature` as an argument;
# it still goes in the body, as Anthropic's API and this server read it.
GREEDY = {"temperature": 0}
question = [{"role": "user", "content": "What is 2+2? Answer briefly."}]

msg = client.messages.create(
    model=model, max_tokens=24, extra_body=GREEDY, system="You are a helpful assistant.", messages=question
)
check("create: a message", msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_"), msg)
check("create: one text block", len(msg.content) == 1 and msg.content[0].type == "text" and msg.content[0].text, msg)
check("create: stop_reason", msg.stop_reason in ("end_turn", "max_tokens"), msg.stop_reason)
check("create: usage", msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 24, msg.usage)

counted = client.messages.count_tokens(model=model, system="You are a helpful assistant.", messages=question)
check("count_tokens equals the message's input_tokens", counted.input_tokens == msg.usage.input_tokens, counted)

with client.messages.stream(
    model=model, max_tokens=24, extra_body=GREEDY, system="You are a helpful assistant.", messages=question
) as stream:
    pieces = [t for t in stream.text_stream]
    final = stream.get_final_message()
check("stream: the same text", "".join(pieces) == msg.content[0].text, pieces)
check("stream: final message", final.content[0].text == msg.content[0].text, final)
check("stream: stop_reason", final.stop_reason == msg.stop_reason, final.stop_reason)
check(
    "stream: usage",
    final.usage.input_tokens == msg.usage.input_tokens and final.usage.output_tokens == msg.usage.output_tokens,
    final.usage,
)

tools = [
    {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
called = client.messages.create(
    model=model,
    max_tokens=64,
    extra_body=GREEDY,
    tools=tools,
    tool_choice={"type": "tool", "name": "get_weather"},
    messages=ask,
)
uses = [b for b in called.content if b.type == "tool_use"]
check("tools: stop_reason tool_use", called.stop_reason == "tool_use", called)
check("tools: a tool_use block", len(uses) == 1 and uses[0].name == "get_weather", called.content)
check("tools: parsed input", isinstance(uses[0].input, dict) and isinstance(uses[0].input.get("city"), str), uses[0])

with client.messages.stream(
    model=model,
    max_tokens=64,
    extra_body=GREEDY,
    tools=tools,
    tool_choice={"type": "tool", "name": "get_weather"},
    messages=ask,
) as stream:
    streamed_call = stream.get_final_message()
s_uses = [b for b in streamed_call.content if b.type == "tool_use"]
check("tools: streamed tool_use", len(s_uses) == 1 and s_uses[0].input == uses[0].input, streamed_call)

follow = ask + [
    {"role": "assistant", "content": called.content},
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 22 degrees Celsius."}],
    },
]
answer = client.messages.create(model=model, max_tokens=32, extra_body=GREEDY, tools=tools, messages=follow)
check("tools: the tool_result is answered in text", answer.content and answer.content[0].type == "text", answer)
check("tools: answered, not called", answer.stop_reason in ("end_turn", "max_tokens"), answer.stop_reason)
follow_count = client.messages.count_tokens(model=model, tools=tools, messages=follow)
check("tools: count_tokens of the continuation", follow_count.input_tokens == answer.usage.input_tokens, follow_count)

try:
    client.messages.create(model="claude-no-such-model", max_tokens=4, messages=question)
    check("unknown model is NotFoundError", False)
except anthropic.NotFoundError as e:
    check("unknown model is NotFoundError", e.body["error"]["type"] == "not_found_error", e.body)

try:
    client.messages.create(
        model=model,
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}],
            }
        ],
    )
    check("an image is BadRequestError", False)
except anthropic.BadRequestError as e:
    check("an image is BadRequestError", e.body["error"]["type"] == "invalid_request_error", e.body)

summary()
