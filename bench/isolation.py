#!/usr/bin/env python3
"""Tenant isolation, measured through a running server (issue 48).

Called by bench/isolation.sh, which starts the servers; standard library
only. Prompts are token-id lists (exact lengths), random per request so
nothing is cached by accident. Three experiments, each printing one JSON
line:

  noisy   calm tenant's TTFT alone, then beside another tenant flooding
          FLOOD concurrent long streams (PROMPT in / OUTPUT out, ignore_eos)
  cache   calm tenant's prefix-cache hit rate (cached / prompt tokens) on
          requests sharing a long prefix, alone and while another tenant
          floods unique prompts
  timing  whether tenant B can tell from its own TTFTs that tenant A cached
          a prefix: B's TTFTs on A's cached prefix against fresh prefixes
          (Mann-Whitney U), and A's own as the control that a hit shows
"""
import argparse
import json
import math
import random
import statistics
import threading
import time
import urllib.request

VOCAB = (200, 40000)


def ids(rng, n):
    return [rng.randrange(*VOCAB) for _ in range(n)]


def complete(base, key, prompt, max_tokens, stream=True, stop=None):
    """One completion; returns (ttft_s, usage dict)."""
    body = {
        "model": "smol",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer " + key},
    )
    t0 = time.perf_counter()
    ttft = None
    usage = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        if not stream:
            v = json.load(r)
            return time.perf_counter() - t0, v["usage"]
        for line in r:
            if stop is not None and stop.is_set():
                break
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            v = json.loads(line[6:])
            if ttft is None and v.get("choices") and v["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - t0
            if v.get("usage"):
                usage = v["usage"]
    return ttft, usage


class Flood:
    """`n` threads sending requests back to back until stopped."""

    def __init__(self, base, key, n, prompt_len, output_len, seed):
        self.stop = threading.Event()
        self.done = 0
        self.threads = []
        for i in range(n):
            rng = random.Random(seed * 1000 + i)

            def run(rng=rng):
                while not self.stop.is_set():
                    try:
                        complete(base, key, ids(rng, prompt_len), output_len, stop=self.stop)
                        self.done += 1
                    except Exception:
                        time.sleep(0.1)

            t = threading.Thread(target=run, daemon=True)
            self.threads.append(t)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        # Streams stop at their next line; requests still queued for their
        # first byte are left to the server (daemon threads), which the
        # caller stops or measures on regardless.
        self.stop.set()
        deadline = time.time() + 5
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.time()))


