#!/usr/bin/env bash
# Side-by-side serving benchmark: Pagoda and llama.cpp's llama-server (and,
# with WITH_VLLM=1 and a prepared VLLM_PYTHON, vLLM's CPU build) on the same
# GGUF, the same thread count and the same prompts, driven by
# `pagoda bench serve` at concurrency 1, 4 and 16, alternating servers
# round by round. Writes docs/benchmarks/compare.md and compare.png.
#
# Bounded: every request has a client timeout, each level a fixed prompt
# count; loopback only. Peers live in a cache outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-2}"
LEVELS="${LEVELS:-1 4 16}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-128}"
OUT="${OUT:-docs/benchmarks}"
RESULTS="$(mktemp -d /tmp/pagoda-compare.XXXXXX)"
# Any GGUF (MODEL=...); the demo model by default.
MODEL="${MODEL:-$(scripts/fetch-demo-model.sh)}"
cargo build --release --locked -p pagoda -p pagoda-bench-report >&2
LLAMA_BIN="${LLAMA_BIN:-$(bench/build-llamacpp.sh)}"
. bench/llamacpp-env.sh
. bench/lib.sh
PAGODA="$CARGO_TARGET_DIR/release/pagoda"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT


# Each server gets the same thread count and room for 16 sequences of
# INPUT_LEN + OUTPUT_LEN tokens.
CTX=$(( (INPUT_LEN + OUTPUT_LEN + 64) ))
"$LLAMA_BIN/llama-server" -m "$MODEL" -t "$THREADS" -tb "$THREADS" --parallel 16 -c $((CTX * 16)) \
  --host 127.0.0.1 --port 18080 --no-webui >"$RESULTS/llama-server.log" 2>&1 &
pids+=($!)
"$PAGODA" serve --model "$MODEL" --threads "$THREADS" --host 127.0.0.1 --port 18081 \
  --served-model-name smol --max-model-len 2048 --max-num-seqs 16 --kv-cache-memory 1GiB \
  >"$RESULTS/pagoda.log" 2>&1 &
pids+=($!)
wait_ready http://127.0.0.1:18080/health
wait_ready http://127.0.0.1:18081/health/ready
declare -A URL=([pagoda]=http://127.0.0.1:18081 [llamacpp]=http://127.0.0.1:18080)
SERVERS="pagoda llamacpp"
if [ "${WITH_VLLM:-0}" = 1 ]; then
  : "${VLLM_PYTHON:?set VLLM_PYTHON to the python of a vLLM CPU venv (see ../shared/PEERS.md)}"
  : "${VLLM_MODEL_DIR:?set VLLM_MODEL_DIR to the HF folder of the same model}"
  VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL_DIR" \
    --served-model-name smol --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 --port 18082 \
    >"$RESULTS/vllm.log" 2>&1 &
  pids+=($!)
  wait_ready http://127.0.0.1:18082/health
  URL[vllm]=http://127.0.0.1:18082
  SERVERS="$SERVERS vllm"
fi

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$RESULTS/loadavg.txt" >&2
for round in $(seq 1 "$ROUNDS"); do
  for c in $LEVELS; do
    n=$(( c * 4 > 8 ? c * 4 : 8 ))
    for s in $SERVERS; do
      echo "round $round, concurrency $c, $s: $n requests" >&2
      timeout 900 "$PAGODA" bench serve --base-url "${URL[$s]}" --model smol --tokenizer "$MODEL" \
        --dataset random --num-prompts "$n" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --max-concurrency "$c" --ignore-eos --seed "$(( round * 100 + c ))" --no-progress \
        --result-json "$RESULTS/$s-c$c-r$round.json" >/dev/null
    done
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$RESULTS/loadavg.txt" >&2
"$CARGO_TARGET_DIR/release/bench-report" --results "$RESULTS" --out "$OUT"
cp "$RESULTS/loadavg.txt" "$OUT/compare-loadavg.txt"
echo "results: $RESULTS" >&2
