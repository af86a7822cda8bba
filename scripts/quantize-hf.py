#!/usr/bin/env python3
"""Quantizes a float Hugging Face Llama/Qwen2 folder into the checkpoint
formats Pagoda loads, packed exactly as the reference packers pack them.

    scripts/quantize-hf.py --method gptq --bits 4 --group-size 32 \
        [--desc-act] [--asym] [--ignore PREFIX]... SRC DST [--reference REF]

Methods and the packer each one follows (round-to-nearest, no calibration
data: the layout is what matters here, not the accuracy of GPTQ's solver):

  gptq            AutoGPTQ / GPTQModel `pack`: qweight I32 [in*b/32, out]
                  packed along the input, qzeros I32 [groups, out*b/32]
                  holding zero - 1 (checkpoint_format "gptq"), scales F16
                  [groups, out], g_idx I32 [in]. --desc-act quantizes the
                  columns in a (seeded, random) activation order, so g_idx
                  is a scattered permutation of the groups.
  awq             AutoAWQ GEMM `pack`: qweight I32 [in, out/8] packed along
                  the output in the nibble order [0, 2, 4, 6, 1, 3, 5, 7],
                  qzeros I32 [groups, out/8] likewise, scales F16
                  [groups, out]; always asymmetric.
  ct-w8a8         llm-compressor `int-quantized`: weight I8 [out, in],
                  weight_scale [out, 1]; --static-input adds a per-tensor
                  input_scale, else activations are dynamic per token.
  ct-w4a16        llm-compressor `pack-quantized`: weight_packed I32
                  [out, in/8] (codes + 8, low nibble first), weight_scale
                  [out, in/group], weight_shape I64 [2]; --asym adds
                  weight_zero_point.
  modelslim-w8a8  msModelSlim W8A8 (static): weight I8, input_scale,
                  input_offset, deq_scale, quant_bias (the float bias and the
                  offset's correction folded in), quant_model_description.json.
  modelslim-w8a8-dynamic
                  msModelSlim W8A8_DYNAMIC: weight I8, weight_scale and
                  weight_offset [out, 1].

Layers named by --ignore (module prefixes, e.g. model.layers.0.mlp.down_proj)
stay dense, marked as each format marks them (GPTQModel's `dynamic` "-:"
rule, AWQ's modules_to_not_convert, compressed-tensors' ignore, ModelSlim's
FLOAT), as do the embeddings, norms and LM head.

--reference REF writes, for every quantized layer, `{prefix}.weight`: the
numpy dequantization of the files just written, as f32, [out, in] in the
original column order:

  - int8 codes, symmetric int4 and per-channel schemes: scale * (q - zero),
    exactly (every such product is representable in f32);
  - asymmetric int4 (GPTQ --asym, AWQ, ct-w4a16 --asym): scale * q +
    f16(-zero * scale). This is the one deliberate rounding: the zero point
    is folded into an f16 offset, as vLLM's GPTQ and AWQ GPU kernels fold
    it, so that the weights stay 4-bit (GGUF's Q4_1 blocks) in Pagoda;
  - ModelSlim static W8A8: q * f32(deq_scale / input_scale), the weights in
    the units of a float input (the input itself is rounded onto the grid).

and, for layers with static input quantization, `{prefix}.input_scale` and
`{prefix}.input_offset` (the grid), and `{prefix}.bias` when the layer's
bias was folded into an integer bias (the bias as the files now hold it).

Only numpy is needed: safetensors files are read and written here directly.
"""

import argparse
import json
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "I8": np.int8,
    "I32": np.int32,
    "I64": np.int64,
}


