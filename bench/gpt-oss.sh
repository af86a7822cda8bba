#!/usr/bin/env bash
# gpt-oss (MXFP4 MoE) decode speed beside llama.cpp (issue 44), on a
# gpt-oss-shaped MoE of about 0.36B parameters with random weights
# (scripts/make-gpt-oss-bench.py: 12 layers, 16 experts of which 4 active,
# alternating sliding and full attention with sinks), converted by
# llama.cpp's own converter (scripts/convert-hf-to-gguf-fixture.py) and
# quantized by its llama-quantize to MXFP4_MOE (experts MXFP4, the other
# matrices Q8_0): the same file for both.
#
# Single stream: llama-bench's tg64 (-p 0 -n 64) beside `pagoda bench
# latency --max-num-seqs 1`, on 1 and 2 threads, alternating, $ROUNDS
# rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
DIR="${DIR:-/tmp/pagoda-gpt-oss-bench}"
ROUNDS="${ROUNDS:-2}"
# A Python with transformers >= 5.19 and torch; one with the converter's
# needs (numpy, torch).
PY="${PY:-python3}"
CONVERT_PY="${CONVERT_PY:-$PY}"
mkdir -p "$DIR"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(bench/build-llamacpp.sh)"
. bench/llamacpp-env.sh
LLAMA_SRC="$(dirname "$(dirname "$LLAMA_BIN")")/src/vendor/llama.cpp"
[ -f "$DIR/hf/config.json" ] || "$PY" scripts/make-gpt-oss-bench.py "$DIR/hf" >&2
[ -f "$DIR/gpt-oss-F32.gguf" ] || "$CONVERT_PY" scripts/convert-hf-to-gguf-fixture.py "$LLAMA_SRC" "$DIR/hf" \
  --outtype f32 --outfile "$DIR/gpt-oss-F32.gguf" >&2
[ -f "$DIR/gpt-oss-MXFP4_MOE.gguf" ] || "$LLAMA_BIN/llama-quantize" "$DIR/gpt-oss-F32.gguf" \
  "$DIR/gpt-oss-MXFP4_MOE.gguf" MXFP4_MOE >&2 2>/dev/null
MODEL="$DIR/gpt-oss-MXFP4_MOE.gguf"
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for t in 1 2; do
    echo "--- round $round, MXFP4_MOE, $t thread(s)"
    "$LLAMA_BIN/llama-bench" -m "$MODEL" -t "$t" -p 0 -n 64 -r 3 --repack "$LLAMA_REPACK" -o md 2>/dev/null \
      | grep -E "tg64" | sed 's/^/llama.cpp: /'
    "$PAGODA" bench latency --model "$MODEL" --threads "$t" --input-len 1 --output-len 64 \
      --num-iters 3 --max-model-len 1024 --kv-cache-memory 256MiB --max-num-seqs 1 2>/dev/null | sed 's/^/pagoda:    /'
    echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
