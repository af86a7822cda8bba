#!/usr/bin/env python3
"""The official `openai` package, unmodified, selecting a LoRA adapter by
its name as the model, as vLLM's users do.

usage: openai_lora.py BASE_URL BASE_MODEL ADAPTER
Exits non-zero on failure; the last line is a summary ('N passed, 0 failed').
"""
import sys

from checks import check, summary
from openai import OpenAI

base, model, adapter = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base + "/v1", api_key="unused")

ids = {m.id: m for m in client.models.list().data}
check("models.list names the base and the adapter", set(ids) == {model, adapter}, list(ids))
card = client.models.retrieve(adapter)
check("the adapter's card has the base as parent", getattr(card, "parent", None) == model, card)

prompt = [468, 460, 459, 489, 418, 265, 458, 323, 14, 480]
outs = {}
for name in (model, adapter):
    r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    check(f"completions.create(model={name!r})", r.model == name and r.usage.completion_tokens == 8, r)
    outs[name] = r.choices[0].logprobs.token_logprobs
check("the adapter changes the model's numbers", outs[model] != outs[adapter], outs)

chunks = list(client.completions.create(model=adapter, prompt=prompt, max_tokens=6, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True}))
check("a streamed completion on the adapter", len(chunks) >= 2 and chunks[-1].choices[0].finish_reason == "length",
      chunks[-1:])

chat = client.chat.completions.create(model=adapter, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=5, temperature=0)
check("chat.completions.create on the adapter", chat.model == adapter and chat.choices[0].message is not None, chat)

summary()
