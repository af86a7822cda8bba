#!/usr/bin/env python3
"""Soak test of a running `pagoda serve` (bench/soak.sh starts one).

For SOAK_SECONDS (default an hour) it keeps CONCURRENCY clients busy, each
looping over a mix of requests as one of three tenants: completions and
chat, streamed and not, some of them abandoned mid-stream (the client
disconnects), while a swapper uploads a new plugin version and rolls it
back every minute. Every PERIOD seconds it prints the server's RSS, open
file descriptors, KV-cache usage and the request counts so far.

At the end, once the load has stopped, it checks that descriptors and KV
usage came back to their baseline, that RSS stopped growing (the KV pool's
pages are touched lazily as blocks rotate through the free queue, so RSS
climbs towards the pool's size early on: the end may exceed the RSS of the
run's first quarter by SOAK_RSS_SLACK_MIB at most), and that no request that
should have succeeded failed. Exit status 0 when all of that holds.

Only the standard library: it runs on any Python 3.8+.
"""

import http.client
import json
import os
import random
import sys
import threading
import time
import urllib.request

HOST = os.environ.get("SOAK_HOST", "127.0.0.1")
PORT = int(os.environ["SOAK_PORT"])
PID = int(os.environ["SOAK_PID"])
ADMIN = os.environ["SOAK_ADMIN_TOKEN"]
PLUGINS = os.environ["SOAK_PLUGIN_DIR"]
SECONDS = float(os.environ.get("SOAK_SECONDS", "3600"))
CONCURRENCY = int(os.environ.get("SOAK_CONCURRENCY", "12"))
PERIOD = float(os.environ.get("SOAK_PERIOD", "60"))
RSS_SLACK_MIB = float(os.environ.get("SOAK_RSS_SLACK_MIB", "64"))
TENANTS = ["soak-a", "soak-b", "soak-c"]


def key(tenant):
    return f"key-{tenant}-123456"


def call(method, path, body=None, token=None, raw=None, timeout=120):
    conn = http.client.HTTPConnection(HOST, PORT, timeout=timeout)
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers=headers)
    r = conn.getresponse()
    text = r.read()
    conn.close()
    return r.status, text


def metric(name):
    _, text = call("GET", "/metrics")
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_kib():
    with open(f"/proc/{PID}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def open_fds():
    return len(os.listdir(f"/proc/{PID}/fd"))


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = 0
        self.abandoned = 0
        self.refused = 0
        self.failed = []

    def add(self, what, detail=None):
        with self.lock:
            if what == "failed":
                self.failed.append(detail)
            else:
                setattr(self, what, getattr(self, what) + 1)


def one_request(rng, counts):
    tenant = rng.choice(TENANTS)
    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    abandon = stream and rng.random() < 0.25
    max_tokens = rng.choice([8, 32, 96])
    body = {"model": "smol", "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]),
            "stream": stream}
    text = f"Tell me about the number {rng.randrange(10**6)} in a few words."
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    conn = http.client.HTTPConnection(HOST, PORT, timeout=300)
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"content-type": "application/json",
                          "authorization": f"Bearer {key(tenant)}"})
    r = conn.getresponse()
    if r.status == 429 or r.status == 503:
        # Limits and the instance share answer so; the client retries.
        r.read()
        conn.close()
        counts.add("refused")
        return
    if r.status != 200:
        counts.add("failed", f"{path} {r.status} {r.read()[:200]!r}")
        conn.close()
        return
    if abandon:
        r.read(64)
        conn.close()  # mid-stream: the server must abort and free it
        counts.add("abandoned")
        return
    data = r.read().decode()
    conn.close()
    if stream and "data: [DONE]" not in data:
        counts.add("failed", f"{path} stream without [DONE]: {data[-200:]!r}")
    elif stream and '"error"' in data:
        counts.add("failed", f"{path} stream error: {data[-300:]!r}")
    else:
        counts.add("ok")


def client(seed, stop, counts):
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            one_request(rng, counts)
        except Exception as e:  # a connection error is a failure too
            counts.add("failed", f"client error: {e!r}")


