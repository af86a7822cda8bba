#!/usr/bin/env python3
"""Greedy tokens of Pagoda and llama.cpp's llama-server on the same GGUF,
step by step, for the generated fixtures (scripts/make-fixtures.py): the
mixtures of experts and DeepSeek by default, any family by name.

    python3 bench/moe-vs-llama-cpp.py PAGODA_BIN LLAMA_BIN_DIR FIXTURES_DIR [family ...]

For each family's model-F32.gguf and model-Q8_0.gguf and each prompt of
its reference.json,
(the float64 reference of the unquantized model says who is right where the
two part on a clear step)
both servers continue the prompt's token ids greedily for 32 tokens (EOS
ignored). The runs must agree at every step, except that they may part at a step
where llama.cpp's top two logprobs are within 0.05 (a near-tie, where
either token is a correct greedy choice for a quantized model); after they
part, the continuations are not compared. llama-server reports no
probabilities for a token that is not whole UTF-8 on its own (a byte
token); at those steps Pagoda's own top-two gap decides what a near-tie is. Prints one line per
prompt and exits non-zero on a disagreement.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

NEAR_TIE = 0.05
STEPS = 32
# The fixtures' special tokens (<|endoftext|>, <|im_start|>, <|im_end|>).
SPECIALS = 3


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def wait(url, proc, log):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"server exited early; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    sys.exit(f"server did not become ready; see {log}")


def llama_cpp(base, ids):
    """(token, top-2 logprob gap) per step. One token per request: the
    server groups a stream's probabilities by whole UTF-8 pieces, which
    would merge the steps of byte tokens."""
    steps, seq = [], list(ids)
    for _ in range(STEPS):
        r = post(f"{base}/completion", {"prompt": seq, "n_predict": 1, "temperature": 0, "n_probs": 2,
                                        "ignore_eos": True, "return_tokens": True})
        tok = r["tokens"][0]
        # A token that is not whole UTF-8 on its own (a byte token) comes
        # without probabilities; Pagoda's gap stands in for it.
        probs = r.get("completion_probabilities") or []
        top = [t["logprob"] for t in probs[0]["top_logprobs"]] if probs else None
        steps.append((tok, top[0] - top[1] if top else None))
        seq.append(tok)
    return steps


def pagoda(base, ids):
    r = post(f"{base}/v1/completions", {"model": "m", "prompt": ids, "max_tokens": STEPS, "temperature": 0,
                                        "logprobs": 2, "ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r["choices"][0]["logprobs"]
    out = []
    for t, top in zip(lp["tokens"], lp["top_logprobs"]):
        v = sorted(top.values(), reverse=True)
        out.append((int(t.split(":")[1]), v[0] - v[1]))
    return out


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    pagoda_bin, llama_bin, fixtures = sys.argv[1:4]
    families = sys.argv[4:] or ["mixtral", "qwen2moe", "qwen3moe", "deepseek-v2-lite", "deepseek-v3"]
    env = dict(os.environ, LLAMA_ARG_REPACK=os.environ.get("LLAMA_ARG_REPACK", "0"))
    failed = False
    for family, qtype in [(f, q) for f in families for q in ("F32", "Q8_0")]:
        gguf = os.path.join(fixtures, family, f"model-{qtype}.gguf")
        ref = json.load(open(os.path.join(fixtures, family, "reference.json")))
        logs = (f"/tmp/moe-cmp-{family}-llama.log", f"/tmp/moe-cmp-{family}-pagoda.log")
        servers = [
            subprocess.Popen([f"{llama_bin}/llama-server", "-m", gguf, "-t", "2", "-c", "1024", "--host", "127.0.0.1",
                              "--port", "18190", "--no-webui"], stdout=open(logs[0], "w"), stderr=subprocess.STDOUT,
                             env=env),
            subprocess.Popen([pagoda_bin, "serve", "--model", gguf, "--served-model-name", "m", "--host", "127.0.0.1",
                              "--port", "18191", "--threads", "2", "--max-model-len", "256",
                              "--kv-cache-memory", "64MiB"], stdout=open(logs[1], "w"), stderr=subprocess.STDOUT),
        ]
        try:
            try:
                wait("http://127.0.0.1:18190/health", servers[0], logs[0])
            except SystemExit as e:
                print(f"{family} {qtype}: llama.cpp cannot load it ({e}); not compared")
                continue
            wait("http://127.0.0.1:18191/health/ready", servers[1], logs[1])
            for c, case in enumerate(ref["cases"]):
                ids = case["prompt_ids"]
                want = llama_cpp("http://127.0.0.1:18190", ids)
                got = pagoda("http://127.0.0.1:18191", ids)
                verdict = "agree at all 32 steps"
                for i, ((w, gap), (g, own_gap)) in enumerate(zip(want, got)):
                    if gap is None:
                        gap = own_gap
                    if w == g:
                        continue
                    before = f"agree at steps 0-{i - 1}" if i > 0 else "no step before"
                    exact = case["greedy_ids"]
                    on_reference = [t for t, _ in got[:i + 1]] == exact[:i + 1]
                    if g < SPECIALS and on_reference:
                        verdict = (f"{before}; at step {i} Pagoda and the float64 reference take the "
                                   f"special token {g}, which llama-server's ignore_eos masks (all end-of-generation tokens)")
                    elif gap < NEAR_TIE:
                        verdict = f"{before}; step {i} is a near-tie (top-2 gap {gap:.3f}) and the runs part"
                    elif on_reference:
                        verdict = (f"{before}; at step {i} (top-2 gap {gap:.3f}) llama.cpp takes {w} "
                                   f"and Pagoda {g}, which the float64 reference of the unquantized model takes too")
                    else:
                        verdict = f"DISAGREE at step {i}: pagoda {g}, llama.cpp {w} (top-2 gap {gap:.3f})"
                        failed = True
                    break
                print(f"{family} {qtype} prompt {c}: {verdict}")
        finally:
            for s in servers:
                s.terminate()
                s.wait()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
