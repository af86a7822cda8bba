#!/usr/bin/env bash
# Single-stream decode at the memory's speed (issue 47): Pagoda beside
# llama.cpp's llama-bench on a 1B-shaped Llama (bench/make-1b.py: random
# weights, Llama-3.2-1B's shape, SmolLM2's tokenizer) quantized by
# llama.cpp's own llama-quantize to Q4_0 and Q4_K_M, the same files for both,
# each figure also stated against the machine's read bandwidth as
# `pagoda bench bandwidth` measures it.
#
# For each of $ROUNDS rounds (default 2), model ($MODELS, default
# "Q4_0 Q4_K_M") and thread count ($THREADS, default "1 2"), alternating:
#   llama.cpp: llama-bench -m FILE -t N -p 0 -n $OUTPUT_LEN (tg64)
#   Pagoda:    pagoda bench latency --threads N --max-num-seqs 1
#              --input-len $INPUT_LEN --output-len $OUTPUT_LEN (decode tok/s)
#   probe:     pagoda bench bandwidth --threads N --json (best GB/s)
# With AVX2=1, also Pagoda at PAGODA_SIMD=avx2 beside llama.cpp built for
# AVX2 without AVX-512 (LLAMA_AVX2_ONLY=1 bench/build-llamacpp.sh).
#
# The table gives each engine's median decode tok/s over the rounds, their
# ratio, and the bytes each streams per second (the GGUF's tensor bytes ×
# tok/s: with tied embeddings every tensor is read once per token, the
# token embedding as the output projection) as a fraction of the probe's
# best. Models stay in $DIR (default ~/.cache/pagoda/bench-1b); raw figures
# and logs go to $OUT (default /tmp/pagoda-decode-1b).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
CACHE="${PAGODA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}"
DIR="${DIR:-$CACHE/bench-1b}"
OUT="${OUT:-/tmp/pagoda-decode-1b}"
ROUNDS="${ROUNDS:-2}"
THREADS="${THREADS:-1 2}"
MODELS="${MODELS:-Q4_0 Q4_K_M}"
INPUT_LEN="${INPUT_LEN:-16}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
AVX2="${AVX2:-0}"
mkdir -p "$DIR" "$OUT"
cargo build --release --locked -p pagoda >&2
PAGODA="$CARGO_TARGET_DIR/release/pagoda"
LLAMA_BIN="$(bench/build-llamacpp.sh)"
. bench/llamacpp-env.sh
LLAMA_REPACK_NATIVE="$LLAMA_REPACK"
if [ "$AVX2" = 1 ]; then
  grep -qw avx2 /proc/cpuinfo || { echo "AVX2=1, but this CPU has no AVX2" >&2; exit 1; }
  LLAMA_BIN_AVX2="$(LLAMA_AVX2_ONLY=1 bench/build-llamacpp.sh)"
fi

# The models: F16 by make-1b.py, then llama-quantize's Q4_0 and Q4_K_M.
[ -f "$DIR/model-F16.gguf" ] || python3 bench/make-1b.py "$DIR/model-F16.gguf" >&2
for q in $MODELS; do
  f="$DIR/model-$q.gguf"
  if [ ! -f "$f" ]; then
    "$LLAMA_BIN/llama-quantize" "$DIR/model-F16.gguf" "$f.partial" "$q" >"$OUT/quantize-$q.log" 2>&1 \
      || { echo "llama-quantize $q failed: $OUT/quantize-$q.log" >&2; exit 1; }
    mv "$f.partial" "$f"
  fi
done

# Tensor bytes of a GGUF: what one decoded token reads.
weight_bytes() {
  python3 -c 'import sys, gguf; print(sum(int(t.n_bytes) for t in gguf.GGUFReader(sys.argv[1]).tensors))' "$1"
}
# llama-bench's tg tok/s (mean of its 3 repetitions), or nothing on failure.
llama_tg() { # BIN FILE THREADS REPACK
  "$1/llama-bench" -m "$2" -t "$3" -p 0 -n "$OUTPUT_LEN" -r 3 --repack "$4" -o json 2>>"$OUT/llama.log" \
    | python3 -c 'import json, sys; print([r for r in json.load(sys.stdin) if r["n_gen"] > 0][0]["avg_ts"])' \
    2>>"$OUT/llama.log" || true
}
# Pagoda's decode tok/s (median of 3 after a warm-up), or nothing on failure.
pagoda_tg() { # FILE THREADS SIMD
  local json="$OUT/pagoda-latency.json" env=()
  rm -f "$json"
  [ "$3" = native ] || env=(PAGODA_SIMD="$3")
  env "${env[@]}" "$PAGODA" bench latency --model "$1" --threads "$2" --input-len "$INPUT_LEN" \
    --output-len "$OUTPUT_LEN" --num-iters 3 --max-num-seqs 1 --max-model-len 1024 --kv-cache-memory 256MiB \
    --result-json "$json" >>"$OUT/pagoda.log" 2>&1 \
    && python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["decode_tokens_per_second"])' "$json" || true
}
# The probe's best GB/s on N threads.
probe() {
  "$PAGODA" bench bandwidth --threads "$1" --json 2>>"$OUT/probe.log" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["results"][0]["best_gbps"])' || true
}

