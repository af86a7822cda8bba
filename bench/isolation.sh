#!/usr/bin/env bash
# Tenant isolation (issue 48), on the demo model, through the real server
# with two tenants of weight 1 (calm and flood), everything else at its
# default. bench/isolation.py does the measuring; one JSON line each:
#   1. noisy neighbour: calm's TTFT p50 (128 in / 16 out, one at a time)
#      alone and beside flood's $FLOOD concurrent long streams (512 in /
#      256 out, ignore_eos);
#   2. cache capacity: calm's prefix-cache hit rate on requests sharing a
#      512-token prefix, alone and while flood sends unique prompts, on a
#      small KV cache ($CACHE_KV), without and then with a reservation
#      (kv_cache.reserved_fraction $RESERVED);
#   3. cross-tenant timing: tenant B's TTFTs on a prefix tenant A cached
#      against fresh prefixes (Mann-Whitney U), with A's own hit against
#      fresh as the control that a hit is visible.
# Figures go to $OUT (default /tmp/pagoda-isolation) and stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
THREADS="${THREADS:-2}"
PORT="${PORT:-8171}"
FLOOD="${FLOOD:-32}"
REQUESTS="${REQUESTS:-20}"
CACHE_KV="${CACHE_KV:-48MiB}"
RESERVED="${RESERVED:-0.3}"
EXPERIMENTS="${EXPERIMENTS:-noisy cache timing}"
EXTRA="${EXTRA:-}"
# ISO_ARGS: more bench/isolation.py flags (e.g. --calm-prompt 16).
ISO_ARGS="${ISO_ARGS:-}"
OUT="${OUT:-/tmp/pagoda-isolation}"
MODEL="$(scripts/fetch-demo-model.sh)"
# PAGODA_BIN: a binary built elsewhere (an earlier commit, for a
# before/after); otherwise this tree's, built now.
if [ -n "${PAGODA_BIN:-}" ]; then
  P="$PAGODA_BIN"
else
  cargo build --release --locked -p pagoda >&2
  P="$CARGO_TARGET_DIR/release/pagoda"
fi
. bench/lib.sh
BASE="http://127.0.0.1:$PORT"
ADMIN=bench-admin-token
mkdir -p "$OUT"
SERVER=
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT

tenant() { # tenant ID JSON
  curl -sf -X PUT "$BASE/admin/v1/tenants/$1" -H "authorization: Bearer $ADMIN" -d "$2" >/dev/null
}

# serve NAME FLAGS...: a server with tenants calm and flood.
serve() {
  local name=$1; shift
  # shellcheck disable=SC2086
  "$P" serve --model "$MODEL" --served-model-name smol --port "$PORT" --threads "$THREADS" \
    --max-model-len 2048 --admin-token "$ADMIN" --metrics-tenant-label id $EXTRA "$@" >"$OUT/server-$name.log" 2>&1 &
  SERVER=$!
  wait_ready "$BASE/health/ready"
  tenant calm '{"api_keys": ["tenant-calm-key"]}'
  tenant flood '{"api_keys": ["tenant-flood-key"]}'
}
stop() { kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=; }

echo "load: $(cut -d' ' -f1-3 /proc/loadavg); binary $P; commit $(git rev-parse --short HEAD)" | tee "$OUT/figures.jsonl"
for e in $EXPERIMENTS; do
  case $e in
    noisy)
      serve noisy
      # shellcheck disable=SC2086 # ISO_ARGS is meant to split
      python3 bench/isolation.py noisy --base "$BASE" --flood "$FLOOD" --requests "$REQUESTS" $ISO_ARGS | tee -a "$OUT/figures.jsonl"
      stop ;;
    cache)
      serve cache --kv-cache-memory "$CACHE_KV"
      python3 bench/isolation.py cache --base "$BASE" --flood "$FLOOD" --requests "$REQUESTS" | tee -a "$OUT/figures.jsonl"
      tenant calm "{\"api_keys\": [\"tenant-calm-key\"], \"kv_cache\": {\"reserved_fraction\": $RESERVED}}"
      python3 bench/isolation.py cache --base "$BASE" --flood "$FLOOD" --requests "$REQUESTS" --reserved "$RESERVED" | tee -a "$OUT/figures.jsonl"
      stop ;;
    timing)
      serve timing
      python3 bench/isolation.py timing --base "$BASE" --requests "$((REQUESTS * 2))" --a-key tenant-calm-key --b-key tenant-flood-key | tee -a "$OUT/figures.jsonl"
      stop ;;
  esac
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/figures.jsonl"
