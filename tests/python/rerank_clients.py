#!/usr/bin/env python3
"""The `cohere` SDK's `ClientV2.rerank` (Cohere's /v2/rerank) and LiteLLM's
`rerank` and `embedding`, unmodified, against Pagoda, compared with
CrossEncoder's scores and sentence-transformers' vectors in the fixtures'
reference.json files.

usage: rerank_clients.py rerank BASE_URL MODEL REFERENCE_JSON
       rerank_clients.py embed BASE_URL MODEL REFERENCE_JSON
The last line is 'N passed, 0 failed'.
"""
import json
import math
import os
import sys

# LiteLLM fetches a price list from GitHub at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from checks import check, summary

mode, base, model, ref_path = sys.argv[1:5]
ref = json.load(open(ref_path))


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


if mode == "rerank":
    import cohere
    import litellm

    query, docs, want = ref["query"], ref["documents"], ref["scores"]
    order = sorted(range(len(docs)), key=lambda i: -want[i])

    co = cohere.ClientV2(api_key="unused", base_url=base, max_retries=0)
    r = co.rerank(model=model, query=query, documents=docs, top_n=len(docs))
    got = {x.index: x.relevance_score for x in r.results}
    check("cohere ClientV2.rerank: the documents by relevance",
          [x.index for x in r.results] == order, r)
    worst = max(abs(got[i] - want[i]) for i in range(len(docs)))
    check(f"cohere ClientV2.rerank: CrossEncoder's scores (|d| {worst:.2e})", worst < 1e-4, r)
    r = co.rerank(model=model, query=query, documents=docs, top_n=1)
    check("cohere ClientV2.rerank top_n=1", [x.index for x in r.results] == order[:1], r)

    r = litellm.rerank(model=f"cohere/{model}", api_base=base, api_key="unused",
                       query=query, documents=docs, top_n=len(docs))
    results = r.results
    idx = [x["index"] for x in results]
    check("litellm.rerank (cohere provider): the documents by relevance", idx == order, r)
    worst = max(abs(x["relevance_score"] - want[x["index"]]) for x in results)
    check(f"litellm.rerank: CrossEncoder's scores (|d| {worst:.2e})", worst < 1e-4, r)
elif mode == "embed":
    import litellm

    texts = [i["text"] for i in ref["inputs"]]
    want = [i["embedding"] for i in ref["inputs"]]
    r = litellm.embedding(model=f"openai/{model}", api_base=base + "/v1", api_key="unused",
                          input=texts)
    vecs = [d["embedding"] for d in r.data]
    check("litellm.embedding: one vector per input", len(vecs) == len(texts), r)
    worst = min(cosine(v, w) for v, w in zip(vecs, want))
    check(f"litellm.embedding matches sentence-transformers (cosine {worst:.7f})",
          worst >= 0.99999, worst)
    check("litellm.embedding usage",
          r.usage.prompt_tokens == sum(len(i["token_ids"]) for i in ref["inputs"]), r.usage)
else:
    sys.exit(f"unknown mode {mode}")
summary()
