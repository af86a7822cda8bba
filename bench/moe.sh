#!/usr/bin/env bash
# Mixture-of-experts speed beside llama.cpp, on a Mixtral-shaped model that
# scripts/make-fixtures.py draws (16 experts, top 2, experts of 512 over
# hidden 1024, 8 layers: 223M parameters, about 29M active per token),
# quantized by llama.cpp's own llama-quantize to Q8_0 and to Q4_K (--pure).
#
# 1. Single stream: llama-bench's pp64/tg128 beside `pagoda bench latency`,
#    on 1 and 2 threads, alternating.
# 2. 16 concurrent streams: bench/compare.sh (Pagoda and llama-server,
#    2 threads) at concurrency 16.
#
# Results go to stdout and $DIR/compare-*; the model files stay in $DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
DIR="${DIR:-/tmp/pagoda-moe-bench}"
ROUNDS="${ROUNDS:-2}"
mkdir -p "$DIR"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(bench/build-llamacpp.sh)"
. bench/llamacpp-env.sh
[ -f "$DIR/moe-F32.gguf" ] || python3 scripts/make-fixtures.py --bench-moe "$DIR/moe-F32.gguf" >&2
[ -f "$DIR/moe-Q8_0.gguf" ] || "$LLAMA_BIN/llama-quantize" "$DIR/moe-F32.gguf" "$DIR/moe-Q8_0.gguf" Q8_0 >&2 2>/dev/null
[ -f "$DIR/moe-Q4_K.gguf" ] || "$LLAMA_BIN/llama-quantize" --pure "$DIR/moe-F32.gguf" "$DIR/moe-Q4_K.gguf" Q4_K_M >&2 2>/dev/null
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for q in Q8_0 Q4_K; do
    for t in 1 2; do
      echo "--- round $round, $q, $t thread(s)"
      "$LLAMA_BIN/llama-bench" -m "$DIR/moe-$q.gguf" -t "$t" -p 64 -n 128 -r 3 --repack "$LLAMA_REPACK" -o md 2>/dev/null \
        | grep -E "pp64|tg128" | sed 's/^/llama.cpp: /'
      "$PAGODA" bench latency --model "$DIR/moe-$q.gguf" --threads "$t" --input-len 64 --output-len 128 \
        --num-iters 3 --max-model-len 1024 --kv-cache-memory 256MiB --max-num-seqs 1 2>/dev/null | sed 's/^/pagoda:    /'
    done
  done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "${SERVING:-1}" = 1 ]; then
  for q in Q8_0 Q4_K; do
    MODEL="$DIR/moe-$q.gguf" LEVELS=16 ROUNDS=1 OUT="$DIR/compare-$q" bench/compare.sh >&2
    echo "--- 16 concurrent streams, $q ($DIR/compare-$q/compare.md)"
    grep -E "^\|" "$DIR/compare-$q/compare.md" | head -8
  done
fi
