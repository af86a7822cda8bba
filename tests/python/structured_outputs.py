#!/usr/bin/env python3
"""Structured output and tool calling through the official `openai` client
and LangChain, against a running Pagoda started with
`--enable-auto-tool-choice --tool-call-parser hermes`.

usage: structured_outputs.py BASE_URL MODEL
Every non-truncated JSON answer must parse and validate against its schema
(with the `jsonschema` package); regex and choice outputs must match;
tool calls must carry arguments valid for the tool's parameters. Exits
non-zero on failure; the last line is a summary ('N passed, 0 failed').
"""
import json
import re
import sys

import jsonschema
import openai
from checks import check, summary
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused")
truncated = 0


def chat(messages, stream=False, **kw):
    """(text, finish_reason, tool_calls) of one chat completion, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, **kw)
        c = r.choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in (c.message.tool_calls or [])]
        return c.message.content, c.finish_reason, calls
    text, finish, calls = [], None, {}
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta.content:
            text.append(c.delta.content)
        for t in c.delta.tool_calls or []:
            slot = calls.setdefault(t.index, [None, "", ""])
            if t.id:
                slot[0] = t.id
            if t.function and t.function.name:
                slot[1] += t.function.name
            if t.function and t.function.arguments:
                slot[2] += t.function.arguments
        if c.finish_reason:
            finish = c.finish_reason
    return "".join(text) or None, finish, [tuple(calls[k]) for k in sorted(calls)]


def user(text):
    return [{"role": "user", "content": text}]


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": 5, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["score", "count", "ok"],
        "additionalProperties": False,
    },
    "list_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"}},
            "required": ["title", "year"],
            "additionalProperties": False,
        },
        "minItems": 2,
        "maxItems": 2,
    },
}

complete = 0
for name, schema in SCHEMAS.items():
    for stream in (False, True):
        for temperature in (0, 0.8):
            text, finish, _ = chat(
                user(f"Answer in JSON: describe a {name.replace('_', ' ')}."),
                stream=stream,
                max_tokens=160,
                temperature=temperature,
                seed=11,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
            )
            tag = f"json_schema {name} stream={stream} t={temperature}"
            if finish == "length":
                truncated += 1
                print(f"(truncated {tag})")
                continue
            check(f"{tag} finishes with stop", finish == "stop", finish)
            try:
                jsonschema.validate(json.loads(text), schema)
                valid = True
            except Exception as e:  # noqa: BLE001 - report whatever failed
                valid = e
            check(f"{tag} validates", valid is True, f"{valid!r}: {text!r}")
            complete += 1
check("most schema answers complete within max_tokens", complete >= 12, f"{complete} complete, {truncated} truncated")

# disable_any_whitespace: compact JSON.
text, finish, _ = chat(
    user("A person in JSON"),
    max_tokens=60,
    temperature=0,
    extra_body={"structured_outputs": {"json": SCHEMAS["person"], "disable_any_whitespace": True}},
)
check("disable_any_whitespace gives compact JSON", finish == "stop" and not re.search(r"\s", text.replace(json.loads(text)["name"], "")), text)

# json_object, streamed and not.
for stream in (False, True):
    text, finish, _ = chat(user("Give me a JSON object about a cat with its name and age."), stream=stream,
                           max_tokens=200, temperature=0, response_format={"type": "json_object"})
    check(f"json_object stream={stream} completes", finish == "stop", (finish, text))
    check(f"json_object stream={stream} is an object", isinstance(json.loads(text), dict), text)
# Too few tokens for the schema: "length", never invalid JSON called complete.
text, finish, _ = chat(user("A person as JSON"), max_tokens=4, temperature=0,
                       response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}})
check("a truncated schema answer finishes with length", finish == "length", (finish, text))

# Regex and choice on both endpoints.
rx = r"\d{3}-\d{3}-\d{4}"
# \d admits every Unicode decimal digit, as Python's re does, and a sampled
# answer may draw ones that take several tokens each (U+1FBF8, 4 bytes):
# the budget leaves room for ten of those.
text, finish, _ = chat(user("What is a phone number?"), max_tokens=64, extra_body={"structured_outputs": {"regex": rx}})
check("regex matches (chat)", finish == "stop" and re.fullmatch(rx, text), text)
comp = client.completions.create(model=model, prompt="The year was", max_tokens=10, extra_body={"guided_regex": r" (19|20)\d\d"})
check("regex matches (completions, guided_regex)", re.fullmatch(r" (19|20)\d\d", comp.choices[0].text), comp.choices[0].text)
for stream in (False, True):
    text, finish, _ = chat(user("Is the sky blue? Answer yes or no."), stream=stream, max_tokens=10, temperature=1.0, seed=3,
                           extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    check(f"choice stream={stream}", text in ("yes", "no", "maybe") and finish == "stop", (text, finish))
text, finish, _ = chat(user("Say hi"), max_tokens=20,
                       extra_body={"structured_outputs": {"grammar": 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{1,8}/'}})
check("lark grammar", finish == "stop" and re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,8}", text), text)

# Bad constraints are 400s that name the field.
for body, param in [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nope"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs.regex"),
]:
    try:
        chat(user("x"), max_tokens=5, **body)
        check(f"bad {param} is refused", False, "no error")
    except openai.BadRequestError as e:
        check(f"bad {param} is a 400 naming it", e.status_code == 400 and e.body.get("param") == param, e.body)

# Tools.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ask = user("What is the weather like in Paris?")

for stream in (False, True):
    text, finish, calls = chat(ask, stream=stream, max_tokens=100, temperature=0, tools=TOOLS,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check(f"named tool_choice stream={stream} calls it", len(calls) == 1 and calls[0][1] == "get_weather", calls)
    check(f"named tool_choice stream={stream} finish", finish == "tool_calls", finish)
    jsonschema.validate(json.loads(calls[0][2]), WEATHER)
    check(f"named tool_choice stream={stream} arguments validate", True)

    text, finish, calls = chat(ask, stream=stream, max_tokens=150, temperature=0, tools=TOOLS, tool_choice="required")
    check(f"required stream={stream} calls a tool", len(calls) >= 1 and finish == "tool_calls", (text, finish, calls))
    for _, name, args in calls:
        jsonschema.validate(json.loads(args), PARAMS[name])
    check(f"required stream={stream} arguments validate", all(c[0] for c in calls))

    # auto: the hermes parser reads a <tool_call> block out of the text (the
    # 135M demo model does not call tools on its own, so a regex makes it
    # write one, with text before it, and the parser does the rest).
    forced = r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}\n</tool_call>'
    text, finish, calls = chat(ask, stream=stream, max_tokens=60, temperature=0, tools=TOOLS, tool_choice="auto",
                               extra_body={"structured_outputs": {"regex": forced}})
    check(f"auto (hermes) stream={stream} parses the call", len(calls) == 1 and calls[0][1] == "get_weather", (text, calls))
    jsonschema.validate(json.loads(calls[0][2]), WEATHER)
    check(f"auto (hermes) stream={stream} keeps the text before the call", text == "I will check.", text)
    check(f"auto (hermes) stream={stream} finish", finish == "tool_calls", finish)

    # auto without a call: plain content.
    text, finish, calls = chat(ask, stream=stream, max_tokens=20, temperature=0, tools=TOOLS)
    check(f"auto stream={stream} without a call is content", calls == [] and text, (text, calls))

# A conversation with a tool result renders and continues.
history = ask + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
]
text, finish, calls = chat(history, max_tokens=30, temperature=0, tools=TOOLS, tool_choice="none")
check("tool results in the history render", text and calls == [], (text, calls))

try:
    chat(ask, max_tokens=5, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch_rockets"}})
    check("unknown tool refused", False)
except openai.BadRequestError as e:
    check("unknown tool in tool_choice is a 400", e.body.get("param") == "tool_choice" and "launch_rockets" in e.body.get("message", ""), e.body)

# Function tools on the Responses API, in its flat tool shape.
RTOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
           "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]


def responses_calls(resp):
    return [(o.call_id, o.name, o.arguments) for o in resp.output if o.type == "function_call"]


for stream in (False, True):
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kw = dict(model=model, input="What is the weather like in Paris?", tools=RTOOLS, tool_choice=choice,
                  max_output_tokens=150, temperature=0)
        if stream:
            kinds, final = [], None
            for ev in client.responses.create(stream=True, **kw):
                kinds.append(ev.type)
                if ev.type == "response.completed":
                    final = ev.response
            check(f"responses tools {choice} streamed events", "response.function_call_arguments.delta" in kinds
                  and "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed", kinds)
            resp = final
        else:
            resp = client.responses.create(**kw)
        calls = responses_calls(resp)
        check(f"responses tools {choice} stream={stream} calls a function", len(calls) >= 1 and all(c[0] for c in calls)
              and (choice == "required" or [c[1] for c in calls] == ["get_weather"]), resp.output)
        for _, name, args in calls:
            jsonschema.validate(json.loads(args), PARAMS[name])
        check(f"responses tools {choice} stream={stream} arguments validate", True)

# The second turn: the function's output continues the conversation, by
# previous_response_id and by sending the call back in the input.
first = client.responses.create(model=model, input="What is the weather like in Paris?", tools=RTOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100,
                                temperature=0)
(call_id, name, args), = responses_calls(first)
result = {"type": "function_call_output", "call_id": call_id, "output": '{"temperature": 21, "sky": "clear"}'}
after = client.responses.create(model=model, previous_response_id=first.id, input=[result], tools=RTOOLS,
                                tool_choice="none", max_output_tokens=20, temperature=0)
check("responses function_call_output continues by previous_response_id",
      after.output_text and responses_calls(after) == [] and after.usage.input_tokens > first.usage.input_tokens, after)
again = client.responses.create(model=model, input=[
    {"role": "user", "content": "What is the weather like in Paris?"},
    {"type": "function_call", "call_id": call_id, "name": name, "arguments": args},
    result], tools=RTOOLS, tool_choice="none", max_output_tokens=20, temperature=0)
check("responses function_call_output continues from the input items", again.output_text == after.output_text,
      (again.output_text, after.output_text))
try:
    client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    check("responses built-in tools refused", False)
except openai.BadRequestError as e:
    check("responses built-in tools are a 400", e.body.get("param") == "tools[0].type", e.body)

# The openai client's own parse helper (json_schema from a Pydantic model).
from pydantic import BaseModel, Field  # noqa: E402


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)


parsed = client.beta.chat.completions.parse(
    model=model, messages=user("Tell me about Paris."), response_format=City, max_tokens=80, temperature=0
)
check("client.beta.chat.completions.parse", isinstance(parsed.choices[0].message.parsed, City), parsed.choices[0].message)

# LangChain, as applications use it.
from langchain_openai import ChatOpenAI  # noqa: E402

llm = ChatOpenAI(model=model, base_url=base + "/v1", api_key="unused", temperature=0, max_tokens=80)
for method in ("json_schema", "function_calling"):
    city = llm.with_structured_output(City, method=method).invoke("Tell me about Paris.")
    check(f"langchain with_structured_output method={method}", isinstance(city, City), city)

summary(f" ({truncated} schema answers truncated by max_tokens)")
