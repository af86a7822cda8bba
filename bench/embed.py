#!/usr/bin/env python3
"""Embedding throughput (issue 45), driven by bench/embed.sh. One JSON line
per run on stdout.

  embed.py st MODEL_DIR TEXTS --threads N [--batch 32] [--dtype f32|bf16] [--save F.npy]
      sentence-transformers on torch CPU: `model.encode(texts,
      batch_size=32)` with torch's intra-op threads set to N.
  embed.py http BASE_URL MODEL_NAME TEXTS [--batch 32] [--inflight C] [--save F.npy]
      an OpenAI-compatible server's /v1/embeddings (Pagoda, vLLM): the
      texts in requests of `--batch` inputs, C requests in flight at a time
      (1: sequential).
  embed.py check A.npy B.npy [--min-cos 0.9999] [--min-centered-cos 0.999]
      the cosine of each pair of rows; fails below --min-cos. Random
      weights make every text's embedding close to a common direction, so
      it also takes A's mean embedding off both and requires the cosine of
      the rest (--min-centered-cos); it prints the mean cosine between
      different texts, plain and centered, so that a pass is seen to
      discriminate.

Each run first embeds one batch untimed (warm-up: torch's first call, the
server's first step), then times all the texts: wall seconds, and CPU
seconds (sentence-transformers' process; the server's processes with
--pids), whose texts per CPU-second is the steadier figure on a shared
machine (it still counts threads that spin while they wait). Token counts are the
model's tokenizer's ([CLS] and [SEP] included), the same for every side.
"""

import argparse
import json
import os
import sys
import threading
import time
import urllib.request


def load_texts(a):
    with open(a.texts) as f:
        texts = json.load(f)
    return texts[:a.limit] if a.limit else texts


def token_count(model_dir, texts):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return sum(len(e.ids) for e in tok.encode_batch(texts))


def load1():
    return os.getloadavg()[0]


def tree(pids):
    """pids and all their descendants (vLLM computes in a child process)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), list(pids)
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += [c for c, pp in parent.items() if pp == p]
    return out


def cpu_secs(pids):
    """User + system CPU seconds of the processes (all their threads)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def report(kind, n, tokens, secs, cpu, extra):
    out = {"runner": kind, "texts": n, "tokens": tokens, "secs": round(secs, 3),
           "texts_per_s": round(n / secs, 2), "tokens_per_s": round(tokens / secs, 1),
           "cpu_secs": round(cpu, 2) if cpu else None,
           "texts_per_cpu_s": round(n / cpu, 2) if cpu else None,
           "load1": round(load1(), 2)}
    out.update(extra)
    print(json.dumps(out), flush=True)


