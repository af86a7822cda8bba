#!/usr/bin/env bash
# The AVX2 paths side by side (issue 31), on any x86 machine with AVX2:
# llama.cpp built for AVX2 without AVX-512 or AMX (LLAMA_AVX2_ONLY=1
# bench/build-llamacpp.sh) against Pagoda forced to its AVX2 kernels and
# weight layout (PAGODA_SIMD=avx2), on the demo model (or MODEL=...).
#
# 1. Single stream, 1 thread: llama-bench -t 1 -p 16 -n 128 against
#    `pagoda bench latency --threads 1 --input-len 16 --output-len 128
#    --max-num-seqs 1`, alternating, $ROUNDS rounds.
# 2. With SERVING=1 (the default), 16 concurrent streams, 2 threads:
#    bench/compare.sh at concurrency 16 (llama-server --parallel 16).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
ROUNDS="${ROUNDS:-2}"
grep -qw avx2 /proc/cpuinfo || { echo "this CPU has no AVX2" >&2; exit 1; }
MODEL="${MODEL:-$(scripts/fetch-demo-model.sh)}"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(LLAMA_AVX2_ONLY=1 bench/build-llamacpp.sh)"
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
export PAGODA_SIMD=avx2
# The AVX2 build has no AMX path to crash in: llama.cpp repacks its weights
# for its AVX2 kernels, as it would on an AVX2-only server.
export LLAMA_REPACK=1
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; PAGODA_SIMD=avx2, llama.cpp $LLAMA_BIN"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  echo "--- round $round, 1 thread"
  "$LLAMA_BIN/llama-bench" -m "$MODEL" -t 1 -p 16 -n 128 -r 3 -o md 2>/dev/null | grep -E "pp16|tg128" | sed 's/^/llama.cpp AVX2: /'
  "$PAGODA" bench latency --model "$MODEL" --threads 1 --input-len 16 --output-len 128 --num-iters 3 \
    --max-num-seqs 1 --max-model-len 1024 --kv-cache-memory 256MiB 2>/dev/null | sed 's/^/pagoda AVX2:    /'
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "${SERVING:-1}" = 1 ]; then
  LLAMA_BIN="$LLAMA_BIN" LEVELS=16 ROUNDS=1 OUT="${OUT:-/tmp/pagoda-avx2-compare}" bench/compare.sh >&2
  echo "--- 16 concurrent streams, 2 threads (${OUT:-/tmp/pagoda-avx2-compare}/compare.md)"
  grep -E "^\|" "${OUT:-/tmp/pagoda-avx2-compare}/compare.md" | head -8
fi
