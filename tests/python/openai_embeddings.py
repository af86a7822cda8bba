#!/usr/bin/env python3
"""The official `openai` package's `embeddings.create` and LangChain's
`OpenAIEmbeddings`, unmodified, against a Pagoda serving an embedding model,
compared with sentence-transformers' vectors in the fixture's reference.json.

usage: openai_embeddings.py BASE_URL MODEL REFERENCE_JSON
The SDK asks for base64 unless told otherwise and decodes it itself; both
that and encoding_format="float" must give sentence-transformers' vectors
(cosine >= 0.99999). The last line is 'N passed, 0 failed'.
"""
import json
import math
import sys

from checks import check, summary
from openai import OpenAI, BadRequestError

base, model, ref_path = sys.argv[1], sys.argv[2], sys.argv[3]
ref = json.load(open(ref_path))
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
texts = [i["text"] for i in ref["inputs"]]
want = [i["embedding"] for i in ref["inputs"]]


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


for fmt in (None, "float", "base64"):
    kw = {} if fmt is None else {"encoding_format": fmt}
    r = client.embeddings.create(model=model, input=texts, **kw)
    check(f"embeddings.create ({fmt or 'SDK default'}): one vector per input, in order",
          [d.index for d in r.data] == list(range(len(texts))), r)
    if fmt == "base64":
        # Asked for explicitly, the SDK hands the string through.
        import base64
        import struct
        vecs = []
        for d in r.data:
            raw = base64.b64decode(d.embedding)
            vecs.append(list(struct.unpack(f"<{len(raw) // 4}f", raw)))
    else:
        vecs = [d.embedding for d in r.data]
    worst = min(cosine(v, w) for v, w in zip(vecs, want))
    check(f"embeddings.create ({fmt or 'SDK default'}) matches sentence-transformers (cosine {worst:.7f})",
          worst >= 0.99999, worst)
    check(f"usage ({fmt or 'SDK default'})",
          r.usage.prompt_tokens == sum(len(i["token_ids"]) for i in ref["inputs"])
          and r.usage.total_tokens == r.usage.prompt_tokens, r.usage)

r = client.embeddings.create(model=model, input=texts[0], dimensions=16)
check("dimensions=16", len(r.data[0].embedding) == 16
      and cosine(r.data[0].embedding, ref["dimensions"]["16"][0]) >= 0.99999, r.data[0])
# LangChain's OpenAIEmbeddings. check_embedding_ctx_length=False is how
# LangChain is pointed at any server other than OpenAI's: otherwise it
# sends tiktoken's cl100k ids, which are OpenAI's vocabulary, not the model's.
from langchain_openai import OpenAIEmbeddings  # noqa: E402

lc = OpenAIEmbeddings(model=model, base_url=base + "/v1", api_key="unused",
                      check_embedding_ctx_length=False, max_retries=0)
docs = lc.embed_documents(texts)
worst = min(cosine(v, w) for v, w in zip(docs, want))
check(f"langchain embed_documents matches sentence-transformers (cosine {worst:.7f})",
      len(docs) == len(texts) and worst >= 0.99999, worst)
q = lc.embed_query(texts[2])
check("langchain embed_query", cosine(q, want[2]) >= 0.99999, q[:4])

try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    check("chat on an embedding model is refused", False)
except BadRequestError as e:
    check("chat on an embedding model is a 400 naming /v1/embeddings", "/v1/embeddings" in str(e), e)
summary()
