#!/usr/bin/env bash
# Soak test (issue 17; not part of CI): `pagoda serve` on the demo model
# with three tenants (weights 1:2:3) and a plugin, under SOAK_CONCURRENCY
# (12) clients for SOAK_SECONDS (an hour): completions and chat, streamed
# and not, a quarter of the streams abandoned mid-way, and a plugin
# version swapped in and rolled back every minute. bench/soak.py prints
# RSS, open descriptors and KV usage every minute and fails unless they
# return to baseline and no request that should have succeeded failed.
#   SOAK_SECONDS=600 bench/soak.sh     a ten-minute run
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
PORT="${PORT:-8171}"
MODEL="$(scripts/fetch-demo-model.sh)"
cargo build --release --locked -p pagoda >&2
PLUGIN_DIR="$(scripts/build-plugins.sh | tail -1)"
. bench/lib.sh
STATE="$(mktemp -d)"
TOKEN=soak-admin-token
target/release/pagoda serve --model "$MODEL" --served-model-name smol --port "$PORT" \
  --threads "${THREADS:-2}" --max-model-len 2048 --max-num-seqs 16 --kv-cache-memory 512MiB \
  --admin-token "$TOKEN" --state-dir "$STATE/state" >"$STATE/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$STATE"' EXIT
wait_ready "http://127.0.0.1:$PORT/health/ready"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
SOAK_PORT=$PORT SOAK_PID=$SERVER SOAK_ADMIN_TOKEN=$TOKEN SOAK_PLUGIN_DIR=$PLUGIN_DIR \
  python3 bench/soak.py
