#!/usr/bin/env bash
# Builds every guest crate (the plugin SDK's users: built-in plugins, the
# starter example, the host's test fixtures) into WebAssembly components
# and copies them to target/plugins/<name>.wasm; prints that directory.
#
#   scripts/build-plugins.sh           build the components
#   scripts/build-plugins.sh --test    run the guest crates' unit tests natively
#   scripts/build-plugins.sh --smoke   build, then load every component in
#                                      wasmtime (PyPI's `wasmtime`) and check it
#
# The guest crates form their own cargo workspace (plugins/Cargo.toml), so
# the host workspace never builds them for the host target. One target dir,
# target/wasm, serves all of them, so dependencies (serde, the wit-bindgen
# proc-macro) are built once. Idempotent: reruns only rebuild what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=build
case "${1:-}" in
    "") ;;
    --test) mode=test ;;
    --smoke) mode=smoke ;;
    *) echo "usage: $0 [--test|--smoke]" >&2; exit 2 ;;
esac

export CARGO_TARGET_DIR="$PWD/target/wasm"
manifest=plugins/Cargo.toml

if [[ $mode == test ]]; then
    # On the host target the SDK has no WIT bindings and a stand-in host,
    # so every crate's #[cfg(test)] tests (and the SDK's doc tests) run here.
    cargo test --manifest-path "$manifest" --workspace --locked
    exit 0
fi

# The component target (wasm32-wasip2 output is a component already: rustc
# links it with wasm-component-ld, no extra tooling needed).
if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2 >&2
fi

cargo build --manifest-path "$manifest" --workspace --release --locked \
    --target wasm32-wasip2 >&2

# crate name : component name. Every cdylib crate of the workspace belongs
# here; the loop below warns about a built component that is not listed.
components=(
    chat-template:chat-template
    router:router
    redact:redact
    starter:starter
    fixture-loop:loop
    fixture-oom:oom
    fixture-trap:trap
    fixture-big-output:big-output
    tag-v1:tag-v1
    tag-v2:tag-v2
)
built="$CARGO_TARGET_DIR/wasm32-wasip2/release"
out=target/plugins
mkdir -p "$out"
for pair in "${components[@]}"; do
    crate=${pair%%:*}
    name=${pair#*:}
    cp "$built/${crate//-/_}.wasm" "$out/$name.wasm.tmp"
    # Rename into place so a host watching the directory never loads a
    # half-written file.
    mv "$out/$name.wasm.tmp" "$out/$name.wasm"
done
for wasm in "$built"/*.wasm; do
    crate=$(basename "$wasm" .wasm)
    if [[ " ${components[*]} " != *" ${crate//_/-}:"* ]]; then
        # A new crate not added above, or a stale artifact of a removed one.
        echo "build-plugins.sh: warning: $crate.wasm is not in the components list" >&2
    fi
done

if [[ $mode == smoke ]]; then
    python3 -m pip install --quiet --disable-pip-version-check "wasmtime~=50.0" >&2
    python3 plugins/smoke_test.py "$out" >&2
fi

echo "$PWD/$out"
