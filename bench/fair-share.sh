#!/usr/bin/env bash
# Fair share between tenants (issue 17's benchmark): tenant A floods the
# server with 64 concurrent long requests (512 prompt tokens, 256 output,
# ignore_eos) while tenant B sends one short request at a time (128 in,
# 16 out). Reports B's TTFT alone, then beside A's flood under
# `--scheduling-policy fair` (the default) and under `fcfs`, one server at
# a time on the demo model. Each server holds 16 sequences, so A alone
# keeps 48 requests waiting.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
THREADS="${THREADS:-2}"
PORT="${PORT:-8161}"
B_REQUESTS="${B_REQUESTS:-12}"
# Under FCFS each of B's requests waits out about three rounds of A's, so
# fewer of them are timed there.
B_REQUESTS_FCFS="${B_REQUESTS_FCFS:-3}"
MODEL="$(scripts/fetch-demo-model.sh)"
cargo build --release --locked -p pagoda >&2
. bench/lib.sh
P="$CARGO_TARGET_DIR/release/pagoda"
BASE="http://127.0.0.1:$PORT"
ADMIN=bench-admin-token
OUT="$(mktemp -d)"
SERVER=
FLOOD=
cleanup() {
  for p in $FLOOD $SERVER; do kill "$p" 2>/dev/null || true; done
  rm -rf "$OUT"
}
trap cleanup EXIT

# serve POLICY: starts a server with tenants a and b (weight 1 each).
serve() {
  "$P" serve --model "$MODEL" --served-model-name smol --port "$PORT" --threads "$THREADS" \
    --max-model-len 1024 --max-num-seqs 16 --kv-cache-memory 1GiB \
    --scheduling-policy "$1" --admin-token "$ADMIN" >"$OUT/server-$1.log" 2>&1 &
  SERVER=$!
  wait_ready "$BASE/health/ready"
  for t in a b; do
    curl -sf -X PUT "$BASE/admin/v1/tenants/$t" -H "authorization: Bearer $ADMIN" \
      -d "{\"api_keys\": [\"tenant-$t-key\"]}" >/dev/null
  done
}

stop() { kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=; }

# b_ttft N: N of tenant B's requests, one at a time; prints their median
# TTFT (ms).
b_ttft() {
  "$P" bench serve --base-url "$BASE" --model smol --tokenizer "$MODEL" --api-key tenant-b-key \
    --num-prompts "$1" --max-concurrency 1 --input-len 128 --output-len 16 \
    --ignore-eos --seed 7 --no-progress 2>/dev/null |
    awk '/Failed requests/ && $3 != 0 {print "B had failed requests" > "/dev/stderr"; exit 1}
         /Median TTFT/ {print $4}'
}

# flood: tenant A's 64 concurrent long requests, in the background.
flood() {
  "$P" bench serve --base-url "$BASE" --model smol --tokenizer "$MODEL" --api-key tenant-a-key \
    --num-prompts 400 --max-concurrency 64 --input-len 512 --output-len 256 \
    --ignore-eos --seed 3 --no-progress >/dev/null 2>&1 &
  FLOOD=$!
  # Until A's requests fill the 16 slots and the queue behind them.
  for _ in $(seq 1 300); do
    local waiting
    waiting=$(curl -sf "$BASE/metrics" | awk '/^vllm:num_requests_waiting/ {print int($2)}')
    [ "${waiting:-0}" -ge 40 ] && return 0
    sleep 1
  done
  echo "A's flood never queued 40 requests" >&2; return 1
}

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg), $THREADS threads, $(nproc) cores"
serve fair
alone=$(b_ttft "$B_REQUESTS")
flood
fair=$(b_ttft "$B_REQUESTS")
kill "$FLOOD"; FLOOD=
stop
serve fcfs
flood
fcfs=$(b_ttft "$B_REQUESTS_FCFS")
kill "$FLOOD"; FLOOD=
stop
printf '%-44s %10s %8s\n' "tenant B, median TTFT" "ms" "x alone"
printf '%-44s %10.1f %8s\n' "alone" "$alone" "1.00"
printf '%-44s %10.1f %8.2f\n' "beside A's flood, --scheduling-policy fair" "$fair" "$(echo "$fair / $alone" | bc -l)"
printf '%-44s %10.1f %8.2f\n' "beside A's flood, --scheduling-policy fcfs" "$fcfs" "$(echo "$fcfs / $alone" | bc -l)"
