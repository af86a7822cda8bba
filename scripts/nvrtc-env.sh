#!/usr/bin/env bash
# Prepares a shell to compile Pagoda's CUDA kernels with NVRTC without a CUDA
# toolkit or a GPU: installs NVIDIA's NVRTC wheel from PyPI (libnvrtc.so.12
# and its libnvrtc-builtins) into a cache directory once, and prints the
# `export` lines that let cudarc's run-time loader find it.
#
#   eval "$(scripts/nvrtc-env.sh)"
#   PAGODA_REQUIRE_NVRTC=1 cargo test -p pagoda-accel --features cuda --lib cuda
#
# The kernels include no CUDA headers (the portability section at the top of
# accel/src/backend/cuda/kernels.cu spells f16/bf16 conversions and dp4a
# itself), so the runtime wheel with cuda_fp16.h is not needed. Pinned so CI
# compiles with the NVRTC the bindings were generated for (cudarc's
# `cuda-12080`).
set -euo pipefail

NVRTC_WHEEL="nvidia-cuda-nvrtc-cu12==12.8.93"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/pagoda/nvrtc/12.8.93"
lib="$cache/nvidia/cuda_nvrtc/lib"

if [ ! -e "$lib/libnvrtc.so.12" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
        --target "$cache" "$NVRTC_WHEEL" >&2
fi
if [ ! -e "$lib/libnvrtc.so.12" ]; then
    echo "nvrtc-env.sh: $NVRTC_WHEEL installed no libnvrtc.so.12 under $lib" >&2
    exit 1
fi

# Quoted for eval: a cache path may hold spaces.
printf 'export LD_LIBRARY_PATH=%q\n' "$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