def read_safetensors(path):
    """Returns {name: array} (BF16 widened to f32) and the dtype names."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out, dtypes = {}, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        s, e = meta["data_offsets"]
        buf = raw[base + s : base + e]
        dt = meta["dtype"]
        if dt == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(DTYPES[dt]).newbyteorder("<"))
        out[name] = arr.reshape(meta["shape"]).copy()
        dtypes[name] = dt
    return out, dtypes


class Bf16:
    """An f32 array to be stored as BF16 (its values must be bf16-exact, as
    a bf16 checkpoint's are once widened)."""

    def __init__(self, arr):
        self.arr = np.ascontiguousarray(arr, dtype=np.float32)


def write_safetensors(path, tensors):
    """Writes {name: array or Bf16} (f32, f16, i8, i32, i64, bf16) as a
    safetensors file."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if isinstance(t, Bf16):
            arr, dt = t.arr, "BF16"
            data = (arr.view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            arr = np.ascontiguousarray(t)
            dt = names[arr.dtype]
            data = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": dt,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def f16(x):
    """x rounded to f16 and widened back to f32 (what an F16 file holds)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def pack_along_rows(codes, bits):
    """[R, C] unsigned codes -> I32 [R * bits / 32, C]: word (r, c) holds
    rows r*per + j at bits j*bits (AutoGPTQ's qweight)."""
    per = 32 // bits
    c = codes.astype(np.uint32).reshape(codes.shape[0] // per, per, codes.shape[1])
    words = np.zeros((c.shape[0], c.shape[2]), dtype=np.uint32)
    for j in range(per):
        words |= c[:, j, :] << np.uint32(bits * j)
    return words.view(np.int32)


def pack_along_cols(codes, bits, order=None):
    """[R, C] unsigned codes -> I32 [R, C * bits / 32]: field i of word
    (r, w) holds column w*per + order[i] (low bits first)."""
    per = 32 // bits
    order = order or list(range(per))
    c = codes.astype(np.uint32).reshape(codes.shape[0], codes.shape[1] // per, per)
    words = np.zeros(c.shape[:2], dtype=np.uint32)
    for i, o in enumerate(order):
        words |= c[:, :, o] << np.uint32(bits * i)
    return words.view(np.int32)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def gptq_params(w, bits, sym):
    """AutoGPTQ's Quantizer.find_params on rows of w: scale, zero (ints)."""
    maxq = 2**bits - 1
    xmin = np.minimum(w.min(axis=1), 0)
    xmax = np.maximum(w.max(axis=1), 0)
    if sym:
        xmax = np.maximum(np.abs(xmin), xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin, xmax = np.where(both0, -1, xmin), np.where(both0, 1, xmax)
    scale = (xmax - xmin) / maxq
    if sym:
        zero = np.full_like(scale, (maxq + 1) // 2)
    else:
        zero = np.round(-xmin / scale)
    return scale.astype(np.float32), zero.astype(np.int64)


def dequant_int(scale, q, zero, bits, asym_fold):
    """The reference dequantization (see the module docs)."""
    scale = scale.astype(np.float32)
    if asym_fold and bits == 4:
        m = f16(-zero.astype(np.float32) * scale)
        return scale * q.astype(np.float32) + m
    return scale * (q.astype(np.int64) - zero).astype(np.float32)


def is_quantized_layer(name, ignore):
    """Decoder-layer linear weights not named by --ignore."""
    if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
        return False
    prefix = name[: -len(".weight")]
    return not any(prefix == p or prefix.startswith(p + ".") for p in ignore)


def quantize_gptq(w, a, rng):
    """w: [out, in] f32 -> GPTQ tensors and the reference weight."""
    out_f, in_f = w.shape
    bits, maxq = a.bits, 2**a.bits - 1
    group = in_f if a.group_size == -1 else a.group_size
    perm = np.argsort(-rng.random(in_f)) if a.desc_act else np.arange(in_f)
    g_idx = np.empty(in_f, dtype=np.int32)
    g_idx[perm] = np.arange(in_f) // group
    groups = in_f // group
    scales = np.empty((groups, out_f), dtype=np.float32)
    zeros = np.empty((groups, out_f), dtype=np.int64)
    for g in range(groups):
        cols = perm[g * group : (g + 1) * group]
        s, z = gptq_params(w[:, cols], bits, not a.asym)
        scales[g], zeros[g] = f16(s), z
    s_k, z_k = scales[g_idx].T, zeros[g_idx].T  # [out, in]
    q = np.clip(np.round(w / s_k + z_k), 0, maxq).astype(np.int64)
    # v1 ("gptq") checkpoints store zero - 1, wrapping within the field;
    # readers add the 1 back (so a zero of 0 reads as 2^bits, as it does
    # in every GPTQ v1 loader).
    stored = (zeros - 1) & maxq
    tensors = {
        "qweight": pack_along_rows(q.T, bits),
        "qzeros": pack_along_cols(stored, bits),
        "scales": scales.astype(np.float16),
        "g_idx": g_idx,
    }
    ref = dequant_int(s_k, q, (stored + 1)[g_idx].T, bits, a.asym)
    return tensors, ref, {}


def quantize_awq(w, a, rng):
    """AutoAWQ's pseudo_quantize_tensor (zero_point=True) and GEMM pack."""
    out_f, in_f = w.shape
    g = a.group_size
    wg = w.reshape(out_f, in_f // g, g)
    mx, mn = wg.max(axis=2), wg.min(axis=2)
    scales = f16(np.maximum(mx - mn, 1e-5) / 15)  # [out, groups]
    zeros = np.clip(-np.round(mn / scales), 0, 15).astype(np.int64)
    s_k = np.repeat(scales, g, axis=1)
    z_k = np.repeat(zeros, g, axis=1)
    q = np.clip(np.round(w / s_k) + z_k, 0, 15).astype(np.int64)
    tensors = {
        "qweight": pack_along_cols(q.T, 4, AWQ_ORDER),
        "qzeros": pack_along_cols(zeros.T, 4, AWQ_ORDER),
        "scales": scales.T.astype(np.float16),
    }
    return tensors, dequant_int(s_k, q, z_k, 4, True), {}


def static_grid(prefix):
    """A fixed static input grid per layer kind (no calibration data): wide
    enough for the tiny models' activations, which are RMS-normed (q, k, v,
    gate, up), attention averages (o) or SiLU products (down)."""
    kind = prefix.rsplit(".", 1)[-1]
    bound = {"down_proj": 16.0, "o_proj": 8.0}.get(kind, 6.0)
    return np.float32(bound / 127)


def quantize_ct_w8a8(w, a, rng, prefix):
    scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-8) / 127
    scale = scale.astype(np.float32)
    q = np.clip(np.round(w / scale), -128, 127).astype(np.int8)
    tensors = {"weight": q, "weight_scale": scale}
    extra = {}
    if a.static_input:
        s = static_grid(prefix)
        tensors["input_scale"] = np.array([s], dtype=np.float32)
        extra = {"input_scale": np.array([s], np.float32), "input_offset": np.array([0], np.float32)}
    ref = scale * q.astype(np.float32)
    return tensors, ref, extra


def quantize_ct_w4a16(w, a, rng):
    out_f, in_f = w.shape
    g = a.group_size
    wg = w.reshape(out_f, in_f // g, g)
    qmin, qmax = -8, 7
    if a.asym:
        mn = np.minimum(wg.min(axis=2), 0)
        mx = np.maximum(wg.max(axis=2), 0)
        scales = np.maximum(mx - mn, 1e-8) / (qmax - qmin)
        zp = np.clip(qmin - np.round(mn / scales), qmin, qmax).astype(np.int64)
    else:
        scales = np.maximum(np.abs(wg).max(axis=2), 1e-8) / ((qmax - qmin) / 2)
        zp = np.zeros(scales.shape, dtype=np.int64)
    scales = f16(scales)
    s_k, zp_k = np.repeat(scales, g, axis=1), np.repeat(zp, g, axis=1)
    q = np.clip(np.round(w / s_k + zp_k), qmin, qmax).astype(np.int64)
    tensors = {
        "weight_packed": pack_along_cols(q + 8, 4),
        "weight_scale": scales.astype(np.float16),
        "weight_shape": np.array([out_f, in_f], dtype=np.int64),
    }
    if a.asym:
        tensors["weight_zero_point"] = zp.astype(np.int8)
    # In unsigned codes: value = scale * ((q + 8) - (zp + 8)).
    ref = dequant_int(s_k, q + 8, zp_k + 8, 4, a.asym)
    return tensors, ref, {}


def quantize_modelslim(w, a, rng, prefix, bias, dynamic):
    scale = (np.maximum(np.abs(w).max(axis=1), 1e-8) / 127).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -128, 127).astype(np.int8)
    if dynamic:
        tensors = {
            "weight": q,
            "weight_scale": scale[:, None],
            "weight_offset": np.zeros((w.shape[0], 1), dtype=np.float32),
        }
        return tensors, scale[:, None] * q.astype(np.float32), {}, False
    s = static_grid(prefix)
    offset = np.float32(3)  # a non-zero zero point, as asymmetric inputs get
    deq = (s * scale).astype(np.float32)
    b = np.zeros(w.shape[0], dtype=np.float32) if bias is None else bias
    sum_w = q.astype(np.int64).sum(axis=1)
    quant_bias = (np.round(b / deq) - offset * sum_w).astype(np.int32)
    tensors = {
        "weight": q,
        "input_scale": np.array([s], dtype=np.float32),
        "input_offset": np.array([offset], dtype=np.float32),
        "deq_scale": deq,
        "quant_bias": quant_bias,
    }
    ref = q.astype(np.float32) * (deq / s)[:, None]
    held_bias = (deq * (offset * sum_w + quant_bias).astype(np.float32)).astype(np.float32)
    extra = {
        "input_scale": np.array([s], np.float32),
        "input_offset": np.array([offset], np.float32),
        "bias": held_bias,
    }
    return tensors, ref, extra, bias is not None


def quantization_config(a, ignore, linear_prefixes):
    m = a.method
    if m == "gptq":
        cfg = {
            "quant_method": "gptq",
            "bits": a.bits,
            "group_size": a.group_size,
            "desc_act": a.desc_act,
            "sym": not a.asym,
            "checkpoint_format": "gptq",
        }
        if ignore:
            cfg["dynamic"] = {"-:" + re.escape(p) + r"(\.|$)": {} for p in ignore}
        return cfg
    if m == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": a.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ignore or None,
        }
    if m in ("ct-w8a8", "ct-w4a16"):
        if m == "ct-w8a8":
            weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
            acts = {"num_bits": 8, "type": "int", "symmetric": True}
            acts.update(
                {"dynamic": False, "strategy": "tensor"}
                if a.static_input
                else {"dynamic": True, "strategy": "token"}
            )
            fmt = "int-quantized"
        else:
            weights = {
                "num_bits": 4,
                "type": "int",
                "symmetric": not a.asym,
                "strategy": "group",
                "group_size": a.group_size,
                "actorder": None,
            }
            acts, fmt = None, "pack-quantized"
        return {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
            },
            "ignore": ["lm_head"] + ignore,
        }
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--method",
        required=True,
        choices=["gptq", "awq", "ct-w8a8", "ct-w4a16", "modelslim-w8a8", "modelslim-w8a8-dynamic"],
    )
    p.add_argument("--bits", type=int, default=4, help="gptq: 4 or 8")
    p.add_argument("--group-size", type=int, default=128, help="-1: one group per row (gptq)")
    p.add_argument("--desc-act", action="store_true", help="gptq: activation order")
    p.add_argument("--asym", action="store_true", help="gptq, ct-w4a16: asymmetric zeros")
    p.add_argument("--static-input", action="store_true", help="ct-w8a8: static input_scale")
    p.add_argument("--ignore", action="append", default=[], help="a layer prefix to keep dense")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", help="write the numpy dequantization here")
    p.add_argument("src")
    p.add_argument("dst")
    a = p.parse_args()
    if a.method == "gptq" and a.bits not in (4, 8):
        sys.exit("--bits must be 4 or 8 for gptq")

    src, dst = Path(a.src), Path(a.dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        sys.exit(f"{src}: no *.safetensors files")
    weights, dtypes = {}, {}
    for f in files:
        w, d = read_safetensors(f)
        weights.update(w)
        dtypes.update(d)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)

    rng = np.random.default_rng(a.seed)
    out, ref, description = {}, {}, {}
    slim = a.method.startswith("modelslim")
    dynamic = a.method == "modelslim-w8a8-dynamic"
    slim_type = "W8A8_DYNAMIC" if dynamic else "W8A8"
    folded_biases = set()
    # Static W8A8 folds the float bias into quant_bias: decide per layer first.
    for name in sorted(weights):
        arr = weights[name]
        if not is_quantized_layer(name, a.ignore):
            continue
        prefix = name[: -len(".weight")]
        w = arr.astype(np.float32)
        if a.method == "gptq":
            t, r, extra = quantize_gptq(w, a, rng)
        elif a.method == "awq":
            t, r, extra = quantize_awq(w, a, rng)
        elif a.method == "ct-w8a8":
            t, r, extra = quantize_ct_w8a8(w, a, rng, prefix)
        elif a.method == "ct-w4a16":
            t, r, extra = quantize_ct_w4a16(w, a, rng)
        else:
            bias = weights.get(prefix + ".bias")
            t, r, extra, folded = quantize_modelslim(w, a, rng, prefix, bias, dynamic)
            if folded:
                folded_biases.add(prefix + ".bias")
            else:
                extra.pop("bias", None)
        for k, v in t.items():
            out[f"{prefix}.{k}"] = v
        ref[name] = r.astype(np.float32)
        for k, v in extra.items():
            ref[f"{prefix}.{k}"] = np.asarray(v, dtype=np.float32)
        if slim:
            for k in t:
                description[f"{prefix}.{k}"] = slim_type
    for name, arr in weights.items():
        if is_quantized_layer(name, a.ignore) or name in folded_biases:
            continue
        out[name] = {"F16": lambda: arr.astype(np.float16), "BF16": lambda: Bf16(arr)}.get(
            dtypes[name], lambda: arr.astype(np.float32)
        )()
        if slim:
            description[name] = "FLOAT"
    write_safetensors(dst / "model.safetensors", out)

    config = json.loads((src / "config.json").read_text())
    qc = quantization_config(a, a.ignore, None)
    if qc is not None:
        config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if slim:
        description = {"model_quant_type": slim_type, **dict(sorted(description.items()))}
        (dst / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    if a.reference:
        write_safetensors(a.reference, ref)


if __name__ == "__main__":
    main()
