#!/usr/bin/env bash
# Two builds of Pagoda side by side on the demo model, alternating A B A B:
# single-stream decode (`bench latency`, 128 tokens) and 16-way serving
# (`bench serve` against `serve`, 64 requests of 128 in / 64 out, 16 in
# flight). For changes that must not cost speed (issue 46's engine step).
#
#   bench/before-after.sh BEFORE_BIN AFTER_BIN [ROUNDS]
#
# Build each revision in a worktree of its own, e.g.
#   git worktree add /tmp/before REV && (cd /tmp/before &&
#     CARGO_TARGET_DIR=/tmp/before-target cargo build --release -p pagoda)
set -euo pipefail
cd "$(dirname "$0")/.."
A="$1"
B="$2"
ROUNDS="${3:-2}"
MODEL="$(scripts/fetch-demo-model.sh)"
THREADS="${THREADS:-2}"
COMMON=(--model "$MODEL" --threads "$THREADS" --max-model-len 1024 --kv-cache-memory 1GiB)
PORT="${PORT:-8391}"

decode() {
  "$1" bench latency "${COMMON[@]}" --max-num-seqs 1 --input-len 32 --output-len 128 2>/dev/null |
    grep -oE "decode [0-9]+ tokens: [0-9.]+ tok/s"
}

serve16() {
  local bin="$1" log
  log="$(mktemp)"
  "$bin" serve "${COMMON[@]}" --served-model-name smol --port "$PORT" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    # /health/ready: both revisions have it (/health was liveness before).
    curl -sf "http://127.0.0.1:$PORT/health/ready" >/dev/null 2>&1 && break
    sleep 0.5
  done
  "$bin" bench serve --base-url "http://127.0.0.1:$PORT" --model smol --tokenizer "$MODEL" \
    --num-prompts 64 --max-concurrency 16 --input-len 128 --output-len 64 --ignore-eos \
    --no-progress 2>/dev/null | grep -iE "successful requests|output token throughput" || true
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -f "$log"
  PORT=$((PORT + 1))
}

echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $THREADS threads"
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    bin="$A"
    [ "$side" = B ] && bin="$B"
    echo "--- round $r, $side ($bin), load $(cut -d' ' -f1 /proc/loadavg)"
    echo "single stream:"
    decode "$bin"
    echo "16-way serving:"
    serve16 "$bin"
  done
done
