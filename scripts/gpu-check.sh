#!/usr/bin/env bash
# One-shot check of Pagoda's CUDA backend on a GPU machine, in about 5
# minutes on an H200, with no network and no Rust.
#
#   scripts/gpu-check.sh [PATH_TO_PAGODA_BINARY]        (default ./pagoda)
#
# It builds random-weight models (a ~1B bf16 Llama HF folder; small Llama
# GGUFs in Q4_0, Q4_1, Q8_0 and F16), serves them with `pagoda serve
# --device cuda`, and checks greedy tokens and logprobs against PyTorch (HF
# model) and against Pagoda's CPU backend (GGUFs); then it benchmarks
# `pagoda bench throughput|latency` against transformers' generate. The
# checks and tolerances are described in scripts/gpu_check.py and
# docs/accelerators.md. Prints PASS/FAIL/SKIP/INFO per check, writes
# gpu-check.md, gpu-check.json and summary.txt under $OUT (else
# ./gpu-check-out/), exits 1 if any check failed.
#
# Environment:
#   GPU_CHECK_DEVICE=cuda   the device under test; `cpu` is a dry run on a
#                           CPU machine with tiny shapes
#   GPU_CHECK_SMALL=1       tiny shapes on the GPU too
#   GPU_CHECK_SKIP_BENCH=1  no benchmarks
#   GPU_CHECK_BW=4.8e12     memory bandwidth (B/s) for the decode limit
#   GPU_CHECK_BENCH_N="1 64 256", GPU_CHECK_BENCH_IN=128, GPU_CHECK_BENCH_OUT=128
#   GPU_CHECK_TIMEOUT=420   seconds for the whole Python driver
#   GPU_CHECK_KEEP=1        keep the work folder (models, server logs)
#
# Needs python3 with torch, transformers (with tokenizers) and numpy, and
# the `gguf` package. A GPU machine without network has no gguf, so carry
# its wheel: on a machine with network, in the repository root,
#   python3 -m pip download --no-deps gguf==0.19.0 -d .whl
# and this script installs .whl/gguf-*.whl into its work folder with
#   pip install --no-index --no-deps --target WORK/pylib
# when `import gguf` fails. Pagoda's CUDA backend dlopens libcuda,
# libcublas.so.12 and libnvrtc.so.12; this adds /usr/local/cuda/lib64 and
# the folders of installed nvidia-* Python wheels that hold those two
# libraries to LD_LIBRARY_PATH.
set -euo pipefail

BIN=${1:-./pagoda}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUTDIR=${OUT:-./gpu-check-out}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
PIDFILE=$WORK/pids
: >"$PIDFILE"
START=$(date +%s)

# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    local pid
    # Every server and benchmark the driver started leads its own process group.
    while read -r pid; do
        if [ -n "$pid" ]; then kill -TERM -- "-$pid" 2>/dev/null || true; fi
    done <"$PIDFILE"
    sleep 1
    while read -r pid; do
        if [ -n "$pid" ]; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
    done <"$PIDFILE"
    if [ "${GPU_CHECK_KEEP:-0}" = 1 ]; then
        echo "gpu-check: work folder kept at $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail_setup() {
    echo "FAIL  setup                        $*" | tee "$OUTDIR/summary.txt"
    echo "gpu-check: 0 passed, 1 failed"
    exit 1
}

case "$BIN" in */*) ;; *) BIN=./$BIN ;; esac
[ -x "$BIN" ] || fail_setup "no executable Pagoda binary at $BIN"
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")

PY=${PYTHON:-python3}
"$PY" -c 'import torch, transformers, tokenizers, numpy' 2>"$WORK/import.err" ||
    fail_setup "python3 lacks torch/transformers/tokenizers/numpy: $(tail -1 "$WORK/import.err")"

if ! "$PY" -c 'import gguf' 2>/dev/null; then
    whl=""
    for d in "$ROOT/.whl" ./.whl "$HERE/.whl"; do
        for f in "$d"/gguf-*.whl; do
            [ -f "$f" ] && whl=$f && break 2
        done
    done
    [ -n "$whl" ] || fail_setup "no gguf module and no .whl/gguf-*.whl (see this script's header)"
    "$PY" -m pip install --quiet --no-index --no-deps --target "$WORK/pylib" "$whl" ||
        fail_setup "cannot install $whl"
    export PYTHONPATH="$WORK/pylib${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c 'import gguf' || fail_setup "gguf still not importable from $whl"
fi

if [ "$DEVICE" != cpu ]; then
    libs=""
    [ -d /usr/local/cuda/lib64 ] && libs=/usr/local/cuda/lib64
    wheel_libs=$("$PY" - <<'EOF' 2>/dev/null || true
import glob, os, site
dirs = []
for sp in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in ("libcublas.so.12*", "libnvrtc.so.12*"):
        for f in glob.glob(os.path.join(sp, "nvidia", "**", lib), recursive=True):
            if os.path.dirname(f) not in dirs:
                dirs.append(os.path.dirname(f))
print(":".join(dirs))
EOF
)
    [ -n "$wheel_libs" ] && libs="${libs:+$libs:}$wheel_libs"
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu-check: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libcublas\.so\.12|libnvrtc\.so\.12' || true
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    fi
fi

TIMEOUT=${GPU_CHECK_TIMEOUT:-420}
# Benchmarks start only before TIMEOUT-90 s and are cut at TIMEOUT-20 s.
args=(--pagoda "$BIN" --device "$DEVICE" --out "$OUTDIR" --work "$WORK" --pidfile "$PIDFILE"
    --budget "$((TIMEOUT - 90))" --deadline "$((TIMEOUT - 20))")
[ "${GPU_CHECK_SMALL:-0}" = 1 ] && args+=(--small)
[ "${GPU_CHECK_SKIP_BENCH:-0}" = 1 ] && args+=(--skip-bench)
[ -n "${GPU_CHECK_BW:-}" ] && args+=(--bw "$GPU_CHECK_BW")
[ -n "${GPU_CHECK_BENCH_N:-}" ] && args+=(--bench-n "$GPU_CHECK_BENCH_N")
[ -n "${GPU_CHECK_BENCH_IN:-}" ] && args+=(--bench-in "$GPU_CHECK_BENCH_IN")
[ -n "${GPU_CHECK_BENCH_OUT:-}" ] && args+=(--bench-out "$GPU_CHECK_BENCH_OUT")

rc=0
timeout -k 10 "$TIMEOUT" "$PY" "$HERE/gpu_check.py" "${args[@]}" || rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "FAIL  driver                       timed out after $TIMEOUT s" |
        tee -a "$OUTDIR/summary.txt"
    echo "== checks finished before the timeout =="
    cat "$OUTDIR/summary.txt"
    rc=1
elif [ "$rc" != 0 ] && [ "$rc" != 1 ]; then
    echo "FAIL  driver                       exited with $rc" | tee -a "$OUTDIR/summary.txt"
    rc=1
fi
echo "gpu-check: $(($(date +%s) - START)) s in all, exit $rc; results in $OUTDIR"
exit "$rc"
