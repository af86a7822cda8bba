"""KV-cache events from a real server, read the way llm-d's endpoint picker
reads vLLM's: a pyzmq SUB socket on the publisher, msgpack batches, and a
DEALER socket asking the replay endpoint for what a late subscriber missed.

    python3 kv_events.py BASE_URL MODEL PUB_ENDPOINT REPLAY_ENDPOINT KEY_A KEY_B ADMIN_TOKEN

Prints one line per check and, last, "N passed, M failed".
"""
import json
import sys
import time
import urllib.request

import msgpack
import zmq

BASE, MODEL, PUB, REPLAY, KEY_A, KEY_B, ADMIN = sys.argv[1:8]
BLOCK = 16
results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"), flush=True)


def post(path, body, key):
    req = urllib.request.Request(
        BASE + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(PUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
time.sleep(1.0)  # ZeroMQ's slow joiner: let the subscription reach the publisher

received = []  # (seq, [events])


def drain(seconds):
    """Reads every message that arrives within `seconds`."""
    end = time.time() + seconds
    while time.time() < end:
        if sub.poll(100):
            frames = sub.recv_multipart()
            check("a message is [topic, 8-byte seq, payload]", len(frames) == 3 and len(frames[1]) == 8, frames[:2])
            seq = int.from_bytes(frames[1], "big")
            batch = msgpack.unpackb(frames[2], raw=False)
            check("a batch is [ts, events, dp_rank]", isinstance(batch, list) and len(batch) == 3
                  and isinstance(batch[0], float) and batch[2] == 0, batch)
            received.append((seq, batch[1]))


def stored_events():
    return [e for _, events in received for e in events if e[0] == "BlockStored"]


prompt = "Report on the river: " + " ".join(f"station {i} measured {i * 7 % 13} metres." for i in range(14))

# Tenant A: the prompt's full blocks arrive as BlockStored, with the ids
# /v1/completions/render gives.
post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, KEY_A)
ids = post("/v1/completions/render", {"model": MODEL, "prompt": prompt}, KEY_A)[0]["token_ids"]
drain(1.5)
full = len(ids) // BLOCK * BLOCK
chain = [e for e in stored_events() if e[3] and e[3][:BLOCK] == ids[:BLOCK] and e[2] is None]
check("the prompt's first block was stored with no parent", len(chain) == 1, stored_events()[:2])
tokens = []
if chain:
    first = chain[0]
    tokens = list(first[3])
    hashes = list(first[1])
    check("BlockStored is [tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys]",
          len(first) == 9 and first[4] == BLOCK and first[5] is None and first[6] == "GPU"
          and len(first[8]) == len(first[1]), first[:2] + first[4:])
    # Later blocks of the same prompt name their parent.
    for e in stored_events():
        if e[2] is not None and e[2] == hashes[-1]:
            tokens += e[3]
            hashes += e[1]
    check("stored token ids equal the rendered prompt's full blocks", tokens[:full] == ids[:full],
          (len(tokens), full))
    extra_a = first[8][0]
    check("block 0 carries the tenant's cache salt", isinstance(extra_a, list) and len(extra_a) == 1, extra_a)

# Tenant B, same prompt: its own blocks, told apart by extra_keys.
before = len(stored_events())
post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, KEY_B)
drain(1.5)
firsts_b = [e for e in stored_events()[before:] if e[2] is None and e[3][:BLOCK] == ids[:BLOCK]]
check("another tenant's identical prompt is stored again", len(firsts_b) == 1, len(firsts_b))
if chain and firsts_b:
    check("and its block 0 extra_keys differ", firsts_b[0][8][0] != chain[0][8][0], (firsts_b[0][8][0], chain[0][8][0]))

# Eviction: distinct prompts fill the small pool; what leaves was stored.
for i in range(12):
    p = f"Inventory {i}: " + " ".join(f"crate {i}-{j} holds {j * 11 % 17} apples." for j in range(12))
    post("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2, "temperature": 0}, KEY_A)
drain(1.5)
removed = [h for _, events in received for e in events if e[0] == "BlockRemoved" for h in e[1]]
stored = {h for e in stored_events() for h in e[1]}
check("a small pool evicts, as BlockRemoved", len(removed) > 0, len(removed))
check("every removed hash was stored first", all(h in stored for h in removed),
      [h for h in removed if h not in stored][:3])
for _, events in received:
    for e in events:
        if e[0] == "BlockRemoved":
            check("BlockRemoved is [tag, hashes, medium]", len(e) == 3 and e[2] == "GPU", e)
            break

seqs = [s for s, _ in received]
check("sequence numbers rise by one", seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else False, seqs[:10])

# A subscriber that joins late asks the replay endpoint for everything.
dealer = ctx.socket(zmq.DEALER)
dealer.connect(REPLAY)
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = []
while dealer.poll(5000):
    _, seq_bytes, payload = dealer.recv_multipart()
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    if seq == -1:
        break
    replayed.append((seq, msgpack.unpackb(payload, raw=False)[1]))
check("replay from 0 returns every batch, in order, then -1",
      [s for s, _ in replayed][-len(received):] == seqs and replayed[0][0] == 0, ([s for s, _ in replayed][:5], seqs[:5]))
check("batch 0 is AllBlocksCleared: the process started with an empty cache",
      bool(replayed) and replayed[0][0] == 0 and replayed[0][1] == [["AllBlocksCleared"]], replayed[:1])
check("replayed batches equal the published ones",
      dict(replayed).get(seqs[0]) == received[0][1] if seqs else False)

# Resetting the prefix cache (admin API) tells subscribers, and the next
# identical prompt finds nothing cached.
received.clear()
reset = post("/admin/v1/reset_prefix_cache", {}, ADMIN)
check("the admin API resets the prefix cache", reset == {"reset": True}, reset)
drain(1.0)
check("a reset is told as AllBlocksCleared", any(events == [["AllBlocksCleared"]] for _, events in received),
      received[:3])
again = post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, KEY_A)
cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
check("after a reset the same prompt computes every token", not cached, again["usage"])

print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
