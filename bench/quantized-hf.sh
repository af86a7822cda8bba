#!/usr/bin/env bash
# Quantized Hugging Face checkpoints (issue 16): memory and decode speed of
# a GPTQ-int4 checkpoint beside its bfloat16 source and beside a GGUF Q4_0
# of the same weights.
#
# The model: a Llama-shaped bfloat16 HF folder that scripts/make-fixtures.py
# draws (hidden 1024, 12 layers, MLP 2816, vocabulary 4096: 144M
# parameters), quantized by scripts/quantize-hf.py (GPTQ, 4 bits, group
# 128) and, from an F32 GGUF of the same bfloat16 values, by llama.cpp's
# llama-quantize (Q4_0 layers, bfloat16 embedding and head, as GPTQ keeps them).
#
# Resident size: the peak RSS (`/usr/bin/time -v`) of `pagoda bench
# latency` on each, which loads the model and runs one short request.
# Decode: `pagoda bench latency --max-num-seqs 1`, GPTQ and Q4_0
# alternating, on 1 and 2 threads.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
DIR="${DIR:-/tmp/pagoda-quantized-bench}"
ROUNDS="${ROUNDS:-2}"
cargo build --release --locked -p pagoda >&2
LLAMA_BIN="$(bench/build-llamacpp.sh)"
if [ ! -f "$DIR/hf/model.safetensors" ]; then
  python3 scripts/make-fixtures.py --bench-dense "$DIR/hf" >&2
  mv "$DIR/hf/model-F32.gguf" "$DIR/model-F32.gguf"
fi
[ -f "$DIR/gptq/model.safetensors" ] || python3 scripts/quantize-hf.py --method gptq --bits 4 --group-size 128 "$DIR/hf" "$DIR/gptq" >&2
# The layers in Q4_0, the embedding and LM head left in bfloat16 as the
# GPTQ checkpoint leaves them, so that only the layers' format differs.
[ -f "$DIR/model-Q4_0.gguf" ] || "$LLAMA_BIN/llama-quantize" --pure --output-tensor-type bf16 --token-embedding-type bf16 \
  "$DIR/model-F32.gguf" "$DIR/model-Q4_0.gguf" Q4_0 >/dev/null 2>&1
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "--- peak resident size (load + one request of 16 + 16 tokens, 1 thread)"
for m in hf gptq model-Q4_0.gguf; do
  rss=$(/usr/bin/time -v "$PAGODA" bench latency --model "$DIR/$m" --threads 1 --input-len 16 --output-len 16 \
    --num-iters 1 --max-model-len 256 --kv-cache-memory 32MiB --max-num-seqs 1 2>&1 >/dev/null \
    | awk '/Maximum resident set size/ {print $6}')
  echo "$m: $((rss / 1024)) MiB"
done
for round in $(seq 1 "$ROUNDS"); do
  for t in 1 2; do
    echo "--- round $round, $t thread(s)"
    for m in gptq model-Q4_0.gguf; do
      "$PAGODA" bench latency --model "$DIR/$m" --threads "$t" --input-len 64 --output-len 128 --num-iters 3 \
        --max-model-len 1024 --kv-cache-memory 256MiB --max-num-seqs 1 2>/dev/null | sed "s|^|$m: |"
    done
  done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
