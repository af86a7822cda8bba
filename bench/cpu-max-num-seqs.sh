#!/usr/bin/env bash
# Where batched throughput saturates on this CPU (issue 31's "CPU defaults
# measured, not copied from GPUs"): `pagoda bench throughput` on the demo
# model at each --max-num-seqs, all prompts submitted at once. A larger
# batch past the knee only lengthens every step, and with it every
# tenant's time to first token.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
MODEL="${MODEL:-$(scripts/fetch-demo-model.sh)}"
LEVELS="${LEVELS:-2 4 8 16 32 64 128 256}"
PROMPTS="${PROMPTS:-128}"
cargo build --release --locked -p pagoda >&2
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for s in $LEVELS; do
  echo -n "--max-num-seqs $s: "
  "$CARGO_TARGET_DIR/release/pagoda" bench throughput --model "$MODEL" --max-num-seqs "$s" \
    --num-prompts "$PROMPTS" --input-len 64 --output-len 64 --max-model-len 512 --kv-cache-memory 1GiB \
    --seed 1 2>/dev/null | grep Throughput
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
