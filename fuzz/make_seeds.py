#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (fuzz/corpus/<target>/).

Seeds are small valid inputs of each parser, so the fuzzer starts from
inputs that reach deep into it: request bodies, admin bodies, a tiny valid
GGUF (a one-layer Llama with a 32-token BPE vocabulary), HF config.json and
safetensors files, and chat conversations. Rerun after changing a format.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def js(v):
    return json.dumps(v)


# --- OpenAI requests ---------------------------------------------------
put("openai_request", "completion", js({"model": "m", "prompt": "Hello", "max_tokens": 16,
    "temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "logprobs": 2, "echo": True, "n": 2,
    "seed": 7, "stream": True, "stream_options": {"include_usage": True}}))
put("openai_request", "tokens", js({"model": "m", "prompt": [[1, 2, 3], [4, 5]],
    "max_tokens": 0, "prompt_logprobs": 3, "logit_bias": {"5": -100}}))
put("openai_request", "chat", js({"model": "m", "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "2"}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
        {"type": "object", "properties": {"a": {"type": "integer"}}}}}}))
put("openai_request", "tools", js({"model": "m", "messages": [{"role": "user", "content": "x"}],
    "tools": [{"type": "function", "function": {"name": "get", "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "tool_choice": "required", "structured_outputs": {"regex": "[a-z]+"}}))
put("openai_request", "tool-output", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    ' [TOOL_CALLS][{"name": "g", "arguments": {}}] [f(a=1, b="x")] <|python_tag|>{"name": "h", "parameters": {}}')

# --- Admin API -----------------------------------------------------------
put("admin_tenant", "full", js({"api_keys": ["sk-acme-1234"], "models": ["smol"],
    "limits": {"max_concurrent": 16, "tokens_per_minute": 100000},
    "scheduling": {"weight": 3, "priority_class": -1},
    "plugins": ["router", {"name": "redact", "policies": {"on-chunk": "fail_open"}}],
    "plugin_limits": {"timeout_ms": 100, "chunk_timeout_ms": 100,
        "memory_bytes": 67108864, "max_output_bytes": 1048576}}))
put("admin_tenant", "name", "acme-1.prod_x")

# --- GGUF ------------------------------------------------------------------
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, ty, payload):
    return gstr(key) + struct.pack("<I", ty) + payload


U32, I32, F32, STR, ARR = 4, 5, 6, 8, 9
tokens = ["<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("a") + 26)] + ["Ġ", "Ġa", "ab", "ba"]
meta = [
    kv("general.architecture", STR, gstr("llama")),
    kv("llama.context_length", U32, struct.pack("<I", 64)),
    kv("llama.embedding_length", U32, struct.pack("<I", 8)),
    kv("llama.block_count", U32, struct.pack("<I", 1)),
    kv("llama.feed_forward_length", U32, struct.pack("<I", 16)),
    kv("llama.attention.head_count", U32, struct.pack("<I", 2)),
    kv("llama.attention.head_count_kv", U32, struct.pack("<I", 1)),
    kv("llama.rope.dimension_count", U32, struct.pack("<I", 4)),
    kv("llama.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", 1e-5)),
    kv("tokenizer.ggml.model", STR, gstr("gpt2")),
    kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, len(tokens)) + b"".join(gstr(t) for t in tokens)),
    kv("tokenizer.ggml.token_type", ARR, struct.pack("<IQ", I32, len(tokens))
       + b"".join(struct.pack("<i", 3 if i < 2 else 1) for i in range(len(tokens)))),
    kv("tokenizer.ggml.merges", ARR, struct.pack("<IQ", STR, 2) + gstr("Ġ a") + gstr("a b")),
    kv("tokenizer.ggml.bos_token_id", U32, struct.pack("<I", 0)),
    kv("tokenizer.ggml.eos_token_id", U32, struct.pack("<I", 1)),
]
V = len(tokens)
shapes = [("token_embd.weight", [8, V]), ("blk.0.attn_norm.weight", [8]),
          ("blk.0.attn_q.weight", [8, 8]), ("blk.0.attn_k.weight", [8, 4]),
          ("blk.0.attn_v.weight", [8, 4]), ("blk.0.attn_output.weight", [8, 8]),
          ("blk.0.ffn_norm.weight", [8]), ("blk.0.ffn_gate.weight", [8, 16]),
          ("blk.0.ffn_up.weight", [8, 16]), ("blk.0.ffn_down.weight", [16, 8]),
          ("output_norm.weight", [8])]
infos, data, off = b"", b"", 0
for name, dims in shapes:
    n = 1
    for d in dims:
        n *= d
    infos += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
    infos += struct.pack("<IQ", 0, off)
    blob = struct.pack(f"<{n}f", *[((i * 37) % 11 - 5) / 10 for i in range(n)])
    blob += b"\0" * ((-len(blob)) % 32)
    data += blob
    off += len(blob)
head = b"GGUF" + struct.pack("<IQQ", 3, len(shapes), len(meta)) + b"".join(meta) + infos
head += b"\0" * ((-len(head)) % 32)
put("gguf", "tiny-llama.gguf", head + data)

# --- HF folder files -------------------------------------------------------
put("hf_model", "config", b"\0" + js({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}).encode())
header = js({"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
             "__metadata__": {"format": "pt"}}).encode()
put("hf_model", "safetensors", b"\1" + struct.pack("<Q", len(header)) + header + b"\0" * 16)
put("hf_model", "index", b"\2" + js({"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}).encode())

# --- Chat templates --------------------------------------------------------
conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_end|>"},
        {"role": "assistant", "content": "hello", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "user", "content": [{"type": "text", "text": "again"}]}]
put("chat_template", "chatml", b"\x80" + js(conv).encode())
put("chat_template", "llama3-tools", b"\x81" + js({"messages": conv, "tools": [{"name": "f"}]}).encode())
