#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench, llama-server and
# llama-quantize from
# the llama-cpp-python sdist on PyPI (which vendors llama.cpp whole), into a
# cache outside the repository. Idempotent; prints the bin directory.
# With LLAMA_AVX2_ONLY=1, a second build (build-avx2) for AVX2 without
# AVX-512 or AMX, whatever this CPU has, so an AVX-512 machine can compare
# the AVX2 paths fairly (bench/avx2.sh).
# Peers' code is never committed: it lives only in the cache.
set -euo pipefail
VERSION=0.3.36
ROOT="${PAGODA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/peers/llama.cpp-$VERSION"
BUILD=build
FLAGS=(-DGGML_NATIVE=ON)
if [ "${LLAMA_AVX2_ONLY:-0}" = 1 ]; then
  BUILD=build-avx2
  FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
    -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
BIN="$ROOT/$BUILD/bin"
if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-batched-bench" ] \
  && [ -x "$BIN/llama-quantize" ]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$ROOT"
cd "$ROOT"
# pip prepares the sdist's metadata, which needs scikit-build-core and cmake.
command -v cmake >/dev/null || python3 -m pip install --quiet cmake >&2
python3 -c 'import scikit_build_core' 2>/dev/null || python3 -m pip install --quiet scikit-build-core >&2
if [ ! -d src ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$VERSION" -d dl >&2
  mkdir -p src && tar -xzf dl/llama_cpp_python-$VERSION.tar.gz -C src --strip-components=1
fi
cmake -S src/vendor/llama.cpp -B "$BUILD" "${FLAGS[@]}" -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >&2
cmake --build "$BUILD" -j2 --target llama-server llama-bench llama-batched-bench llama-quantize >&2
echo "$BIN"
