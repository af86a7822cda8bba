#!/usr/bin/env python3
"""Writes a 1B-shaped Llama GGUF in F16 with random weights, for decode
benchmarks against llama.cpp on the same file (issue 47).

    python3 bench/make-1b.py [OUT.gguf] [--tokenizer-from SMOLLM2.gguf] [--seed N]

The shape is Llama-3.2-1B's: hidden 2048, MLP 8192, 16 layers, 32 attention
heads over 8 KV heads of 64, rope_theta 500000, RMS-norm eps 1e-5, tied
embeddings (no `output.weight`: the logits reuse `token_embd.weight`). The
vocabulary and tokenizer are SmolLM2's (49152 tokens), copied field by field
from the demo GGUF (scripts/fetch-demo-model.sh), so both engines tokenize
alike; with that vocabulary the model has 1.07B parameters (2.1 GB in F16).
Llama 3's long-context RoPE scaling (`rope_freqs`) is left out and the
context length is 8192: decode speed at short contexts does not depend on
either.

Weights are drawn from numpy's PCG64 with a fixed seed (default 47), normal
with std 0.02, in a fixed order, so every run writes the same bytes; norms
are 1.0 (F32, as llama.cpp's converter keeps 1-D tensors). The q and k
projections are permuted as llama.cpp's converter does (`permute_qk` in
scripts/make-fixtures.py), so RoPE pairs are adjacent rows, as in any
converted Llama. llama-quantize makes Q4_0 and Q4_K_M from this file
(bench/decode-1b.sh).

Tensors are generated and written one at a time (the header is laid out
first from their shapes), so memory stays well under a gigabyte; the file is
written under a temporary name and renamed when complete.

Needs numpy and gguf==0.17.1 (as scripts/test.sh installs).
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

HIDDEN = 2048
INTERMEDIATE = 8192
LAYERS = 16
HEADS = 32
KV_HEADS = 8
HEAD_DIM = 64
ROPE_THETA = 500000.0
RMS_EPS = 1e-5
CONTEXT = 8192
STD = 0.02
DEFAULT_OUT = os.path.join(
    os.environ.get("PAGODA_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda"),
    "bench-1b", "model-F16.gguf")


def permute_qk(a, head_dim):
    """llama.cpp's converter reorders q/k rows so RoPE pairs are adjacent
    (the same function as scripts/make-fixtures.py's)."""
    rows, cols = a.shape
    return a.reshape(rows // head_dim, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def tensor_plan(vocab):
    """(name, numpy shape, kind) in file order; kind is "norm", "q", "k" or
    "mat"."""
    plan = [("token_embd.weight", (vocab, HIDDEN), "mat")]
    for i in range(LAYERS):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (HIDDEN,), "norm"),
            (b + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), "q"),
            (b + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "k"),
            (b + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "mat"),
            (b + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), "mat"),
            (b + "ffn_norm.weight", (HIDDEN,), "norm"),
            (b + "ffn_gate.weight", (INTERMEDIATE, HIDDEN), "mat"),
            (b + "ffn_up.weight", (INTERMEDIATE, HIDDEN), "mat"),
            (b + "ffn_down.weight", (HIDDEN, INTERMEDIATE), "mat"),
        ]
    plan.append(("output_norm.weight", (HIDDEN,), "norm"))
    return plan


def draw(rng, shape, kind):
    """One tensor's values: F32 ones for norms, else F16 normals."""
    if kind == "norm":
        return np.ones(shape, dtype=np.float32)
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= STD
    if kind in ("q", "k"):
        a = permute_qk(a, HEAD_DIM)
    return np.ascontiguousarray(a.astype(np.float16))


def copy_tokenizer(w, gguf, path):
    """Every `tokenizer.*` field of `path` (tokens, types, merges, special
    ids, model, pre-tokenizer, chat template, add_bos...), with its type;
    returns the vocabulary size."""
    r = gguf.GGUFReader(path)
    vocab = None
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                # Raw bytes, so nothing is re-encoded on the way.
                val = [bytes(f.parts[i]) for i in f.data]
            else:
                val = [x.item() if hasattr(x, "item") else x for x in f.contents()]
            w.add_key_value(key, val, vtype, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(val)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(f.parts[f.data[0]]), vtype)
        else:
            w.add_key_value(key, f.contents(), vtype)
    if vocab is None:
        sys.exit(f"{path}: no tokenizer.ggml.tokens")
    return vocab


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    ap.add_argument("--tokenizer-from", help="a GGUF whose tokenizer to copy (default: the demo SmolLM2 GGUF)")
    ap.add_argument("--seed", type=int, default=47)
    a = ap.parse_args()
    import gguf

    src = a.tokenizer_from
    if src is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        src = subprocess.run([os.path.join(root, "scripts", "fetch-demo-model.sh")], check=True,
                             capture_output=True, text=True).stdout.strip()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".partial"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"pagoda-bench-1b (random, seed {a.seed})")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    vocab = copy_tokenizer(w, gguf, src)
    w.add_vocab_size(vocab)
    plan = tensor_plan(vocab)
    for name, shape, kind in plan:
        dtype = np.float32 if kind == "norm" else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    params, t0 = 0, time.time()
    for name, shape, kind in plan:
        t = draw(rng, shape, kind)
        w.write_tensor_data(t)
        params += t.size
    w.close()
    os.replace(tmp, a.out)
    print(f"{a.out}: {params / 1e9:.3f}B parameters, vocabulary {vocab} from {src}, "
          f"{os.path.getsize(a.out) / 1e9:.2f} GB, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
