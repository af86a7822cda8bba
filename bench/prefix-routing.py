#!/usr/bin/env python3
"""A measured reason to route by prefix: three `pagoda serve` replicas on
loopback, a workload of several "tenants" whose requests share a long
system prompt, sent twice to fresh replicas:

1. round-robin;
2. routed to the replica holding the longest cached prefix of the
   request, as computed from the replicas' KV-cache event streams
   (`--kv-events-config`), which is how llm-d's precise prefix-cache
   scorer routes; ties go to the replica with fewest requests in flight.

The router keys blocks by their token ids, chained (a block's key covers
every token before it), as llm-d's indexer does from BlockStored events;
a request's keys come from /v1/completions/render.

Reports, per run, the fraction of prompt tokens served from the prefix
cache (usage.prompt_tokens_details.cached_tokens) and TTFT p50 / p99.

    python3 bench/prefix-routing.py [--tenants 6] [--requests 96] [--concurrency 6]
"""
import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import msgpack
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, stream=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


class Replica:
    def __init__(self, binary, model, args):
        self.port, self.events = free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="pagoda-replica-", suffix=".log", delete=False)
        cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{self.events}"})
        self.proc = subprocess.Popen(
            [binary, "serve", model, "--port", str(self.port), "--served-model-name", "m",
             "--threads", str(args.threads), "--kv-cache-memory", args.kv_cache_memory,
             "--max-model-len", "2048", "--kv-events-config", cfg],
            stdout=subprocess.DEVNULL, stderr=self.log)
        self.base = f"http://127.0.0.1:{self.port}"
        self.in_flight = 0
        self.lock = threading.Lock()

    def wait_ready(self):
        for _ in range(600):
            try:
                if urllib.request.urlopen(self.base + "/health/ready", timeout=2).status == 200:
                    return
            except Exception:
                pass
            if self.proc.poll() is not None:
                sys.exit(f"replica exited: see {self.log.name}")
            time.sleep(0.1)
        sys.exit("replica not ready")

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


class PrefixIndex:
    """Which replica holds which blocks, from the replicas' event streams."""

    def __init__(self, replicas):
        self.lock = threading.Lock()
        self.blocks = [set() for _ in replicas]  # chained token keys
        self.by_hash = [{} for _ in replicas]  # engine hash -> key
        self.ctx = zmq.Context()
        for i, r in enumerate(replicas):
            threading.Thread(target=self.listen, args=(i, r.events), daemon=True).start()
        time.sleep(0.5)

    @staticmethod
    def key(parent, tokens):
        h = hashlib.sha256()
        h.update(parent or b"")
        h.update(json.dumps(tokens).encode())
        return h.digest()[:16]

    def listen(self, i, port):
        sub = self.ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        while True:
            _, _, payload = sub.recv_multipart()
            _, events, _ = msgpack.unpackb(payload, raw=False)
            with self.lock:
                for e in events:
                    if e[0] == "BlockStored":
                        parent = self.by_hash[i].get(e[2]) if e[2] is not None else None
                        if e[2] is not None and parent is None:
                            continue  # its parent was never seen: unusable
                        for j, h in enumerate(e[1]):
                            k = self.key(parent, e[3][j * BLOCK:(j + 1) * BLOCK])
                            self.by_hash[i][h] = k
                            self.blocks[i].add(k)
                            parent = k
                    elif e[0] == "BlockRemoved":
                        for h in e[1]:
                            k = self.by_hash[i].pop(h, None)
                            self.blocks[i].discard(k)
                    elif e[0] == "AllBlocksCleared":
                        self.blocks[i].clear()
                        self.by_hash[i].clear()

    def matched_blocks(self, ids):
        keys, parent = [], None
        for j in range(len(ids) // BLOCK):
            parent = self.key(parent, ids[j * BLOCK:(j + 1) * BLOCK])
            keys.append(parent)
        out = []
        with self.lock:
            for blocks in self.blocks:
                n = 0
                while n < len(keys) and keys[n] in blocks:
                    n += 1
                out.append(n)
        return out


def workload(tenants, requests):
    topics = ["harbour logistics", "orchard care", "railway signals", "bakery orders",
              "library loans", "clinic scheduling", "bridge inspection", "weather station"]
    systems = []
    for t in range(tenants):
        topic = topics[t % len(topics)]
        rules = " ".join(f"Rule {k}: when a customer asks about {topic} item {k * 7 + t}, "
                         f"answer with the catalogue entry and its reference code {t}-{k}." for k in range(22))
        systems.append(f"You are the assistant of tenant {t}, who handles {topic}. {rules}")
    reqs = []
    for n in range(requests):
        t = (n * 5 + n // 7) % tenants
        reqs.append(f"{systems[t]}\nQuestion {n}: what is the reference code for item {n * 3}?\nAnswer:")
    return reqs


def run(args, routed):
    binary = args.binary
    replicas = [Replica(binary, args.model, args) for _ in range(3)]
    try:
        for r in replicas:
            r.wait_ready()
        index = PrefixIndex(replicas) if routed else None
        prompts = workload(args.tenants, args.requests)
        counter = {"n": 0}
        pick_lock = threading.Lock()
        results = []

        def one(prompt):
            with pick_lock:
                if routed:
                    ids = json.load(post(replicas[0].base + "/v1/completions/render",
                                         {"model": "m", "prompt": prompt}))[0]["token_ids"]
                    matched = index.matched_blocks(ids)
                    best = max(range(3), key=lambda i: (matched[i], -replicas[i].in_flight))
                else:
                    best = counter["n"] % 3
                    counter["n"] += 1
                r = replicas[best]
                with r.lock:
                    r.in_flight += 1
            start = time.time()
            ttft, usage = None, None
            resp = post(r.base + "/v1/completions", {
                "model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}})
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.time() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
            with r.lock:
                r.in_flight -= 1
            cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            results.append((ttft, usage["prompt_tokens"], cached, best))

        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, prompts))
        return results
    finally:
        for r in replicas:
            r.stop()


def report(name, results):
    ttfts = sorted(x[0] for x in results)
    prompt = sum(x[1] for x in results)
    cached = sum(x[2] for x in results)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    per_replica = [sum(1 for x in results if x[3] == i) for i in range(3)]
    print(f"{name:12s} cached {cached}/{prompt} prompt tokens ({100 * cached / prompt:.1f}%), "
          f"TTFT p50 {1000 * statistics.median(ttfts):.0f} ms, p99 {1000 * p99:.0f} ms, "
          f"requests per replica {per_replica}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default=os.path.join(ROOT, "target/release/pagoda"))
    p.add_argument("--model", default=None)
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="48MiB")
    args = p.parse_args()
    if args.model is None:
        args.model = subprocess.check_output([os.path.join(ROOT, "scripts/fetch-demo-model.sh")]).decode().strip()
    print(f"3 replicas, --threads {args.threads}, --kv-cache-memory {args.kv_cache_memory}; "
          f"{args.tenants} tenants, {args.requests} requests, {args.concurrency} at a time; "
          f"load average {open('/proc/loadavg').read().split()[:3]}", flush=True)
    report("round-robin", run(args, routed=False))
    report("prefix-aware", run(args, routed=True))


if __name__ == "__main__":
    main()
