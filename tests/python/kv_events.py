"""KV-cache events from a real server, read the way llm-d's endpoint picker
reads vLLM's: a pyzmq SUB socket on the publisher, msgpack batches, and a
DEALER socket asking the replay endpoint for what a late subscriber missed.

Every batch, live and replayed, is decoded twice: as plain msgpack, and
with msgspec structs declared as vLLM 0.32 declares its KVEventBatch
(tagged maps, defaults omitted), which reject any other shape.

    python3 kv_events.py BASE_URL MODEL PUB_ENDPOINT REPLAY_ENDPOINT KEY_A KEY_B ADMIN_TOKEN

Prints one line per check and, last, "N passed, M failed".
"""
import json
import sys
import time
import urllib.request

import msgpack
import msgspec
import zmq


# vLLM 0.32's event schema (vllm/distributed/kv_events.py), declared here.
class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode(payload):
    """The batch's events as plain maps, once vLLM's decoder accepted it."""
    try:
        typed = VLLM_DECODER.decode(payload)
        ok, why = True, ""
    except msgspec.DecodeError as e:
        typed, ok, why = None, False, str(e)
    check("vLLM 0.32's KVEventBatch decodes the batch", ok, why)
    batch = msgpack.unpackb(payload, raw=False)
    if typed is not None:
        check("the typed and plain decodes agree", [type(e).__name__ for e in typed.events]
              == [e.get("type") for e in batch["events"]], batch)
    return batch

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
            batch = decode(frames[2])
            check("a batch is {ts, events, data_parallel_rank}", isinstance(batch, dict)
                  and isinstance(batch.get("ts"), float) and batch.get("data_parallel_rank") == 0, batch)
            received.append((seq, batch["events"]))


def stored_events():
    return [e for _, events in received for e in events if e["type"] == "BlockStored"]


prompt = "Report on the river: " + " ".join(f"station {i} measured {i * 7 % 13} metres." for i in range(14))

# Tenant A: the prompt's full blocks arrive as BlockStored, with the ids
# /v1/completions/render gives.
post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, KEY_A)
ids = post("/v1/completions/render", {"model": MODEL, "prompt": prompt}, KEY_A)[0]["token_ids"]
drain(1.5)
full = len(ids) // BLOCK * BLOCK
chain = [e for e in stored_events()
         if e["token_ids"] and e["token_ids"][:BLOCK] == ids[:BLOCK] and e["parent_block_hash"] is None]
check("the prompt's first block was stored with no parent", len(chain) == 1, stored_events()[:2])
tokens = []
if chain:
    first = chain[0]
    tokens = list(first["token_ids"])
    hashes = list(first["block_hashes"])
    check("BlockStored carries vLLM's fields",
          first["block_size"] == BLOCK and first["lora_id"] is None and first["medium"] == "GPU"
          and first["lora_name"] is None and len(first["extra_keys"]) == len(first["block_hashes"]),
          {k: v for k, v in first.items() if k not in ("token_ids", "block_hashes")})
    # Later blocks of the same prompt name their parent.
    for e in stored_events():
        if e["parent_block_hash"] is not None and e["parent_block_hash"] == hashes[-1]:
            tokens += e["token_ids"]
            hashes += e["block_hashes"]
    check("stored token ids equal the rendered prompt's full blocks", tokens[:full] == ids[:full],
          (len(tokens), full))
    extra_a = first["extra_keys"][0]
    check("block 0 carries the tenant's cache salt", isinstance(extra_a, list) and len(extra_a) == 1, extra_a)

# Tenant B, same prompt: its own blocks, told apart by extra_keys.
before = len(stored_events())
post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, KEY_B)
drain(1.5)
firsts_b = [e for e in stored_events()[before:]
            if e["parent_block_hash"] is None and e["token_ids"][:BLOCK] == ids[:BLOCK]]
check("another tenant's identical prompt is stored again", len(firsts_b) == 1, len(firsts_b))
if chain and firsts_b:
    check("and its block 0 extra_keys differ", firsts_b[0]["extra_keys"][0] != chain[0]["extra_keys"][0],
          (firsts_b[0]["extra_keys"][0], chain[0]["extra_keys"][0]))

# Eviction: distinct prompts fill the small pool; what leaves was stored.
for i in range(12):
    p = f"Inventory {i}: " + " ".join(f"crate {i}-{j} holds {j * 11 % 17} apples." for j in range(12))
    post("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2, "temperature": 0}, KEY_A)
drain(1.5)
removed = [h for _, events in received for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
stored = {h for e in stored_events() for h in e["block_hashes"]}
check("a small pool evicts, as BlockRemoved", len(removed) > 0, len(removed))
check("every removed hash was stored first", all(h in stored for h in removed),
      [h for h in removed if h not in stored][:3])
for _, events in received:
    for e in events:
        if e["type"] == "BlockRemoved":
            check("BlockRemoved is {type, block_hashes, medium}", set(e) == {"type", "block_hashes", "medium"}
                  and e["medium"] == "GPU", e)
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
    replayed.append((seq, decode(payload)["events"]))
check("replay from 0 returns every batch, in order, then -1",
      [s for s, _ in replayed][-len(received):] == seqs and replayed[0][0] == 0, ([s for s, _ in replayed][:5], seqs[:5]))
check("batch 0 is AllBlocksCleared: the process started with an empty cache",
      bool(replayed) and replayed[0][0] == 0 and replayed[0][1] == [{"type": "AllBlocksCleared"}], replayed[:1])
check("replayed batches equal the published ones",
      dict(replayed).get(seqs[0]) == received[0][1] if seqs else False)

# Resetting the prefix cache (admin API) tells subscribers, and the next
# identical prompt finds nothing cached.
received.clear()
reset = post("/admin/v1/reset_prefix_cache", {}, ADMIN)
check("the admin API resets the prefix cache", reset == {"reset": True}, reset)
drain(1.0)
check("a reset is told as AllBlocksCleared", any(events == [{"type": "AllBlocksCleared"}] for _, events in received),
      received[:3])
again = post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, KEY_A)
cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
check("after a reset the same prompt computes every token", not cached, again["usage"])

print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
