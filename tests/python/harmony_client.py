#!/usr/bin/env python3
"""gpt-oss's harmony format through the official `openai` client, against
a running Pagoda started with `--enable-auto-tool-choice --tool-call-parser
openai` (which implies `--reasoning-parser openai_gptoss`).

usage: harmony_client.py BASE_URL MODEL
The demo model writes no harmony of its own, so a regex (vLLM's
`structured_outputs`) makes it write a chosen harmony output; the parsers
do the rest: the `analysis` channel must come back as `reasoning_content`,
the `final` channel as `content`, a `commentary` message addressed
`to=functions.get_weather` as a tool call, streamed and not, with no
harmony marker in any content. The last line is a summary ('N passed, 0 failed').
"""
import json
import re
import sys

from checks import check, summary
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"]}}}]


def harmony(*messages):
    """A regex matching exactly the harmony output made of `messages`:
    (header, body, end marker) triples; the first without `<|start|>`."""
    out = []
    for i, (header, body, end) in enumerate(messages):
        start = "" if i == 0 else "<|start|>assistant"
        out.append(f"{start}<|channel|>{header}<|message|>{body}{end}")
    return re.escape("".join(out))


ANSWER = harmony(("analysis", "The user asks about the weather.", "<|end|>"),
                 ("final", "It is sunny in Paris.", "<|return|>"))
CALL = harmony(("analysis", "I need the weather tool.", "<|end|>"),
               ("commentary to=functions.get_weather <|constrain|>json", '{"location": "Paris"}', "<|call|>"))


def chat(stream, forced, **kw):
    """(reasoning, content, finish, calls) of one chat completion."""
    args = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                max_tokens=120, temperature=0, extra_body={"structured_outputs": {"regex": forced}}, **kw)
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments), t.id) for t in c.message.tool_calls or []]
        return getattr(c.message, "reasoning_content", None), c.message.content, c.finish_reason, calls
    reasoning, content, finish, calls = [], [], None, {}
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        r = getattr(c.delta, "reasoning_content", None)
        if r:
            reasoning.append(r)
        if c.delta.content:
            check(f"stream: no harmony marker in a content delta", "<|" not in c.delta.content, c.delta.content)
            content.append(c.delta.content)
        for t in c.delta.tool_calls or []:
            slot = calls.setdefault(t.index, ["", "", None])
            if t.function and t.function.name:
                slot[0] += t.function.name
            if t.function and t.function.arguments:
                slot[1] += t.function.arguments
            if t.id:
                slot[2] = t.id
        if c.finish_reason:
            finish = c.finish_reason
    calls = [(n, json.loads(a), i) for n, a, i in (calls[k] for k in sorted(calls))]
    return "".join(reasoning) or None, "".join(content) or None, finish, calls


for stream in (False, True):
    reasoning, content, finish, calls = chat(stream, ANSWER)
    check(f"stream={stream}: analysis is reasoning_content", reasoning == "The user asks about the weather.", reasoning)
    check(f"stream={stream}: final is content", content == "It is sunny in Paris.", content)
    check(f"stream={stream}: no tool call, finish stop", calls == [] and finish == "stop", (calls, finish))

    # With tools offered and tool_choice auto, the commentary message
    # addressed to a function is a tool call.
    reasoning, content, finish, calls = chat(stream, CALL, tools=TOOLS, tool_choice="auto")
    check(f"stream={stream}: reasoning before the call", reasoning == "I need the weather tool.", reasoning)
    check(f"stream={stream}: the call parsed",
          [(n, a) for n, a, _ in calls] == [("get_weather", {"location": "Paris"})], calls)
    check(f"stream={stream}: the call has an id", all(i for _, _, i in calls), calls)
    check(f"stream={stream}: no content beside the call", not content, content)
    check(f"stream={stream}: finish tool_calls", finish == "tool_calls", finish)

    # The same tools, but an answer: content, no call.
    reasoning, content, finish, calls = chat(stream, ANSWER, tools=TOOLS)
    check(f"stream={stream}: tools offered, an answer is content",
          content == "It is sunny in Paris." and calls == [] and finish == "stop", (content, calls, finish))

# reasoning_effort is accepted and reaches the template (the Rust side
# checks the rendered prompt).
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2, reasoning_effort="low")
check("reasoning_effort accepted", r.choices[0].finish_reason in ("length", "stop"), r)

summary()
