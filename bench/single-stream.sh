#!/usr/bin/env bash
# Single-stream speed, Pagoda beside llama.cpp's llama-bench on the same
# GGUF: prompt tok/s for a 256-token prompt (pp256) and decode tok/s for 128
# tokens (tg128), on 1 and 2 threads, alternating A B A B.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
ROUNDS="${ROUNDS:-2}"
MODEL="$(scripts/fetch-demo-model.sh)"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(bench/build-llamacpp.sh)"
. bench/llamacpp-env.sh
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for t in 1 2; do
    echo "--- round $round, $t thread(s)"
    "$LLAMA_BIN/llama-bench" -m "$MODEL" -t "$t" -p 256 -n 128 -r 3 --repack "$LLAMA_REPACK" -o md 2>/dev/null | grep -E "pp256|tg128" | sed 's/^/llama.cpp: /'
    # The default engine (up to 256 sequences: on AMX-BF16 CPUs, the bf16
    # tiles), then one capped at a single sequence (the int8 kernels).
    "$CARGO_TARGET_DIR/release/pagoda" bench latency --model "$MODEL" --threads "$t" --input-len 256 --output-len 128 \
      --num-iters 3 --max-model-len 1024 --kv-cache-memory 256MiB 2>/dev/null | sed 's/^/pagoda:    /'
    "$CARGO_TARGET_DIR/release/pagoda" bench latency --model "$MODEL" --threads "$t" --input-len 256 --output-len 128 \
      --num-iters 3 --max-model-len 1024 --kv-cache-memory 256MiB --max-num-seqs 1 2>/dev/null | sed 's/^/pagoda (--max-num-seqs 1): /'
  done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
