#!/usr/bin/env bash
# Structured output under load: 16 concurrent chat streams (128 in / 128
# out, ignore_eos) with a JSON-schema response_format beside the same load
# unconstrained, on Pagoda and on llama.cpp's llama-server (which enforces
# the schema with its GBNF grammar sampler), each on 2 threads, one server
# at a time. The schema (a list of at least 200 objects) outlasts
# max_tokens, so every stream is 128 tokens long either way. Two rounds,
# alternating, because this machine is noisy. Then the per-step mask cost
# (cargo bench --bench structured_output).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
THREADS="${THREADS:-2}"
PORT="${PORT:-8131}"
MODEL="$(scripts/fetch-demo-model.sh)"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(bench/build-llamacpp.sh)"
. bench/llamacpp-env.sh
. bench/lib.sh
P="$CARGO_TARGET_DIR/release/pagoda"
SCHEMA='{"name":"list","schema":{"type":"array","minItems":200,"items":{"type":"object","properties":{"name":{"type":"string","maxLength":30},"score":{"type":"integer","minimum":0,"maximum":100}},"required":["name","score"],"additionalProperties":false}}}'
EXTRA="{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":$SCHEMA}}"


# load NAME SEED [EXTRA_BODY]: one measured run, printing output tok/s.
load() {
  local name=$1 seed=$2 extra=${3:-}
  local args=(--base-url "http://127.0.0.1:$PORT" --model smol --tokenizer "$MODEL"
    --endpoint /v1/chat/completions --num-prompts 48 --max-concurrency 16
    --input-len 128 --output-len 128 --seed "$seed" --ignore-eos --no-progress)
  [ -n "$extra" ] && args+=(--extra-body "$extra")
  "$P" bench serve "${args[@]}" 2>/dev/null |
    awk -v n="$name" '/Failed requests/ {f=$3} /Output token throughput/ {t=$5} /Mean TPOT/ {p=$4}
      END {printf "  %-34s %7.1f tok/s  TPOT %6.1f ms  failed %s\n", n, t, p, f}'
}

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "--- pagoda serve, $THREADS threads"
"$P" serve --model "$MODEL" --served-model-name smol --port "$PORT" --threads "$THREADS" \
  --max-model-len 2048 --kv-cache-memory 2GiB >/tmp/pagoda-so-bench.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
wait_ready "http://127.0.0.1:$PORT/health/ready"
for round in 1 2; do
  load "unconstrained (round $round)" "$((round * 10))"
  load "json_schema (round $round)" "$((round * 10 + 1))" "$EXTRA"
done
kill $SERVER; wait $SERVER 2>/dev/null || true

echo "--- llama.cpp llama-server, $THREADS threads, --parallel 16"
"$LLAMA_BIN/llama-server" -m "$MODEL" -t "$THREADS" -tb "$THREADS" --parallel 16 -c 8192 \
  --port "$PORT" --host 127.0.0.1 --no-webui -a smol >/tmp/llama-so-bench.log 2>&1 &
SERVER=$!
wait_ready "http://127.0.0.1:$PORT/health"
for round in 1 2; do
  load "unconstrained (round $round)" "$((round * 10 + 100))"
  load "json_schema (round $round)" "$((round * 10 + 101))" "$EXTRA"
done
kill $SERVER; wait $SERVER 2>/dev/null || true
trap - EXIT

echo "--- token-mask cost per step (llguidance, 49,152-token vocabulary)"
cargo bench --locked -p pagoda --bench structured_output 2>/dev/null
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
