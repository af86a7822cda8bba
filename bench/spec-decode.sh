#!/usr/bin/env bash
# Speculative decoding beside plain decoding, same run, alternating, on the
# demo model (SmolLM2-135M-Instruct Q4_1):
#
# 1. Single stream, 1 thread, the rewrite workload (repeat a passage word
#    for word, greedy): `pagoda bench latency --dataset rewrite`, plain and
#    with n-gram drafts ($NGRAM).
# 2. The same on the random workload, where prompt lookup finds nothing.
# 3. 16 concurrent streams, 2 threads (`pagoda bench throughput` with
#    --max-num-seqs 16: 48 prompts, sampled at temperature 1 as vLLM's
#    bench does), random 128/128 and rewrite, plain and with the same flag
#    at its defaults (speculation pauses above 8 running sequences).
# 4. A draft model: the demo Q4_1 file drafting for a float32 copy of
#    itself (scripts/dequantize-gguf.py writes it to $DIR), served as f32
#    and as bf16 (--dtype bfloat16); single stream, 1 thread, the random
#    workload, plain and with {"model": Q4_1, "num_speculative_tokens": $DRAFT_K}.
#
# Results go to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
ROUNDS="${ROUNDS:-3}"
DIR="${DIR:-/tmp/pagoda-spec-bench}"
DRAFT_K="${DRAFT_K:-4}"
mkdir -p "$DIR"
NGRAM="${NGRAM:-{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}}"
cargo build --release --locked -p pagoda >&2
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
MODEL="${MODEL:-$(scripts/fetch-demo-model.sh)}"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
echo "speculative config: $NGRAM"
[ -f "$DIR/demo-F32.gguf" ] || python3 scripts/dequantize-gguf.py "$MODEL" "$DIR/demo-F32.gguf" >&2
DRAFT="{\"model\": \"$MODEL\", \"num_speculative_tokens\": $DRAFT_K}"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$ROUNDS"); do
  for dataset in rewrite random; do
    for mode in plain ngram; do
      spec=()
      [ "$mode" = ngram ] && spec=(--speculative-config "$NGRAM")
      printf 'round %s, single stream, 1 thread, %-7s %-5s: ' "$round" "$dataset" "$mode"
      "$PAGODA" bench latency --model "$MODEL" --threads 1 --dataset "$dataset" \
        --input-len 128 --output-len 128 --num-iters 8 "${spec[@]}" 2>/dev/null | sed 's/^cpu[^:]*: //'
    done
  done
  for dataset in random rewrite; do
    for mode in plain ngram; do
      spec=()
      [ "$mode" = ngram ] && spec=(--speculative-config "$NGRAM")
      printf 'round %s, 16 streams, 2 threads, %-7s %-5s: ' "$round" "$dataset" "$mode"
      "$PAGODA" bench throughput --model "$MODEL" --threads 2 --dataset "$dataset" \
        --num-prompts 48 --max-num-seqs 16 --input-len 128 --output-len 128 "${spec[@]}" 2>/dev/null \
        | tr '\n' ' ' | sed 's/  */ /g'
      echo
    done
  done
  for dtype in float32 bfloat16; do
    for mode in plain draft; do
      spec=()
      [ "$mode" = draft ] && spec=(--speculative-config "$DRAFT")
      printf 'round %s, single stream, 1 thread, F32 copy as %-8s %-5s: ' "$round" "$dtype" "$mode"
      "$PAGODA" bench latency --model "$DIR/demo-F32.gguf" --dtype "$dtype" --threads 1 --dataset random \
        --input-len 128 --output-len 128 --num-iters 3 "${spec[@]}" 2>/dev/null | sed 's/^cpu[^:]*: //'
    done
  done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
