#!/usr/bin/env bash
# Offline batched throughput, Pagoda beside llama.cpp's llama-batched-bench
# on the same GGUF and thread count: the seed's workload (100 × "介绍一下深度学习",
# 256 tokens each), and 16 concurrent random prompts of 128 in / 128 out
# beside the single-stream rate.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
THREADS="${THREADS:-2}"
MODEL="$(scripts/fetch-demo-model.sh)"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(bench/build-llamacpp.sh)"
. bench/llamacpp-env.sh
P="$CARGO_TARGET_DIR/release/pagoda"
COMMON=(--model "$MODEL" --threads "$THREADS" --max-model-len 2048 --kv-cache-memory 2GiB)
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "--- llama.cpp llama-batched-bench, $THREADS threads, 128 in / 128 out, B = 1 and 16"
"$LLAMA_BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c 8192 -npp 128 -ntg 128 -npl 1,16 2>/dev/null | grep -E "^\|" || echo "(llama-batched-bench printed no table: it failed)"
echo "--- pagoda, $THREADS threads, 1 × (128 in / 128 out)"
"$P" bench throughput "${COMMON[@]}" --dataset random --num-prompts 1 --input-len 128 --output-len 128 2>/dev/null
echo "--- pagoda, $THREADS threads, 1 × (128 in / 128 out), --max-num-seqs 1 (an engine capped at one sequence keeps the int8 kernels)"
"$P" bench throughput "${COMMON[@]}" --dataset random --num-prompts 1 --input-len 128 --output-len 128 --max-num-seqs 1 2>/dev/null
echo "--- pagoda, $THREADS threads, 16 concurrent × (128 in / 128 out)"
"$P" bench throughput "${COMMON[@]}" --dataset random --num-prompts 16 --input-len 128 --output-len 128 --max-num-seqs 16 2>/dev/null
echo "--- pagoda, $THREADS threads, the seed's workload: 100 × 介绍一下深度学习, max_tokens 256"
"$P" bench throughput "${COMMON[@]}" --dataset seed --num-prompts 100 --output-len 256 2>/dev/null
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
