#!/usr/bin/env bash
# Fuzzes the parsers that take untrusted input (fuzz/fuzz_targets/: OpenAI
# and admin request bodies, GGUF, HF config.json and safetensors, chat
# templates) with cargo-fuzz and libFuzzer, on stable Rust
# (`--sanitizer none`), starting from the checked-in corpus (fuzz/corpus/).
# CI runs every target for FUZZ_SECONDS (15) each. A crash stops the run:
# its input is in fuzz/artifacts/<target>/; fix it and add the input to the
# target's corpus.
#   scripts/fuzz.sh                      every target, 15 s each, one after another
#   FUZZ_SECONDS=3600 scripts/fuzz.sh --parallel   an hour each, all at once
# New inputs found along the way go to target/fuzz/corpus/, never into the
# checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH="${FUZZ_SECONDS:-15}"
TARGET_DIR="$PWD/target/fuzz"
FUZZ_VERSION=0.13.2
if ! cargo fuzz --version 2>/dev/null | grep -q "$FUZZ_VERSION"; then
  cargo install --locked "cargo-fuzz@$FUZZ_VERSION" >&2
fi
cd fuzz
cargo fuzz build --sanitizer none --target-dir "$TARGET_DIR" >&2

# run TARGET: fuzzes it on a working copy of its corpus; prints its stats.
run() {
  local t=$1 work="$TARGET_DIR/corpus/$1"
  mkdir -p "$work"
  cp -r "corpus/$t/." "$work/"
  cargo fuzz run --sanitizer none --target-dir "$TARGET_DIR" "$t" "$work" -- \
    -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    >"$TARGET_DIR/$t.$$.log" 2>&1 ||
    { echo "fuzz target $t failed; the end of its log:" >&2; tail -40 "$TARGET_DIR/$t.$$.log" >&2; return 1; }
  awk -v t="$t" '/stat::number_of_executed_units/ {e=$2} /stat::peak_rss_mb/ {r=$2}
    /cov: [0-9]+/ {for (i=1;i<=NF;i++) if ($i=="cov:") c=$(i+1)}
    END {printf "  %-16s %10d execs, coverage %s, peak RSS %s MB\n", t, e, c, r}' "$TARGET_DIR/$t.$$.log"
}

targets=$(cargo fuzz list)
if [ "${1:-}" = "--parallel" ]; then
  pids=()
  for t in $targets; do run "$t" & pids+=($!); done
  status=0
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  exit $status
fi
for t in $targets; do run "$t"; done