def run_st(a):
    import numpy as np
    import torch
    torch.set_num_threads(a.threads)
    from sentence_transformers import SentenceTransformer
    kw = {"torch_dtype": torch.bfloat16} if a.dtype == "bf16" else {"torch_dtype": torch.float32}
    model = SentenceTransformer(a.model, device="cpu", model_kwargs=kw)
    texts = load_texts(a)
    tokens = token_count(a.model, texts)
    load0 = load1()
    with torch.inference_mode():
        model.encode(texts[:a.batch], batch_size=a.batch)
        t0, c0 = time.perf_counter(), time.process_time()
        emb = model.encode(texts, batch_size=a.batch, convert_to_numpy=False,
                           convert_to_tensor=True)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    emb = emb.float().numpy()
    if a.save:
        np.save(a.save, emb)
    report("sentence-transformers", len(texts), tokens, secs, cpu,
           {"threads": torch.get_num_threads(), "batch": a.batch, "dtype": a.dtype,
            "load1_before": round(load0, 2), "torch": torch.__version__})


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def run_http(a):
    import numpy as np
    texts = load_texts(a)
    tokens = token_count(a.tokenizer, texts) if a.tokenizer else None
    url = a.base.rstrip("/") + "/v1/embeddings"
    batches = [list(range(i, min(i + a.batch, len(texts)))) for i in range(0, len(texts), a.batch)]
    out = [None] * len(texts)
    usage = [0]
    lock = threading.Lock()
    errors = []

    def one(idx):
        r = post(url, {"model": a.name, "input": [texts[i] for i in idx]})
        items = sorted(r["data"], key=lambda d: d["index"])
        if len(items) != len(idx):
            raise RuntimeError(f"{len(items)} embeddings for {len(idx)} inputs")
        with lock:
            usage[0] += r.get("usage", {}).get("prompt_tokens", 0)
            for i, d in zip(idx, items):
                out[i] = d["embedding"]

    def worker(queue):
        while True:
            with lock:
                if not queue:
                    return
                idx = queue.pop(0)
            try:
                one(idx)
            except Exception as e:  # reported after the join
                with lock:
                    errors.append(repr(e))
                return

    load0 = load1()
    one(batches[0])
    usage[0] = 0
    queue = list(batches)
    procs = tree(a.pids) if a.pids else set()
    c0 = cpu_secs(procs)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(queue,)) for _ in range(a.inflight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    cpu = cpu_secs(procs) - c0 if procs else None
    if errors:
        sys.exit(f"embedding requests failed: {errors[:3]}")
    if a.save:
        np.save(a.save, np.array(out, dtype=np.float32))
    report(a.runner, len(texts), tokens if tokens is not None else usage[0], secs, cpu,
           {"batch": a.batch, "inflight": a.inflight, "usage_prompt_tokens": usage[0],
            "load1_before": round(load0, 2)})


def run_check(a):
    import numpy as np
    x, y = np.load(a.a), np.load(a.b)
    if x.shape != y.shape:
        sys.exit(f"shapes differ: {x.shape} and {y.shape}")
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    yn = y / np.linalg.norm(y, axis=1, keepdims=True)
    cos = (xn * yn).sum(axis=1)
    g = xn @ xn.T
    others = (g.sum() - np.trace(g)) / (len(g) * (len(g) - 1))
    # A random-weight encoder's mean-pooled embeddings share a large common
    # direction (texts are far above 0.9 from each other), so the cosine
    # of what is left once A's mean over the texts is taken off both is
    # the check that discriminates.
    mu = xn.mean(axis=0, keepdims=True)
    xc, yc = xn - mu, yn - mu
    ccos = (xc * yc).sum(axis=1) / (np.linalg.norm(xc, axis=1) * np.linalg.norm(yc, axis=1))
    gc = (xc / np.linalg.norm(xc, axis=1, keepdims=True))
    gc = gc @ gc.T
    cothers = (gc.sum() - np.trace(gc)) / (len(gc) * (len(gc) - 1))
    ok = bool(cos.min() >= a.min_cos and ccos.min() >= a.min_centered_cos)
    res = {"check": "cosine", "rows": len(cos), "min_cos": float(cos.min()),
           "mean_cos": float(cos.mean()), "max_abs_diff": float(np.abs(x - y).max()),
           "mean_cos_between_texts": float(others),
           "min_centered_cos": float(ccos.min()),
           "mean_centered_cos_between_texts": float(cothers), "pass": ok}
    print(json.dumps(res), flush=True)
    if not res["pass"]:
        sys.exit(f"cosine {cos.min()} (centered {ccos.min()}) below {a.min_cos} ({a.min_centered_cos})")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("st")
    s.add_argument("model")
    s.add_argument("texts")
    s.add_argument("--threads", type=int, required=True)
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    s.add_argument("--save")
    s.add_argument("--limit", type=int, help="the first N texts only")
    h = sub.add_parser("http")
    h.add_argument("base")
    h.add_argument("name")
    h.add_argument("texts")
    h.add_argument("--runner", default="pagoda")
    h.add_argument("--tokenizer", help="model folder whose tokenizer.json counts the tokens")
    h.add_argument("--batch", type=int, default=32)
    h.add_argument("--inflight", type=int, default=1)
    h.add_argument("--pids", type=int, nargs="*",
                   help="the server's processes: their CPU seconds (children included) are reported")
    h.add_argument("--save")
    h.add_argument("--limit", type=int, help="the first N texts only")
    c = sub.add_parser("check")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--min-cos", type=float, default=0.9999)
    c.add_argument("--min-centered-cos", type=float, default=0.999)
    a = ap.parse_args()
    {"st": run_st, "http": run_http, "check": run_check}[a.cmd](a)


if __name__ == "__main__":
    main()
