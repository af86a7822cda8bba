#!/usr/bin/env python3
"""Greedy tokens of Pagoda and llama.cpp's llama-server on the same f32 GGUF
of each hybrid Qwen fixture (tests/fixtures/hf-families-2026/gguf: qwen35,
qwen35moe, qwen3next as llama.cpp's converter writes them), for the three
prompts of its reference.json; with `gemma3 gpt_oss` as the families, the
Gemma 3 and gpt-oss files.

    python3 bench/hybrid-vs-llamacpp.py PAGODA_BIN LLAMA_BIN_DIR [family ...]

llama.cpp refuses the converter's own gemma3 file of the fixture: the
converter keeps the embedding rows of the tokenizer's 510 tokens but writes
512 tokens (padded), and llama.cpp wants a row per token. llama-server is
given a copy with the 2 missing rows as zeros (written with llama.cpp's
gguf-py, from LLAMA_BIN_DIR/../../src/vendor/llama.cpp or $LLAMA_CPP_SRC),
which is the model Pagoda serves from the original file (it pads likewise).

Both continue each prompt's token ids greedily for 16 tokens with the
config's eos_token_id masked and every other token allowed, as transformers'
reference was generated (min_new_tokens): llama-server with `-t 2`,
`/completion`, temperature 0, cache_prompt false, logit_bias [[eos, false]]
(its ignore_eos would also mask the other end-of-generation tokens), one
token per request so that each step's top-2 logprobs come back; Pagoda's
`/v1/completions` with min_tokens 16 and logprobs 2. Prints per prompt whether the runs agree,
else the first step where they part and both servers' top-2 gaps there, and
where each stands against transformers' float32 greedy ids. Exits non-zero
when they part at a step that is not a near-tie (gap >= 1e-3 on both
sides), or when llama.cpp cannot load a file (its log is named).
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

STEPS = 16
NEAR_TIE = 1e-3
# HYBRID_GGUF_TYPE=q8_0 compares the llama-quantize Q8_0 files instead.
TYPE = os.environ.get("HYBRID_GGUF_TYPE", "f32")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf-families-2026")


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def wait(url, proc, log):
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server did not become ready; see {log}")


def llama_cpp(base, ids, eos):
    """(token, top-2 gap or None) per step, one token per request."""
    steps, seq = [], list(ids)
    for _ in range(STEPS):
        r = post(f"{base}/completion", {"prompt": seq, "n_predict": 1, "temperature": 0, "cache_prompt": False,
                                        "n_probs": 2, "logit_bias": [[eos, False]], "return_tokens": True})
        tok = r["tokens"][0]
        # A token that is not whole UTF-8 alone (a byte token) comes back
        # without probabilities.
        probs = r.get("completion_probabilities") or []
        top = [t["logprob"] for t in probs[0]["top_logprobs"]] if probs else None
        steps.append((tok, top[0] - top[1] if top and len(top) > 1 else None))
        seq.append(tok)
    return steps


def pagoda(base, ids):
    r = post(f"{base}/v1/completions", {"model": "m", "prompt": ids, "max_tokens": STEPS, "temperature": 0,
                                        "min_tokens": STEPS, "logprobs": 2,
                                        "return_tokens_as_token_ids": True})
    lp = r["choices"][0]["logprobs"]
    out = []
    for t, top in zip(lp["tokens"], lp["top_logprobs"]):
        v = sorted(top.values(), reverse=True)
        out.append((int(t.split(":")[1]), v[0] - v[1]))
    return out


def llama_cpp_file(gguf, llama_bin, family):
    """`gguf`, or for a file whose embedding has fewer rows than tokens a
    copy with zero rows added (see the docstring)."""
    src = os.environ.get("LLAMA_CPP_SRC", os.path.join(llama_bin, "..", "..", "src", "vendor", "llama.cpp"))
    sys.path.insert(0, os.path.join(src, "gguf-py"))
    import gguf as g
    import numpy as np
    r = g.GGUFReader(gguf)
    vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    if emb.data.shape[0] >= vocab:
        return gguf
    out = f"/tmp/hybrid-cmp-{family}-padded.gguf"
    w = g.GGUFWriter(out, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        ty = f.types[0]
        w.add_key_value(f.name, f.contents(), ty, sub_type=f.types[-1] if ty == g.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name == "token_embd.weight":
            data = np.concatenate([data, np.zeros((vocab - data.shape[0], data.shape[1]), data.dtype)])
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{family}: llama.cpp reads {out} ({emb.data.shape[0]} embedding rows padded with zeros to {vocab})")
    return out


def fmt(gap):
    return "n/a (byte token)" if gap is None else f"{gap:.2e}"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    pagoda_bin, llama_bin = sys.argv[1:3]
    families = sys.argv[3:] or ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
    env = dict(os.environ, LLAMA_ARG_REPACK=os.environ.get("LLAMA_ARG_REPACK", "0"))
    failed = False
    for family in families:
        gguf = os.path.join(ROOT, "gguf", f"{family}.{TYPE}.gguf")
        ref = json.load(open(os.path.join(ROOT, family, "reference.json")))
        eos = json.load(open(os.path.join(ROOT, family, "config.json")))["eos_token_id"]
        logs = (f"/tmp/hybrid-cmp-{family}-llama.log", f"/tmp/hybrid-cmp-{family}-pagoda.log")
        servers = [
            subprocess.Popen([f"{llama_bin}/llama-server", "-m", llama_cpp_file(gguf, llama_bin, family), "-t", "2", "-c", "1024", "--host", "127.0.0.1",
                              "--port", "18290", "--no-webui"], stdout=open(logs[0], "w"), stderr=subprocess.STDOUT,
                             env=env),
            subprocess.Popen([pagoda_bin, "serve", "--model", gguf, "--served-model-name", "m", "--host", "127.0.0.1",
                              "--port", "18291", "--threads", "2", "--max-model-len", "256",
                              "--kv-cache-memory", "64MiB"], stdout=open(logs[1], "w"), stderr=subprocess.STDOUT),
        ]
        try:
            try:
                wait("http://127.0.0.1:18290/health", servers[0], logs[0])
            except RuntimeError as e:
                print(f"{family}: llama.cpp cannot load it ({e}); not compared")
                failed = True
                continue
            wait("http://127.0.0.1:18291/health/ready", servers[1], logs[1])
            for c, case in enumerate(ref["cases"]):
                ids = case["prompt_ids"]
                want = llama_cpp("http://127.0.0.1:18290", ids, eos)
                got = pagoda("http://127.0.0.1:18291", ids)
                exact = case["greedy_ids"][:STEPS]
                vs_ref = {
                    "llama.cpp": next((i for i, (t, _) in enumerate(want) if t != exact[i]), None),
                    "Pagoda": next((i for i, (t, _) in enumerate(got) if t != exact[i]), None),
                }
                ref_note = "; vs transformers: " + ", ".join(
                    f"{k} {'equal' if v is None else f'parts at step {v}'}" for k, v in vs_ref.items())
                part = next((i for i, (w, g) in enumerate(zip(want, got)) if w[0] != g[0]), None)
                if part is None:
                    print(f"{family} {TYPE} prompt {c}: agree at all {STEPS} steps{ref_note}")
                    continue
                (w, lgap), (g, pgap) = want[part], got[part]
                tie = min(x for x in (lgap, pgap) if x is not None) < NEAR_TIE
                verdict = "a near-tie" if tie else "NOT a near-tie"
                failed |= not tie
                print(f"{family} {TYPE} prompt {c}: agree at steps 0-{part - 1}; at step {part} llama.cpp takes {w} "
                      f"(top-2 gap {fmt(lgap)}), Pagoda {g} (top-2 gap {fmt(pgap)}): {verdict}{ref_note}")
        finally:
            for s in servers:
                s.terminate()
                s.wait()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
