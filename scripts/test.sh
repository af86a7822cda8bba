#!/usr/bin/env bash
# Runs Pagoda's whole test suite: unit tests, kernel-vs-reference tests, the
# demo-model reference checks and the end-to-end tests. This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

# One target dir inside the workspace, shared by every build below, so the
# release artifacts the tests use are the ones `cargo build --release` made.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

# The real model the reference tests run (cached after the first fetch).
PAGODA_DEMO_GGUF="$(scripts/fetch-demo-model.sh)"
export PAGODA_DEMO_GGUF

# Real clients the end-to-end tests drive (from PyPI), numpy for the
# quantized-checkpoint fixtures (scripts/quantize-hf.py), and numpy and
# gguf for the generated model fixtures with their float64 references.
python3 -m pip install --quiet --disable-pip-version-check "openai>=1.40" "anthropic>=0.50" "prometheus_client>=0.20" kubernetes-validate "jsonschema>=4" "langchain-openai>=0.3" litellm cohere numpy "gguf==0.17.1" pyzmq msgpack msgspec "moto[server]>=5.1" >&2
rm -rf "$CARGO_TARGET_DIR/generated-fixtures"
python3 scripts/make-fixtures.py "$CARGO_TARGET_DIR/generated-fixtures" >&2

# NVRTC from PyPI, so that the CUDA backend's kernels compile to PTX for
# sm_80 and sm_90 in the tests (no GPU or CUDA toolkit needed); the test
# fails rather than skips when NVRTC cannot be loaded.
eval "$(scripts/nvrtc-env.sh)"
export PAGODA_REQUIRE_NVRTC=1

# Plugins: the guest crates' own unit tests (natively), then the WASI
# components the host's end-to-end tests upload (target/plugins/*.wasm).
scripts/build-plugins.sh --test
PAGODA_PLUGIN_DIR="$(scripts/build-plugins.sh)"
export PAGODA_PLUGIN_DIR

# Release mode: the tests run real models through the real kernels, and one
# optimized build serves both the tests and the binary.
cargo build --release --workspace --locked
cargo test --release --workspace --locked -- --test-threads=2

# The engine lays quantized weights out for one kernel family per process
# (pagoda_accel::cpu::weight_level): on CPUs with AMX-BF16 the tests above
# ran the bf16 tiles, so the exactness and reference checks run again on
# the int8 kernels that an engine capped at two sequences uses (elsewhere
# this repeats the same kernels).
PAGODA_SIMD=amx cargo test --release --locked -p pagoda --test engine_batching --test reference_smollm2 -- --test-threads=2

# The same checks on the AVX2 kernels (Zen 2/3 EPYCs, pre-Ice-Lake Xeons),
# which an AVX-512 machine would otherwise never run end to end.
if grep -qw avx2 /proc/cpuinfo; then
  PAGODA_SIMD=avx2 cargo test --release --locked -p pagoda --test engine_batching --test reference_smollm2 -- --test-threads=2
fi

# Fuzzing, bounded: every parser of untrusted input for 15 s on the
# checked-in corpus (a crash fails the run; scripts/fuzz.sh says how to
# fuzz for longer).
FUZZ_SECONDS="${FUZZ_SECONDS:-15}" scripts/fuzz.sh
