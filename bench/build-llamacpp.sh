#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench, llama-server and
# llama-quantize from
# the llama-cpp-python sdist on PyPI (which vendors llama.cpp whole), into a
# cache outside the repository. Idempotent; prints the bin directory.
# Peers' code is never committed: it lives only in the cache.
set -euo pipefail
VERSION=0.3.36
ROOT="${PAGODA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/peers/llama.cpp-$VERSION"
BIN="$ROOT/build/bin"
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
cmake -S src/vendor/llama.cpp -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >&2
cmake --build build -j2 --target llama-server llama-bench llama-batched-bench llama-quantize >&2
echo "$BIN"
