#!/usr/bin/env bash
# Fetches the demo model (SmolLM2-135M-Instruct, GGUF Q4_1), builds Pagoda
# in release mode and runs it on the model. Extra arguments go to the
# `pagoda` subcommand, e.g. `scripts/demo.sh --prompt "Hello"`.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
MODEL="$(scripts/fetch-demo-model.sh)"
cargo build --release --locked -p pagoda >&2
if [ "$#" -eq 0 ]; then
  set -- --chat --prompt "介绍一下深度学习" --prompt "What is 2+2? Answer briefly." --max-tokens 96
fi
exec "$CARGO_TARGET_DIR/release/pagoda" generate --model "$MODEL" "$@"