def swapper(stop, counts):
    """Uploads tag-v2 over tag-v1 for one tenant and rolls back, each minute."""
    with open(os.path.join(PLUGINS, "tag-v2.wasm"), "rb") as f:
        v2 = f.read()
    while not stop.wait(30):
        st, text = call("PUT", "/admin/v1/tenants/soak-a/plugins/tag", raw=v2, token=ADMIN)
        if st not in (200, 201):
            counts.add("failed", f"upload {st} {text[:200]!r}")
        if stop.wait(30):
            break
        st, text = call("POST", "/admin/v1/tenants/soak-a/plugins/tag/rollback", token=ADMIN)
        if st != 200:
            counts.add("failed", f"rollback {st} {text[:200]!r}")


def snapshot():
    return {"rss_mib": rss_kib() / 1024, "fds": open_fds(),
            "kv": metric("vllm:kv_cache_usage_perc"),
            "running": metric("vllm:num_requests_running"),
            "waiting": metric("vllm:num_requests_waiting")}


def main():
    for t in TENANTS:
        st, text = call("PUT", f"/admin/v1/tenants/{t}", {"api_keys": [key(t)],
                        "scheduling": {"weight": 1 + TENANTS.index(t)}}, token=ADMIN)
        assert st in (200, 201), (st, text)
    with open(os.path.join(PLUGINS, "tag-v1.wasm"), "rb") as f:
        st, text = call("PUT", "/admin/v1/tenants/soak-a/plugins/tag", raw=f.read(), token=ADMIN)
        assert st in (200, 201), (st, text)
    # Warm up, then take the baseline.
    call("POST", "/v1/completions", {"model": "smol", "prompt": "hi", "max_tokens": 4},
         token=key("soak-b"))
    base = snapshot()
    print(f"baseline: {base}", flush=True)
    stop = threading.Event()
    counts = Counts()
    threads = [threading.Thread(target=client, args=(i, stop, counts)) for i in range(CONCURRENCY)]
    threads.append(threading.Thread(target=swapper, args=(stop, counts)))
    for t in threads:
        t.start()
    started = time.time()
    plateau = None
    while time.time() - started < SECONDS:
        time.sleep(min(PERIOD, max(0.0, SECONDS - (time.time() - started))))
        s = snapshot()
        print(f"{time.time() - started:7.0f} s  ok {counts.ok}  abandoned {counts.abandoned}  "
              f"refused {counts.refused}  failed {len(counts.failed)}  "
              f"rss {s['rss_mib']:.0f} MiB  fds {s['fds']}  kv {s['kv']:.3f}  "
              f"running {s['running']:.0f}  waiting {s['waiting']:.0f}", flush=True)
        if plateau is None and time.time() - started >= SECONDS / 4:
            plateau = s["rss_mib"]
    stop.set()
    for t in threads:
        t.join()
    # Let abandoned requests' aborts and idle connections settle.
    time.sleep(15)
    end = snapshot()
    print(f"after: {end}", flush=True)
    problems = []
    if counts.failed:
        problems.append(f"{len(counts.failed)} requests failed, e.g. {counts.failed[:3]}")
    if end["kv"] != 0.0 or end["running"] != 0 or end["waiting"] != 0:
        problems.append(f"the engine did not drain: {end}")
    if end["fds"] > base["fds"] + 8:
        problems.append(f"descriptors grew from {base['fds']} to {end['fds']}")
    plateau = plateau if plateau is not None else end["rss_mib"]
    if end["rss_mib"] > plateau + RSS_SLACK_MIB:
        problems.append(f"RSS kept growing: {plateau:.0f} MiB after the first quarter, "
                        f"{end['rss_mib']:.0f} MiB at the end")
    total = counts.ok + counts.abandoned + counts.refused
    print(f"{total} requests: {counts.ok} ok, {counts.abandoned} abandoned mid-stream, "
          f"{counts.refused} refused by limits, {len(counts.failed)} failed", flush=True)
    if problems:
        print("SOAK FAILED:\n  " + "\n  ".join(problems), flush=True)
        return 1
    print("soak passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
