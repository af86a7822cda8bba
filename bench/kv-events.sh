#!/usr/bin/env bash
# What publishing KV-cache events costs the engine: 16-way batched
# throughput (`pagoda bench throughput`, 64 random prompts of 128 tokens,
# 128 output tokens, --max-num-seqs 16, 2 threads) with events off, on with
# no subscriber, and on with a subscriber that reads one message every
# 0.2 s (bench/slow-subscriber.py), alternating, $ROUNDS rounds after one
# discarded warm-up run.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
ROUNDS="${ROUNDS:-3}"
PORT="${PORT:-5597}"
cargo build --release --locked -p pagoda >&2
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
MODEL="${MODEL:-$(scripts/fetch-demo-model.sh)}"
EVENTS="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$PORT\"}"
run() {
  "$PAGODA" bench throughput --model "$MODEL" --threads 2 --dataset random --num-prompts 64 \
    --max-num-seqs 16 --input-len 128 --output-len 128 "$@" 2>/dev/null | grep -o "[0-9.]* output tokens/s"
}
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
run > /dev/null  # warm-up, discarded: the first run of a sitting is slow
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  echo "round $round, events off:               $(run)"
  echo "round $round, events on, no subscriber: $(run --kv-events-config "$EVENTS")"
  python3 bench/slow-subscriber.py "tcp://127.0.0.1:$PORT" 0.2 > /tmp/pagoda-slow-sub.txt &
  SUB=$!
  echo "round $round, events on, slow reader:   $(run --kv-events-config "$EVENTS")"
  kill -TERM "$SUB"; wait "$SUB" || true
  echo "  ($(cat /tmp/pagoda-slow-sub.txt))"
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
