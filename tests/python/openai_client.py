#!/usr/bin/env python3
"""The official `openai` package, unmodified, against a running Pagoda.

usage: openai_client.py BASE_URL MODEL
Covers model listing, chat and completions, streamed and not, echo with
prompt logprobs, the Responses API, and parses /metrics with prometheus_client's text parser. Exits non-zero on failure;
the last line is a summary ('N passed, 0 failed').
"""
import json
import time
import sys
import urllib.request

import openai

from checks import check, summary
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused")


models = client.models.list()
check("models.list", [m.id for m in models.data] == [model], models)
got = client.models.retrieve(model)
check("models.retrieve", got.id == model and got.object == "model", got)
try:
    client.models.retrieve("no-such-model")
    check("models.retrieve of an unknown id is a 404", False)
except openai.NotFoundError as e:
    check("models.retrieve of an unknown id is a 404", e.body.get("code") == "model_not_found", e.body)

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is 2+2? Answer briefly."}], max_tokens=16, temperature=0
)
check("chat", chat.choices[0].message.role == "assistant" and chat.choices[0].message.content, chat)
check("chat usage", chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens, chat.usage)

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is 2+2? Answer briefly."}],
    max_tokens=16,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
parts, usage = [], None
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
check("chat stream text", "".join(parts) == chat.choices[0].message.content, parts)
check("chat stream usage", usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage)

# n samples: the prompt counts once, the completions add up (OpenAI's and
# vLLM's usage).
question = [{"role": "user", "content": "Name a colour."}]
one = client.chat.completions.create(model=model, messages=question, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
three = client.chat.completions.create(model=model, messages=question, max_tokens=6, temperature=0.8, seed=1, n=3,
                                       extra_body={"ignore_eos": True})
check("n=3 chat prompt_tokens counted once", three.usage.prompt_tokens == one.usage.prompt_tokens,
      (one.usage, three.usage))
check("n=3 chat completion_tokens summed", len(three.choices) == 3 and one.usage.completion_tokens == 6
      and three.usage.completion_tokens == 18, three.usage)
streamed_usage = None
for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=6, temperature=0.8, seed=1,
                                            n=3, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}):
    if chunk.usage:
        streamed_usage = chunk.usage
check("n=3 streamed chat usage", streamed_usage is not None and streamed_usage.prompt_tokens == one.usage.prompt_tokens
      and streamed_usage.completion_tokens == three.usage.completion_tokens, streamed_usage)
c1 = client.completions.create(model=model, prompt="Colours:", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
c3 = client.completions.create(model=model, prompt="Colours:", max_tokens=5, temperature=0.8, seed=2, n=3,
                               extra_body={"ignore_eos": True})
check("n=3 completions usage", c3.usage.prompt_tokens == c1.usage.prompt_tokens
      and c3.usage.completion_tokens == 15 and c1.usage.completion_tokens == 5, (c1.usage, c3.usage))

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
check("completions", comp.choices[0].text.startswith(" Paris"), comp)
text = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    if c.choices
)
check("completions stream", text == comp.choices[0].text, text)

# Scoring a prompt, as evaluation harnesses do: echo with logprobs and no
# generated tokens.
scored = client.completions.create(
    model=model, prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=1
)
lp = scored.choices[0].logprobs
check("echo text", scored.choices[0].text == "The capital of France is Paris", scored)
check("echo first token unscored", lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp)
check(
    "echo prompt logprobs",
    len(lp.token_logprobs) == scored.usage.prompt_tokens and all(x < 0 for x in lp.token_logprobs[1:]),
    lp,
)
check("echo finish", scored.choices[0].finish_reason == "length" and scored.usage.completion_tokens == 0, scored)
check("echo tokens", "".join(lp.tokens) == scored.choices[0].text, lp.tokens)

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    check("404 raises", False, "no exception")
except Exception as e:  # openai.NotFoundError
    check("404 raises NotFoundError", type(e).__name__ == "NotFoundError" and getattr(e, "code", None) == "model_not_found", repr(e))

metrics = urllib.request.urlopen(base + "/metrics").read().decode()
families = {f.name: f for f in text_string_to_metric_families(metrics)}
for name in [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_success",
]:
    check(f"metric {name}", name in families, sorted(families))
check("ttft is a histogram", families["vllm:time_to_first_token_seconds"].type == "histogram")
# The model-server protocol of the Kubernetes inference gateway (its
# endpoint picker reads these under vLLM's names and meanings).
for name in ["vllm:num_requests_running", "vllm:num_requests_waiting"]:
    samples = families[name].samples
    check(f"{name} is a gauge of whole requests", families[name].type == "gauge" and samples
          and all(x.value >= 0 and x.value == int(x.value) for x in samples), samples)
usage = families["vllm:kv_cache_usage_perc"].samples
check("kv_cache_usage_perc is a fraction from 0 to 1", usage and all(0 <= x.value <= 1 for x in usage), usage)
info = families.get("vllm:cache_config_info")
check("cache_config_info carries block_size and num_gpu_blocks", info is not None and any(
    int(x.labels.get("block_size", "0")) > 0 and int(x.labels.get("num_gpu_blocks", "0")) > 0 and x.value == 1
    for x in info.samples), info and info.samples)

# The Responses API, as newer clients and agent frameworks call it.


resp = client.responses.create(model=model, instructions="Answer briefly.", input="What is 2+2?",
                               max_output_tokens=16, temperature=0)
