#!/usr/bin/env bash
# LoRA serving on the demo model (issue 41's acceptance figures): 16
# concurrent streams spread over 8 distinct rank-16 adapters on all seven
# projections, beside 16 streams of the base model; and one adapter's
# single stream beside the base's. Alternating base / adapters, ROUNDS times.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
ROUNDS="${ROUNDS:-2}"
THREADS="${THREADS:-2}"
MODEL="$(scripts/fetch-demo-model.sh)"
P="${PAGODA:-$CARGO_TARGET_DIR/release/pagoda}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
python3 scripts/make-lora.py "$DIR" 8 --rank 16 >/dev/null
MODULES=()
NAMES=()
for n in $(seq 0 7); do
  MODULES+=("lora$n=$DIR/lora$n")
  NAMES+=("lora$n")
done
PORT="${PORT:-8411}"
"$P" serve --model "$MODEL" --served-model-name smol --port "$PORT" --threads "$THREADS" \
  --max-model-len 1024 --kv-cache-memory 1GiB \
  --enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules "${MODULES[@]}" \
  >"$DIR/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.5
done
run() {
  "$P" bench serve --base-url "http://127.0.0.1:$PORT" --model smol --tokenizer "$MODEL" \
    --input-len 128 --output-len 64 --ignore-eos --no-progress "$@" 2>/dev/null |
    grep -E "Successful requests|Output token throughput" | tr -s ' ' | paste -sd ' '
}
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $THREADS threads; load $(cut -d' ' -f1-3 /proc/loadavg)"
# Every run draws its own prompts (its own seed): a run whose prompts an
# earlier run of the base (or of the same adapter) had cached would skip
# their prefill, and its throughput would not compare with the others'.
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r base, 16 streams:      $(run --num-prompts 64 --max-concurrency 16 --seed $((100 + r)))"
  echo "round $r 8 adapters, 16 streams: $(run --num-prompts 64 --max-concurrency 16 --seed $((200 + r)) --lora-modules "${NAMES[@]}")"
  echo "round $r base, 1 stream:        $(run --num-prompts 8 --max-concurrency 1 --seed $((300 + r)))"
  echo "round $r 1 adapter, 1 stream:   $(run --num-prompts 8 --max-concurrency 1 --seed $((400 + r)) --lora-modules lora0)"
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