def generated_tokens(base):
    """The server's `vllm:generation_tokens_total`, summed over labels."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:generation_tokens_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def engine_ttft(base, tenant):
    """(sum, count) of `tenant`'s engine-side time to first token (from
    arrival at the engine, without HTTP, tokenization or the client)."""
    total = count = 0.0
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if f'tenant="{tenant}"' not in line:
                continue
            if line.startswith("pagoda_tenant_time_to_first_token_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("pagoda_tenant_time_to_first_token_seconds_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total, count


def mean_since(before, after):
    n = after[1] - before[1]
    return round((after[0] - before[0]) / n * 1e3, 1) if n else float("nan")


def p50(xs):
    return statistics.median(xs) if xs else float("nan")


def noisy(a):
    rng = random.Random(48)

    def calm(n):
        return [complete(a.base, a.calm_key, ids(rng, a.calm_prompt), a.calm_output)[0] for _ in range(n)]

    calm(2)  # warm-up
    e0 = engine_ttft(a.base, "calm")
    alone = calm(a.requests)
    e1 = engine_ttft(a.base, "calm")
    with Flood(a.base, a.flood_key, a.flood, a.flood_prompt, a.flood_output, 1):
        time.sleep(a.settle)
        t0, g0 = time.perf_counter(), generated_tokens(a.base)
        e2 = engine_ttft(a.base, "calm")
        beside = calm(a.requests)
        e3 = engine_ttft(a.base, "calm")
        # What the flood generated meanwhile (the calm requests' own tokens
        # taken out): the throughput the bound costs it.
        g1, t1 = generated_tokens(a.base), time.perf_counter()
    flood_tps = (g1 - g0 - a.requests * a.calm_output) / (t1 - t0)
    return {
        "experiment": "noisy",
        "calm_ttft_p50_ms_alone": round(p50(alone) * 1e3, 1),
        "calm_ttft_p50_ms_beside_flood": round(p50(beside) * 1e3, 1),
        "ratio": round(p50(beside) / p50(alone), 2),
        "flood_tokens_per_s_beside": round(flood_tps, 1),
        # The same requests' mean TTFT inside the engine (queue and
        # prefill only): what the scheduler adds, apart from the HTTP side
        # and the bench's own clients sharing the CPU.
        "calm_engine_ttft_mean_ms_alone": mean_since(e0, e1),
        "calm_engine_ttft_mean_ms_beside_flood": mean_since(e2, e3),
        "flood_streams": a.flood,
        "calm_requests": a.requests,
    }


def cache(a):
    rng = random.Random(7)
    prefix = ids(rng, a.prefix)

    def calm(n):
        cached = total = 0
        for _ in range(n):
            _, u = complete(a.base, a.calm_key, prefix + ids(rng, 16), 1, stream=False)
            total += u["prompt_tokens"]
            cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            time.sleep(a.gap)
        return cached / total

    complete(a.base, a.calm_key, prefix + ids(rng, 16), 1, stream=False)  # fills the cache
    alone = calm(a.requests)
    with Flood(a.base, a.flood_key, a.flood, a.flood_prompt, 1, 2):
        time.sleep(a.settle)
        beside = calm(a.requests)
    return {
        "experiment": "cache",
        "reserved_fraction": a.reserved,
        "calm_hit_rate_alone": round(alone, 3),
        "calm_hit_rate_beside_flood": round(beside, 3),
        "ratio": round(beside / alone, 3) if alone else None,
    }


def mann_whitney(x, y):
    """Two-sided Mann-Whitney U test (normal approximation, tie-corrected):
    (U of x, z, p)."""
    allv = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(allv)
    i = 0
    ties = 0.0
    while i < len(allv):
        j = i
        while j + 1 < len(allv) and allv[j + 1][0] == allv[i][0]:
            j += 1
        r = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[k] = r
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    n1, n2 = len(x), len(y)
    r1 = sum(r for r, (_, g) in zip(ranks, allv) if g == 0)
    u = r1 - n1 * (n1 + 1) / 2
    mu = n1 * n2 / 2
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    z = (u - mu) / sigma if sigma else 0.0
    p = math.erfc(abs(z) / math.sqrt(2))
    return u, z, p


def timing(a):
    rng = random.Random(11)

    def ttft(key, prefix):
        return complete(a.base, key, prefix + ids(rng, 8), 1)[0]

    probe, fresh, own_hit, own_fresh = [], [], [], []
    for _ in range(a.requests):
        # A new secret each round, cached by A: B's probe is the first
        # time B sends it (a second would hit B's own cache). Alternating,
        # so drift hits all four alike.
        secret = ids(rng, a.prefix)
        complete(a.base, a.a_key, secret + ids(rng, 8), 1, stream=False)
        probe.append(ttft(a.b_key, secret))
        fresh.append(ttft(a.b_key, ids(rng, a.prefix)))
        own_hit.append(ttft(a.a_key, secret))
        own_fresh.append(ttft(a.a_key, ids(rng, a.prefix)))
    _, z, p = mann_whitney(probe, fresh)
    _, zc, pc = mann_whitney(own_hit, own_fresh)
    return {
        "experiment": "timing",
        "b_on_a_prefix_p50_ms": round(p50(probe) * 1e3, 1),
        "b_on_fresh_p50_ms": round(p50(fresh) * 1e3, 1),
        "mann_whitney_z": round(z, 2),
        "p_value": round(p, 3),
        "control_a_hit_p50_ms": round(p50(own_hit) * 1e3, 1),
        "control_a_fresh_p50_ms": round(p50(own_fresh) * 1e3, 1),
        "control_p_value": round(pc, 6),
        "control_z": round(zc, 2),
        "requests_each": a.requests,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("experiment", choices=["noisy", "cache", "timing"])
    ap.add_argument("--base", default="http://127.0.0.1:8171")
    ap.add_argument("--calm-key", default="tenant-calm-key")
    ap.add_argument("--flood-key", default="tenant-flood-key")
    ap.add_argument("--a-key", default="tenant-calm-key")
    ap.add_argument("--b-key", default="tenant-flood-key")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--flood", type=int, default=32)
    ap.add_argument("--flood-prompt", type=int, default=512)
    ap.add_argument("--flood-output", type=int, default=256)
    ap.add_argument("--calm-prompt", type=int, default=128)
    ap.add_argument("--calm-output", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--gap", type=float, default=0.2)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--reserved", type=float, default=0.0)
    a = ap.parse_args()
    print(json.dumps({"noisy": noisy, "cache": cache, "timing": timing}[a.experiment](a)), flush=True)


if __name__ == "__main__":
    main()