check("responses.create", resp.status == "completed" and resp.output_text, resp)
check("responses usage", resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens, resp.usage)
same = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
    {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}])
check("responses answer as chat does", resp.output_text == same.choices[0].message.content, (resp.output_text, same))

events, text, final = [], [], None
for ev in client.responses.create(model=model, instructions="Answer briefly.", input="What is 2+2?",
                                  max_output_tokens=16, temperature=0, stream=True):
    events.append(ev.type)
    if ev.type == "response.output_text.delta":
        text.append(ev.delta)
    if ev.type == "response.completed":
        final = ev.response
check("responses stream events", events[:4] == ["response.created", "response.in_progress",
      "response.output_item.added", "response.content_part.added"] and events[-1] == "response.completed", events)
check("responses stream text", "".join(text) == resp.output_text and final.output_text == resp.output_text, text)

got = client.responses.retrieve(resp.id)
check("responses.retrieve", got.id == resp.id and got.output_text == resp.output_text, got)
unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
try:
    client.responses.retrieve(unstored.id)
    check("store=false responses are not kept", False)
except openai.NotFoundError:
    check("store=false responses are not kept", True)
follow = client.responses.create(model=model, previous_response_id=resp.id, input="And 3+3?",
                                 max_output_tokens=8, temperature=0)
check("previous_response_id continues", follow.previous_response_id == resp.id
      and follow.usage.input_tokens > resp.usage.input_tokens + resp.usage.output_tokens, follow.usage)
client.responses.delete(follow.id)
try:
    client.responses.retrieve(follow.id)
    check("responses.delete forgets the response", False)
except openai.NotFoundError as e:
    check("responses.delete forgets the response", e.body.get("param") == "response_id", e.body)
short = client.responses.create(model=model, input="Tell me a long story.", max_output_tokens=3)
check("max_output_tokens gives incomplete", short.status == "incomplete"
      and short.incomplete_details.reason == "max_output_tokens", short)
fmt = client.responses.create(model=model, input="A person as JSON", max_output_tokens=60, temperature=0,
                              text={"format": {"type": "json_schema", "name": "p", "strict": True, "schema": {
                                  "type": "object", "additionalProperties": False, "required": ["name", "age"],
                                  "properties": {"name": {"type": "string", "maxLength": 20},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 99}}}}})
check("responses text.format json_schema", set(json.loads(fmt.output_text)) == {"name", "age"}, fmt.output_text)
# A stream cut by max_output_tokens ends so that the SDK's final response
# comes back (it needs `response.completed`), with the status incomplete.
with client.responses.stream(model=model, input="Tell me a long story.", max_output_tokens=3) as stream:
    cut = stream.get_final_response()
check("responses.stream cut by max_output_tokens returns its final response",
      cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut)
# instructor's RESPONSES_TOOLS mode: a named tool choice beside a text.format
# of the same schema.
person = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
forced = client.responses.create(
    model=model, input="Extract: Ann is 31.", max_output_tokens=60, temperature=0,
    tools=[{"type": "function", "name": "Person", "parameters": person, "strict": True}],
    tool_choice={"type": "function", "name": "Person"},
    text={"format": {"type": "json_schema", "name": "Person", "schema": person, "strict": True}})
calls = [o for o in forced.output if o.type == "function_call"]
check("responses named tool with text.format (instructor RESPONSES_TOOLS)",
      len(calls) == 1 and calls[0].name == "Person" and set(json.loads(calls[0].arguments)) == {"name", "age"},
      forced)
# Logprobs when include asks for them, streamed and not.
lp = client.responses.create(model=model, input="Say hi.", max_output_tokens=4, temperature=0,
                             include=["message.output_text.logprobs"], top_logprobs=2)
parts = [c for o in lp.output if o.type == "message" for c in o.content]
check("responses include logprobs", len(parts) == 1 and len(parts[0].logprobs) == lp.usage.output_tokens
      and all(len(t.top_logprobs) == 2 for t in parts[0].logprobs), lp)
streamed_lp = []
for ev in client.responses.create(model=model, input="Say hi.", max_output_tokens=4, temperature=0,
                                  include=["message.output_text.logprobs"], top_logprobs=2, stream=True):
    if ev.type == "response.output_text.delta":
        streamed_lp.extend(ev.logprobs or [])
check("responses stream logprobs", [t.token for t in streamed_lp] == [t.token for t in parts[0].logprobs],
      streamed_lp)
# Background, polled, and listed input items.
bg = client.responses.create(model=model, input=[{"role": "user", "content": "What is 2+2?"}],
                             max_output_tokens=5, background=True)
check("responses background starts queued", bg.status in ("queued", "in_progress") and bg.background, bg)
for _ in range(200):
    bg = client.responses.retrieve(bg.id)
    if bg.status not in ("queued", "in_progress"):
        break
    time.sleep(0.05)
check("responses background completes", bg.status in ("completed", "incomplete") and bg.output_text, bg)
items = client.responses.input_items.list(bg.id)
check("responses input_items", len(items.data) == 1 and items.data[0].role == "user", items)
for kw, param in [({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                  ({"previous_response_id": "resp_nope"}, "previous_response_id")]:
    try:
        client.responses.create(model=model, input="x", **kw)
        check(f"responses refuses {param}", False)
    except openai.BadRequestError as e:
        check(f"responses refuses {param} with a 400", e.body.get("param") == param, e.body)
summary()
