#!/usr/bin/env bash
# lm-evaluation-harness (lm-eval 0.4.13 from PyPI) against `pagoda serve`
# and against llama.cpp (llama-cpp-python 0.3.36's server, the llama.cpp
# server that echoes prompt logprobs) on the demo model, one server at a
# time, 2 threads each:
#   - pagoda_mc (bench/lm-eval/mc.jsonl, multiple choice by log-likelihood,
#     which needs echo + logprobs): Pagoda through lm-eval's
#     local-completions (token prompts; its tokenizer through Pagoda's
#     /tokenizer_info, /tokenize and /detokenize) and through lm-eval's gguf
#     adapter (text prompts, split by text_offset); llama.cpp through the
#     gguf adapter, which lm-eval wrote for it.
#   - pagoda_capitals (bench/lm-eval/capitals.jsonl, greedy generation,
#     scored on whether the answer names the capital):
#     local-chat-completions against both, with the model's chat template.
# Prints one line per run: accuracy (± stderr) and wall time. Not part of
# CI: it installs two virtualenvs (lm-eval, and llama-cpp-python, which
# compiles llama.cpp: about 15 minutes on 2 cores the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
THREADS="${THREADS:-2}"
PORT="${PORT:-8141}"
LM_EVAL_VENV="${LM_EVAL_VENV:-$HOME/.cache/pagoda/lm-eval-0.4.13}"
LLAMA_VENV="${LLAMA_VENV:-$HOME/.cache/pagoda/llama-cpp-python-0.3.36}"

if ! "$LM_EVAL_VENV/bin/python" -c 'import lm_eval' 2>/dev/null; then
  echo "installing lm-eval into $LM_EVAL_VENV" >&2
  python3 -m venv "$LM_EVAL_VENV"
  "$LM_EVAL_VENV/bin/pip" install -q "lm-eval[api]==0.4.13" >&2
fi
if ! "$LLAMA_VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
  echo "building llama-cpp-python into $LLAMA_VENV" >&2
  python3 -m venv "$LLAMA_VENV"
  # AVX-512 without AMX: ggml's AMX path crashes on this project's Xeon VMs
  # (see bench/llamacpp-env.sh), and accuracy does not depend on it.
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF" \
    "$LLAMA_VENV/bin/pip" install -q "llama-cpp-python[server]==0.3.36" >&2
fi
MODEL="$(scripts/fetch-demo-model.sh)"
cargo build --release --locked -p pagoda >&2
P="$CARGO_TARGET_DIR/release/pagoda"
OUT="$(mktemp -d)"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BASE="http://127.0.0.1:$PORT"
. bench/lib.sh


# run NAME TASK LM_EVAL_ARGS...: one harness run; prints its score.
run() {
  local name=$1 task=$2; shift 2
  local start; start=$(date +%s)
  (cd bench/lm-eval && "$LM_EVAL_VENV/bin/lm_eval" --include_path . --tasks "$task" \
    --output_path "$OUT/$name" "$@") >"$OUT/$name.log" 2>&1 ||
    { echo "lm_eval failed for $name; its log:" >&2; tail -40 "$OUT/$name.log" >&2; return 1; }
  local secs=$(( $(date +%s) - start ))
  "$LM_EVAL_VENV/bin/python" - "$OUT/$name" "$task" "$name" "$secs" <<'PY'
import glob, json, sys
out, task, name, secs = sys.argv[1:]
path = sorted(glob.glob(f"{out}/**/results_*.json", recursive=True))[-1]
r = json.load(open(path))["results"][task]
scores = [f"{k.split(',')[0]} {v:.3f} ± {r[k.replace(',', '_stderr,')]:.3f}"
          for k, v in sorted(r.items()) if isinstance(v, float) and "_stderr" not in k]
print(f"  {name:<40} {', '.join(scores)}  ({secs} s)")
PY
}

echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "--- pagoda serve, $THREADS threads"
"$P" serve --model "$MODEL" --served-model-name smol --port "$PORT" --threads "$THREADS" \
  --max-model-len 2048 --kv-cache-memory 1GiB >"$OUT/pagoda.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
wait_ready "$BASE/health/ready"
run pagoda-local-completions pagoda_mc --model local-completions \
  --model_args "model=smol,base_url=$BASE/v1/completions,tokenizer_backend=remote,num_concurrent=4,max_retries=1"
run pagoda-gguf-adapter pagoda_mc --model gguf --model_args "base_url=$BASE"
run pagoda-local-chat-completions pagoda_capitals --model local-chat-completions --apply_chat_template \
  --model_args "model=smol,base_url=$BASE/v1/chat/completions,num_concurrent=4,max_retries=1"
kill $SERVER; wait $SERVER 2>/dev/null || true

echo "--- llama.cpp (llama-cpp-python $("$LLAMA_VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)') server), $THREADS threads"
"$LLAMA_VENV/bin/python" -m llama_cpp.server --model "$MODEL" --model_alias smol \
  --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx 2048 --logits_all true \
  --interrupt_requests false --host 127.0.0.1 --port "$PORT" >"$OUT/llama.log" 2>&1 &
SERVER=$!
wait_ready "$BASE/v1/models"
run llama-cpp-gguf-adapter pagoda_mc --model gguf --model_args "base_url=$BASE"
run llama-cpp-local-chat-completions pagoda_capitals --model local-chat-completions --apply_chat_template \
  --model_args "model=smol,base_url=$BASE/v1/chat/completions,num_concurrent=1,max_retries=1"
kill $SERVER; wait $SERVER 2>/dev/null || true
rm -rf "$OUT"