LEVELS=native
[ "$AVX2" = 1 ] && LEVELS="native avx2"
RAW="$OUT/raw.tsv"
: >"$OUT/llama.log"; : >"$OUT/pagoda.log"; : >"$OUT/probe.log"
printf "round\tmodel\tthreads\tsimd\tengine\tvalue\n" >"$RAW"
LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg)"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; load average $LOAD_BEFORE" >&2
for round in $(seq 1 "$ROUNDS"); do
  for t in $THREADS; do
    bw="$(probe "$t")"
    echo "round $round, $t thread(s): probe ${bw:-?} GB/s" >&2
    printf "%s\t-\t%s\t-\tprobe\t%s\n" "$round" "$t" "$bw" >>"$RAW"
    for q in $MODELS; do
      f="$DIR/model-$q.gguf"
      for level in $LEVELS; do
        if [ "$level" = avx2 ]; then bin="$LLAMA_BIN_AVX2" repack=1; else bin="$LLAMA_BIN" repack="$LLAMA_REPACK_NATIVE"; fi
        l="$(llama_tg "$bin" "$f" "$t" "$repack")"
        p="$(pagoda_tg "$f" "$t" "$level")"
        echo "round $round, $q, $t thread(s), $level: llama.cpp ${l:-failed} tok/s, pagoda ${p:-failed} tok/s" >&2
        printf "%s\t%s\t%s\t%s\tllama.cpp\t%s\n%s\t%s\t%s\t%s\tpagoda\t%s\n" \
          "$round" "$q" "$t" "$level" "$l" "$round" "$q" "$t" "$level" "$p" >>"$RAW"
      done
    done
  done
done
LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg)"

SIZES=""
for q in $MODELS; do SIZES="$SIZES $q=$(weight_bytes "$DIR/model-$q.gguf")"; done
python3 - "$RAW" "$LOAD_BEFORE" "$LOAD_AFTER" "$OUTPUT_LEN" $SIZES <<'EOF' | tee "$OUT/decode-1b.md"
import csv, statistics, sys
raw, before, after, n = sys.argv[1:5]
sizes = {k: int(v) for k, v in (a.split("=") for a in sys.argv[5:])}
vals = {}
for r in csv.DictReader(open(raw), delimiter="\t"):
    if r["value"]:
        vals.setdefault((r["model"], r["threads"], r["simd"], r["engine"]), []).append(float(r["value"]))
med = lambda k: statistics.median(vals[k]) if k in vals else None
f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"
print(f"Single-stream decode (tg{n}), median over rounds; GB/s = tensor bytes × tok/s; "
      f"% = of the probe's best read bandwidth on as many threads. Load average {before} before, {after} after.\n")
print("| model | weights GB | threads | SIMD | Pagoda tok/s | llama.cpp tok/s | ratio | Pagoda GB/s | % of probe "
      "| llama.cpp GB/s | % of probe | probe GB/s |")
print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for (model, t, simd, eng) in sorted(k for k in vals if k[3] == "pagoda" or k[3] == "llama.cpp"):
    if eng != "pagoda" and (model, t, simd, "pagoda") in vals:
        continue
    p, l = med((model, t, simd, "pagoda")), med((model, t, simd, "llama.cpp"))
    bw = max(vals.get(("-", t, "-", "probe"), [0])) or None
    gb = sizes[model] / 1e9
    ps, ls = (None if x is None else x * gb for x in (p, l))
    pct = lambda s: None if s is None or bw is None else 100 * s / bw
    print(f"| {model} | {gb:.2f} | {t} | {simd} | {f(p)} | {f(l)} | {f(None if p is None or not l else p / l, 2)} "
          f"| {f(ps)} | {f(pct(ps), 0)} | {f(ls)} | {f(pct(ls), 0)} | {f(bw)} |")
EOF
