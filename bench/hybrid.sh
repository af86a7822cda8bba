#!/usr/bin/env bash
# Hybrid (Gated DeltaNet) decode speed beside llama.cpp (issue 43), on a
# Qwen3.5-shaped model of about 0.4B parameters with random weights
# (scripts/make-hybrid-bench.py), converted by llama.cpp's own converter
# (scripts/convert-hf-to-gguf-fixture.py) and quantized by its
# llama-quantize to Q8_0: the same file for both.
#
# Single stream: llama-bench's pp64/tg128 beside `pagoda bench latency`, on
# 1 and 2 threads, alternating, $ROUNDS rounds. 16 concurrent streams with
# SERVING=1 (bench/compare.sh, Pagoda beside llama-server).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
DIR="${DIR:-/tmp/pagoda-hybrid-bench}"
ROUNDS="${ROUNDS:-2}"
# A Python with transformers >= 5.19 and torch; one with the converter's
# needs (numpy, torch, sentencepiece not required here).
PY="${PY:-python3}"
CONVERT_PY="${CONVERT_PY:-$PY}"
mkdir -p "$DIR"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(bench/build-llamacpp.sh)"
. bench/llamacpp-env.sh
LLAMA_SRC="$(dirname "$(dirname "$LLAMA_BIN")")/src/vendor/llama.cpp"
[ -f "$DIR/hf/config.json" ] || "$PY" scripts/make-hybrid-bench.py "$DIR/hf" >&2
[ -f "$DIR/hybrid-F32.gguf" ] || "$CONVERT_PY" scripts/convert-hf-to-gguf-fixture.py "$LLAMA_SRC" "$DIR/hf" \
  --outtype f32 --no-mtp --outfile "$DIR/hybrid-F32.gguf" >&2
[ -f "$DIR/hybrid-Q8_0.gguf" ] || "$LLAMA_BIN/llama-quantize" "$DIR/hybrid-F32.gguf" "$DIR/hybrid-Q8_0.gguf" Q8_0 >&2 2>/dev/null
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for t in 1 2; do
    echo "--- round $round, Q8_0, $t thread(s)"
    "$LLAMA_BIN/llama-bench" -m "$DIR/hybrid-Q8_0.gguf" -t "$t" -p 64 -n 128 -r 3 --repack "$LLAMA_REPACK" -o md 2>/dev/null \
      | grep -E "pp64|tg128" | sed 's/^/llama.cpp: /'
    "$PAGODA" bench latency --model "$DIR/hybrid-Q8_0.gguf" --threads "$t" --input-len 64 --output-len 128 \
      --num-iters 3 --max-model-len 1024 --kv-cache-memory 256MiB --max-num-seqs 1 2>/dev/null | sed 's/^/pagoda:    /'
  done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "${SERVING:-0}" = 1 ]; then
  MODEL="$DIR/hybrid-Q8_0.gguf" LEVELS=16 ROUNDS=1 OUT="$DIR/compare" bench/compare.sh >&2
  echo "--- 16 concurrent streams ($DIR/compare/compare.md)"
  grep -E "^\|" "$DIR/compare/compare.md" | head -8
fi
