#!/usr/bin/env python3
"""The driver of scripts/gpu-check.sh: checks Pagoda's CUDA backend against
PyTorch and against Pagoda's own CPU backend, then benchmarks it.

Run it through scripts/gpu-check.sh, which finds the Python packages, sets
the environment knobs and kills the servers this leaves behind if it dies.
Every model it uses is made here with random weights (fixed seeds); nothing
is downloaded.

Checks (each can fail; the tolerances are printed with the figures):
  hf/shape        /v1/completions answers with 16 tokens, their logprobs and
                  top-5 maps, finish_reason "length"
  hf/tokens       Pagoda's greedy token is PyTorch's argmax, or within the
                  near-tie margin of it (PyTorch is teacher-forced on
                  Pagoda's own tokens, so every position is compared)
  hf/logprob      |Pagoda's logprob - PyTorch f32's| for the chosen tokens
  hf/top5         top-5 sets at the first generated position share >= 4
  gguf-T/...      the same on Q4_0, Q4_1, Q8_0 and F16 GGUFs, the device
                  against `--device cpu` (tokens equal until a near-tie)
  bench/...       the benchmark runs finish (their figures are reported)
"""

import argparse
import concurrent.futures as cf
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

T0 = time.time()


def log(msg):
    print(f"[gpu-check +{time.time() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------
# Results


class Results:
    def __init__(self, out_dir, meta):
        self.out_dir = out_dir
        self.checks = []
        self.figures = {}
        self.meta = meta
        self.summary_path = os.path.join(out_dir, "summary.txt")
        with open(self.summary_path, "w") as f:
            f.write("")

    def check(self, name, ok, detail, **figures):
        status = "PASS" if ok else "FAIL"
        self.add(name, status, detail, **figures)
        return ok

    def add(self, name, status, detail, **figures):
        rec = {"name": name, "status": status, "detail": detail}
        rec.update(figures)
        self.checks.append(rec)
        line = f"{status:4}  {name:28} {detail}"
        print(line, flush=True)
        with open(self.summary_path, "a") as f:
            f.write(line + "\n")
        self.save()

    def failed(self):
        return [c for c in self.checks if c["status"] == "FAIL"]

    def save(self):
        data = {"meta": self.meta, "elapsed_s": round(time.time() - T0, 1),
                "checks": self.checks, "figures": self.figures}
        with open(os.path.join(self.out_dir, "gpu-check.json"), "w") as f:
            json.dump(data, f, indent=2)
        with open(os.path.join(self.out_dir, "gpu-check.md"), "w") as f:
            f.write(self.markdown())

    def markdown(self):
        m = self.meta
        lines = [f"# gpu-check: {m['device']} ({m.get('gpu', '')})", "",
                 f"Pagoda binary `{m['pagoda']}`, {m['mode']} shapes, "
                 f"{round(time.time() - T0)} s.", "",
                 "| check | result | detail |", "| --- | --- | --- |"]
        for c in self.checks:
            detail = c["detail"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {c['name']} | {c['status']} | {detail} |")
        b = self.figures.get("bench")
        if b:
            lines += ["", f"## Throughput ({b['input_len']} in, {b['output_len']} out, "
                      "output tok/s)", "",
                      "| N | Pagoda | HF transformers | Pagoda / HF |",
                      "| --- | --- | --- | --- |"]
            for n in b["n"]:
                p = b["pagoda"].get(str(n))
                h = b["hf"].get(str(n))
                ratio = f"{p / h:.2f}" if p and h else "-"
                lines.append(f"| {n} | {fmt(p)} | {fmt(h)} | {ratio} |")
            s = b.get("single_stream")
            if s:
                lines += ["", "## Single-stream decode", "",
                          f"Weights read per token: {s['bytes_per_token'] / 1e9:.3f} GB "
                          f"(2 bytes x {s['params_read']:,} parameters, the embedding "
                          f"table excluded); bandwidth {s['bandwidth'] / 1e12:.2f} TB/s; "
                          f"limit {s['limit_tps']:.0f} tok/s.", "",
                          "| engine | decode tok/s | of the bandwidth limit |",
                          "| --- | --- | --- |"]
                for k in ("pagoda", "hf"):
                    v = s.get(k)
                    frac = f"{100 * v / s['limit_tps']:.1f}%" if v else "-"
                    lines.append(f"| {k} | {fmt(v)} | {frac} |")
        return "\n".join(lines) + "\n"


def fmt(v):
    return "-" if v is None else f"{v:.1f}"


# --------------------------------------------------------------------------
# Servers and requests


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_flags(device, threads):
    if device == "cpu":
        return ["--kv-cache-memory", "2GiB", "--threads", str(threads)]
    return ["--gpu-memory-utilization", "0.5"]


class Spawned:
    """A child in its own process group, its pid in the pid file so that the
    shell's EXIT trap can kill it if this process dies."""

    def __init__(self, cmd, log_path, pidfile):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        if pidfile:
            with open(pidfile, "a") as f:
                f.write(f"{self.proc.pid}\n")

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=8)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=5)
        self.log.close()

    def tail(self, n=40):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class Server:
    def __init__(self, a, model, device, tag):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [a.pagoda, "serve", "--model", model, "--device", device,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "m", "--max-model-len", "1024",
               "--shutdown-grace-seconds", "1"] + device_flags(device, a.threads)
        self.tag = tag
        log(f"starting {tag}: {' '.join(cmd)}")
        self.child = Spawned(cmd, os.path.join(a.work, f"server-{tag}.log"), a.pidfile)

    def wait_ready(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.child.proc.poll() is not None:
                raise RuntimeError(f"{self.tag}: the server exited with "
                                   f"{self.child.proc.returncode}:\n{self.child.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health/ready", timeout=5) as r:
                    if r.status == 200:
                        log(f"{self.tag} ready")
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.tag}: not ready after {timeout} s:\n{self.child.tail()}")

    def complete(self, prompt, max_tokens, logprobs, timeout):
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": logprobs, "ignore_eos": True}
        req = urllib.request.Request(self.base + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.tag}: HTTP {e.code}: {e.read()[:500]!r}")

    def complete_all(self, prompts, max_tokens, logprobs, timeout):
        with cf.ThreadPoolExecutor(max_workers=min(64, len(prompts))) as ex:
            futs = [ex.submit(self.complete, p, max_tokens, logprobs, timeout) for p in prompts]
            return [f.result() for f in futs]

    def stop(self):
        self.child.stop()


def serve_and_query(a, model, device, tag, prompts):
    """Starts a server, sends every prompt at once, stops it. Returns the
    response bodies, or raises with the server log's tail."""
    s = Server(a, model, device, tag)
    try:
        s.wait_ready(a.ready_timeout)
        t = time.time()
        out = s.complete_all(prompts, a.max_tokens, a.top_k, a.request_timeout)
        log(f"{tag}: {len(prompts)} requests in {time.time() - t:.1f} s")
        return out
    except Exception as e:
        raise RuntimeError(f"{e}\n--- {tag} log tail ---\n{s.child.tail()}") from None
    finally:
        s.stop()


def check_shape(bodies, n_tokens, k):
    """Returns (ok, why) for the completions bodies' logprobs shape."""
    for i, b in enumerate(bodies):
        try:
            c = b["choices"][0]
            lp = c["logprobs"]
            toks, tlp, top = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
        except (KeyError, IndexError, TypeError) as e:
            return False, f"prompt {i}: no choices[0].logprobs.tokens/token_logprobs/top_logprobs ({e})"
        if not (len(toks) == len(tlp) == len(top) == n_tokens):
            return False, (f"prompt {i}: {len(toks)} tokens, {len(tlp)} logprobs, "
                           f"{len(top)} top maps, wanted {n_tokens}")
        if b.get("usage", {}).get("completion_tokens") != n_tokens:
            return False, f"prompt {i}: usage {b.get('usage')}"
        if c.get("finish_reason") != "length":
            return False, f"prompt {i}: finish_reason {c.get('finish_reason')!r}"
        for j, (t, l, m) in enumerate(zip(toks, tlp, top)):
            if not isinstance(t, str) or not isinstance(l, (int, float)) or not math.isfinite(l) or l > 1e-4:
                return False, f"prompt {i} token {j}: {t!r} logprob {l!r}"
            if not isinstance(m, dict) or len(m) != k:
                return False, f"prompt {i} token {j}: top_logprobs {m!r} has not {k} entries"
            if max(m.values()) < l - 1e-4:
                return False, f"prompt {i} token {j}: greedy token {t!r} ({l}) below its top-{k} {m}"
    return True, f"{len(bodies)} responses x {n_tokens} tokens, top-{k} maps"


# --------------------------------------------------------------------------
# The tokenizer


def build_tokenizer(d, vocab_size, seed):
    """A byte-level BPE trained on generated lower-case text. Its alphabet is
    the 26 letters and the space, so every token decodes to a distinct ASCII
    string: Pagoda's logprobs name tokens by their text, and this keeps the
    text -> id map exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lex = set()
    while len(lex) < 2 * vocab_size:
        lex.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
    lex = sorted(lex)
    rng.shuffle(lex)
    cum, acc = [], 0.0
    for r in range(len(lex)):
        acc += 1.0 / (r + 20) ** 0.7
        cum.append(acc)
    lines = [" ".join(rng.choices(lex, cum_weights=cum, k=16))
             for _ in range(max(4000, vocab_size))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(lines, trainer)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
                   "model_max_length": 4096,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    v = tok.get_vocab_size()
    tokens = [None] * v
    for t, i in vocab.items():
        tokens[i] = t
    for a_t in spec.get("added_tokens", []):
        tokens[a_t["id"]] = a_t["content"]
    if any(t is None for t in tokens):
        raise RuntimeError("the trained vocabulary has holes")
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(v)]
    if len(set(texts)) != v:
        raise RuntimeError("two tokens decode to the same text")
    if tokens[0] != "<s>" or tokens[1] != "</s>":
        raise RuntimeError(f"special tokens are {tokens[:2]}")
    return {"size": v, "tokens": tokens, "merges": merges,
            "text2id": {t: i for i, t in enumerate(texts)}}


# --------------------------------------------------------------------------
# The HF model and its reference


def hf_shape(small):
    if small:
        return dict(hidden=256, layers=4, heads=4, kv=2, inter=512)
    return dict(hidden=2048, layers=16, heads=32, kv=8, inter=8192)


def build_hf(a, d, vocab, torch_dev):
    """A random Llama saved as bf16 safetensors. Every weight is drawn here
    (fan-in scaled normals, norm weights in [0.8, 1.2], lm_head scaled so the
    logits' spread is about a.logit_std nats), not by transformers' init.
    Returns (bf16 model, f32 copy of the same bf16 weights, parameter count)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = hf_shape(a.small)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv"], max_position_embeddings=4096,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      initializer_range=1.0 / math.sqrt(s["hidden"]), hidden_act="silu",
                      bos_token_id=0, eos_token_id=1, attention_bias=False, mlp_bias=False)
    torch.manual_seed(a.seed)
    with torch.device(torch_dev):
        model = LlamaForCausalLM(cfg)
    g = torch.Generator(device=torch_dev).manual_seed(a.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2, generator=g)
            elif name == "lm_head.weight":
                p.normal_(0.0, a.logit_std / math.sqrt(p.shape[1]), generator=g)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=g)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=g)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(d, safe_serialization=True)
    # Pagoda reads the top-level rope_theta; newer transformers may nest it.
    cp = os.path.join(d, "config.json")
    with open(cp) as f:
        c = json.load(f)
    c["rope_theta"] = 500000.0
    c.setdefault("torch_dtype", "bfloat16")
    with open(cp, "w") as f:
        json.dump(c, f, indent=1)
    import copy
    ref = copy.deepcopy(model).float().eval()
    n_params = sum(p.numel() for p in model.parameters())
    return model, ref, n_params, s


def teacher_forced_logprobs(model, seq, torch_dev):
    import torch
    with torch.no_grad():
        ids = torch.tensor([seq], device=torch_dev)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        return torch.log_softmax(logits, dim=-1).cpu()


def make_prompts(rng, vocab, lengths):
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def check_hf(a, R, d, tokd, model, ref, torch_dev):
    import torch
    rng = random.Random(a.seed + 1)
    lengths = [1, 7, 17, 33, 64, 129, 300, 700]
    prompts = make_prompts(rng, tokd["size"], lengths)
    try:
        bodies = serve_and_query(a, d, a.device, "hf-bf16", prompts)
    except Exception as e:
        R.check("hf/serve", False, f"no answers: {str(e)[:2000]}")
        return
    ok, why = check_shape(bodies, a.max_tokens, a.top_k)
    R.check("hf/shape", ok, why)
    if not ok:
        return
    text2id = tokd["text2id"]
    max_err = max_err_bf16 = max_top_err = sum_err = 0.0
    worst = None
    positions = ties = 0
    bad_tokens, bad_top5, unknown = [], [], []
    overlaps = []
    for i, (p, b) in enumerate(zip(prompts, bodies)):
        lp = b["choices"][0]["logprobs"]
        try:
            gen = [text2id[t] for t in lp["tokens"]]
            tops = [{text2id[t]: v for t, v in m.items()} for m in lp["top_logprobs"]]
        except KeyError as e:
            unknown.append(f"prompt {i}: token text {e} is no token of the vocabulary")
            continue
        seq = p + gen
        ref_lp = teacher_forced_logprobs(ref, seq, torch_dev)
        bf_lp = teacher_forced_logprobs(model, seq, torch_dev)
        for j, t in enumerate(gen):
            row = ref_lp[len(p) + j - 1]
            err = abs(lp["token_logprobs"][j] - row[t].item())
            sum_err += err
            if err > max_err:
                max_err, worst = err, (i, j)
            max_err_bf16 = max(max_err_bf16, abs(bf_lp[len(p) + j - 1][t].item() - row[t].item()))
            positions += 1
            am = int(torch.argmax(row))
            if am != t:
                gap = row[am].item() - row[t].item()
                if gap < a.near_tie:
                    ties += 1
                else:
                    bad_tokens.append(f"prompt {i} pos {j}: Pagoda {t}, PyTorch {am} "
                                      f"better by {gap:.3f}")
            ref_top = torch.topk(row, a.top_k)
            ref_ids = [int(x) for x in ref_top.indices]
            for tid, v in tops[j].items():
                if tid in ref_ids:
                    max_top_err = max(max_top_err, abs(v - row[tid].item()))
            if j == 0:
                ov = len(set(ref_ids) & set(tops[0]))
                overlaps.append(ov)
                if ov < a.top_k - 1:
                    bad_top5.append(f"prompt {i}: {ov} of {a.top_k} shared "
                                    f"(Pagoda {sorted(tops[0])}, PyTorch {sorted(ref_ids)})")
    if unknown:
        R.check("hf/token-text", False, "; ".join(unknown))
        return
    mean_err = sum_err / max(positions, 1)
    # PyTorch's own bf16 run, against the same f32 reference, is the yardstick:
    # Pagoda may be as far off as 1.5 times it when that exceeds a.tol_bf16.
    tol = max(a.tol_bf16, 1.5 * max_err_bf16)
    R.figures["hf"] = {"positions": positions, "max_logprob_err": max_err,
                       "mean_logprob_err": mean_err, "tolerance": tol,
                       "torch_bf16_max_logprob_err": max_err_bf16,
                       "max_top5_logprob_err": max_top_err, "near_ties": ties,
                       "top5_overlap_first": overlaps, "prompt_lengths": lengths}
    R.check("hf/tokens", not bad_tokens,
            (f"{positions} positions, {ties} near-ties (< {a.near_tie} nats)"
             if not bad_tokens else "; ".join(bad_tokens[:5])))
    R.check("hf/logprob", max_err <= tol,
            f"vs torch f32: max |err| {max_err:.4f} nats at {worst}, mean {mean_err:.4f} "
            f"(tol {tol:.3f} = max({a.tol_bf16}, 1.5 x torch bf16's {max_err_bf16:.4f})); "
            f"top-{a.top_k} values {max_top_err:.4f}",
            max_err=max_err)
    R.check("hf/top5", not bad_top5,
            f"first-position overlaps {overlaps} (need >= {a.top_k - 1})"
            if not bad_top5 else "; ".join(bad_top5[:4]))


# --------------------------------------------------------------------------
# GGUF models


def gguf_shape(small):
    if small:
        return dict(hidden=256, layers=2, heads=4, kv=2, inter=512)
    return dict(hidden=512, layers=4, heads=8, kv=4, inter=1408)


def permute_qk(w, n_head):
    """llama.cpp's HF->GGUF row order for q/k: within each head, row 2i is
    HF row i and row 2i+1 is HF row i + head_dim/2."""
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def build_ggufs(a, tokd, types):
    import numpy as np
    import gguf

    s = gguf_shape(a.small)
    h, inter, nh, nkv = s["hidden"], s["inter"], s["heads"], s["kv"]
    hd = h // nh
    v = tokd["size"]
    rng = np.random.default_rng(a.seed + 2)

    def lin(rows, cols):
        return rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(math.sqrt(cols))

    def norm():
        return rng.uniform(0.8, 1.2, h).astype(np.float32)

    tensors = [("token_embd.weight", rng.standard_normal((v, h), dtype=np.float32))]
    for L in range(s["layers"]):
        p = f"blk.{L}."
        tensors += [
            (p + "attn_norm.weight", norm()),
            (p + "attn_q.weight", permute_qk(lin(nh * hd, h), nh)),
            (p + "attn_k.weight", permute_qk(lin(nkv * hd, h), nkv)),
            (p + "attn_v.weight", lin(nkv * hd, h)),
            (p + "attn_output.weight", lin(h, nh * hd)),
            (p + "ffn_norm.weight", norm()),
            (p + "ffn_gate.weight", lin(inter, h)),
            (p + "ffn_up.weight", lin(inter, h)),
            (p + "ffn_down.weight", lin(h, inter)),
        ]
    tensors += [("output_norm.weight", norm()),
                ("output.weight", lin(v, h) * np.float32(a.logit_std))]
    Q = gguf.GGMLQuantizationType
    FT = gguf.LlamaFileType
    kinds = {"Q4_0": (Q.Q4_0, FT.MOSTLY_Q4_0), "Q4_1": (Q.Q4_1, FT.MOSTLY_Q4_1),
             "Q8_0": (Q.Q8_0, FT.MOSTLY_Q8_0), "F16": (Q.F16, FT.MOSTLY_F16)}
    paths = {}
    for name in types:
        qt, ft = kinds[name]
        path = os.path.join(a.work, f"rand-{name}.gguf")
        w = gguf.GGUFWriter(path, "llama")
        w.add_name(f"gpu-check-{name}")
        w.add_context_length(4096)
        w.add_embedding_length(h)
        w.add_block_count(s["layers"])
        w.add_feed_forward_length(inter)
        w.add_head_count(nh)
        w.add_head_count_kv(nkv)
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(500000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(v)
        w.add_file_type(ft)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokd["tokens"])
        w.add_token_types([3, 3] + [1] * (v - 2))
        w.add_token_merges(tokd["merges"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(False)
        for tname, arr in tensors:
            if arr.ndim == 1:
                w.add_tensor(tname, arr)
            elif qt == Q.F16:
                w.add_tensor(tname, arr.astype(np.float16))
            else:
                w.add_tensor(tname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths[name] = path
    return paths


def compare_runs(a, dev_bodies, cpu_bodies):
    """The device's answers against the CPU backend's: tokens equal until a
    near-tie, chosen logprobs within a.tol_quant, top-5 overlap at the first
    position. Returns a dict of findings."""
    max_err, compared, ties, bad, overlaps = 0.0, 0, 0, [], []
    for i, (db, cb) in enumerate(zip(dev_bodies, cpu_bodies)):
        dl, cl = db["choices"][0]["logprobs"], cb["choices"][0]["logprobs"]
        ov = len(set(dl["top_logprobs"][0]) & set(cl["top_logprobs"][0]))
        overlaps.append(ov)
        for j, (dt, ct) in enumerate(zip(dl["tokens"], cl["tokens"])):
            dlp, clp = dl["token_logprobs"][j], cl["token_logprobs"][j]
            if dt == ct:
                compared += 1
                max_err = max(max_err, abs(dlp - clp))
                continue
            # Diverged: fine only if each side rates the other's pick nearly as high.
            gap_c = clp - cl["top_logprobs"][j].get(dt, -math.inf)
            gap_d = dlp - dl["top_logprobs"][j].get(ct, -math.inf)
            if max(gap_c, gap_d) < a.near_tie:
                ties += 1
            else:
                bad.append(f"prompt {i} pos {j}: device {dt!r} cpu {ct!r} (gaps {gap_d:.3f}, {gap_c:.3f})")
            break
    return {"max_err": max_err, "compared": compared, "ties": ties, "bad": bad,
            "overlaps": overlaps}


def check_ggufs(a, R, tokd):
    types = ["Q4_0", "Q4_1", "Q8_0", "F16"]
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        R.check("gguf/import", False, f"cannot import gguf ({e}); see the script header")
        return
    t = time.time()
    paths = build_ggufs(a, tokd, types)
    log(f"wrote {len(paths)} GGUFs in {time.time() - t:.1f} s")
    rng = random.Random(a.seed + 3)
    lengths = [rng.randint(1, 200) for _ in range(a.gguf_prompts - 1)] + [600]
    prompts = make_prompts(rng, tokd["size"], lengths)
    R.figures["gguf"] = {}
    for name in types:
        try:
            dev = serve_and_query(a, paths[name], a.device, f"gguf-{name}-{a.device}", prompts)
            cpu = serve_and_query(a, paths[name], "cpu", f"gguf-{name}-cpu", prompts)
        except Exception as e:
            R.check(f"gguf-{name}/serve", False, f"no answers: {str(e)[:2000]}")
            continue
        ok_d, why_d = check_shape(dev, a.max_tokens, a.top_k)
        ok_c, why_c = check_shape(cpu, a.max_tokens, a.top_k)
        if not R.check(f"gguf-{name}/shape", ok_d and ok_c,
                       why_d if not ok_d else (f"cpu: {why_c}" if not ok_c else why_d)):
            continue
        f = compare_runs(a, dev, cpu)
        R.figures["gguf"][name] = {k: v for k, v in f.items() if k != "bad"}
        R.check(f"gguf-{name}/tokens", not f["bad"],
                f"{f['compared']} equal tokens, {f['ties']} near-tie divergences"
                if not f["bad"] else "; ".join(f["bad"][:4]))
        R.check(f"gguf-{name}/logprob", f["max_err"] <= a.tol_quant,
                f"max |device - cpu| {f['max_err']:.4f} nats (tol {a.tol_quant})")
        low = [o for o in f["overlaps"] if o < a.top_k - 1]
        R.check(f"gguf-{name}/top5", not low,
                f"first-position overlaps min {min(f['overlaps'])} of {a.top_k} "
                f"over {len(prompts)} prompts (need >= {a.top_k - 1})")


# --------------------------------------------------------------------------
# Benchmarks


def run_pagoda_bench(a, args, tag, timeout):
    # Never run past the driver's deadline (the shell kills it there).
    timeout = max(20.0, min(timeout, a.deadline - (time.time() - T0)))
    out = os.path.join(a.work, f"bench-{tag}.json")
    cmd = [a.pagoda, "bench"] + args + ["--result-json", out]
    log(f"{tag}: {' '.join(cmd)}")
    child = Spawned(cmd, os.path.join(a.work, f"bench-{tag}.log"), a.pidfile)
    try:
        rc = child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.stop()
        raise RuntimeError(f"timed out after {timeout} s:\n{child.tail(20)}")
    child.stop()
    if rc != 0 or not os.path.exists(out):
        raise RuntimeError(f"exit {rc}:\n{child.tail(20)}")
    with open(out) as f:
        return json.load(f)


def hf_generate_tps(model, vocab, n, in_len, out_len, torch_dev, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, in_len), generator=g).to(torch_dev)
    mask = torch.ones_like(ids)
    sync = torch.cuda.synchronize if torch_dev.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        sync()
        t = time.time()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        sync()
        dt = time.time() - t
    made = (out.shape[1] - in_len) * n
    return made / dt


def bench(a, R, d, model, n_params, shape, vocab, torch_dev):
    ns, in_len, out_len = a.bench_n, a.bench_in, a.bench_out
    b = {"n": ns, "input_len": in_len, "output_len": out_len, "pagoda": {}, "hf": {}}
    R.figures["bench"] = b
    common = ["--model", d, "--device", a.device, "--max-model-len", "1024"] + \
        device_flags(a.device, a.threads)
    for n in ns:
        if time.time() - T0 > a.budget:
            R.add(f"bench/pagoda-n{n}", "SKIP", f"over the time budget of {a.budget} s")
            continue
        try:
            r = run_pagoda_bench(a, ["throughput"] + common + [
                "--dataset", "random", "--input-len", str(in_len), "--output-len", str(out_len),
                "--num-prompts", str(n), "--max-num-seqs", str(n)], f"throughput-{n}", a.bench_timeout)
            tps = r["output_tokens_per_second"]
            b["pagoda"][str(n)] = tps
            R.check(f"bench/pagoda-n{n}", r.get("total_output_tokens") == n * out_len,
                    f"{tps:.1f} output tok/s ({r.get('total_output_tokens')} tokens in "
                    f"{r.get('elapsed_time', 0):.2f} s)")
        except Exception as e:
            R.check(f"bench/pagoda-n{n}", False, str(e)[:1500])
        R.save()
    single = {}
    if time.time() - T0 <= a.budget:
        try:
            r = run_pagoda_bench(a, ["latency"] + common + [
                "--input-len", str(in_len), "--output-len", str(out_len), "--num-iters", "3"],
                "latency", a.bench_timeout)
            single["pagoda"] = r["decode_tokens_per_second"]
            R.check("bench/pagoda-latency", single["pagoda"] > 0,
                    f"decode {single['pagoda']:.1f} tok/s, prompt "
                    f"{r['prompt_tokens_per_second']:.1f} tok/s")
        except Exception as e:
            R.check("bench/pagoda-latency", False, str(e)[:1500])
    else:
        R.add("bench/pagoda-latency", "SKIP", f"over the time budget of {a.budget} s")
    # HF transformers on the same device (equal-length prompts, so no padding).
    hf_model = model
    if torch_dev == "cpu":
        import copy
        hf_model = copy.deepcopy(model).float()  # bf16 matmuls are slow on CPUs
    try:
        hf_generate_tps(hf_model, vocab, 1, 8, 4, torch_dev, a.seed)  # warm-up
        for n in ns:
            if time.time() - T0 > a.budget:
                R.add(f"bench/hf-n{n}", "SKIP", f"over the time budget of {a.budget} s")
                continue
            tps = hf_generate_tps(hf_model, vocab, n, in_len, out_len, torch_dev, a.seed + n)
            b["hf"][str(n)] = tps
            R.add(f"bench/hf-n{n}", "INFO", f"{tps:.1f} output tok/s (transformers generate)")
    except Exception as e:
        R.add("bench/hf", "INFO", f"transformers generate failed: {str(e)[:500]}")
    if "1" in b["hf"]:
        single["hf"] = b["hf"]["1"]
    params_read = n_params - vocab * shape["hidden"]
    single.update(params_read=params_read, bytes_per_token=2 * params_read,
                  bandwidth=a.bw, limit_tps=a.bw / (2 * params_read))
    b["single_stream"] = single
    if "pagoda" in single:
        R.add("bench/bandwidth", "INFO",
              f"Pagoda single-stream decode {single['pagoda']:.1f} tok/s = "
              f"{100 * single['pagoda'] / single['limit_tps']:.1f}% of {single['limit_tps']:.0f} "
              f"tok/s ({a.bw:.3g} B/s / {2 * params_read / 1e9:.3f} GB)")
    for n in ns:
        p, h = b["pagoda"].get(str(n)), b["hf"].get(str(n))
        if p and h:
            R.add(f"bench/ratio-n{n}", "INFO", f"Pagoda / HF = {p / h:.2f} ({p:.1f} vs {h:.1f} tok/s)")


# --------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pagoda", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--pidfile", default="")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--near-tie", type=float, default=0.3)
    ap.add_argument("--tol-bf16", type=float, default=0.15)
    ap.add_argument("--tol-quant", type=float, default=0.1)
    ap.add_argument("--gguf-prompts", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=180)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--bench-timeout", type=float, default=150)
    ap.add_argument("--bench-n", default="")
    ap.add_argument("--bench-in", type=int, default=0)
    ap.add_argument("--bench-out", type=int, default=0)
    ap.add_argument("--bw", type=float, default=4.8e12)
    ap.add_argument("--budget", type=float, default=330,
                    help="seconds after which the remaining benchmarks are skipped")
    ap.add_argument("--deadline", type=float, default=400,
                    help="seconds by which every benchmark run must have ended")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    cpu_run = a.device == "cpu"
    if cpu_run:
        a.small = True
    a.vocab = a.vocab or (4096 if a.small else 32000)
    a.gguf_prompts = a.gguf_prompts or (8 if cpu_run else 40)
    a.bench_n = [int(x) for x in (a.bench_n or ("1 4" if cpu_run else "1 64 256")).split()]
    a.bench_in = a.bench_in or (32 if cpu_run else 128)
    a.bench_out = a.bench_out or (16 if cpu_run else 128)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)

    import torch
    torch_dev = "cpu" if cpu_run else ("cuda" if a.device == "cuda" else a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda_ok = torch_dev == "cuda" and torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda_ok else "CPU"
    R = Results(a.out, {"device": a.device, "gpu": gpu, "pagoda": a.pagoda,
                        "mode": "small" if a.small else "full",
                        "torch": torch.__version__, "near_tie": a.near_tie,
                        "tol_bf16": a.tol_bf16, "tol_quant": a.tol_quant})
    log(f"device {a.device} ({gpu}), torch {torch.__version__}, out {a.out}")
    if torch_dev == "cuda" and not cuda_ok:
        R.check("setup/torch-cuda", False, "PyTorch sees no CUDA device")
        return 1

    t = time.time()
    tokd = build_tokenizer(os.path.join(a.work, "hf"), a.vocab, a.seed)
    log(f"tokenizer: {tokd['size']} tokens, {len(tokd['merges'])} merges in {time.time() - t:.1f} s")
    hf_dir = os.path.join(a.work, "hf")
    t = time.time()
    model, ref, n_params, shape = build_hf(a, hf_dir, tokd["size"], torch_dev)
    log(f"HF model: {n_params / 1e6:.1f} M parameters, saved in {time.time() - t:.1f} s")
    if torch_dev == "cuda":
        torch.cuda.empty_cache()

    for step in (lambda: check_hf(a, R, hf_dir, tokd, model, ref, torch_dev),
                 lambda: check_ggufs(a, R, tokd)):
        try:
            step()
        except Exception as e:
            import traceback
            traceback.print_exc()
            R.check("driver", False, f"{type(e).__name__}: {str(e)[:1500]}")
    del ref
    if torch_dev == "cuda":
        torch.cuda.empty_cache()
    if a.skip_bench:
        R.add("bench", "SKIP", "GPU_CHECK_SKIP_BENCH=1")
    else:
        try:
            bench(a, R, hf_dir, model, n_params, shape, tokd["size"], torch_dev)
        except Exception as e:
            R.check("bench/driver", False, f"{type(e).__name__}: {str(e)[:1500]}")
    R.save()
    bad = R.failed()
    n_pass = sum(c["status"] == "PASS" for c in R.checks)
    print(f"\n== summary ({a.device}, {round(time.time() - T0)} s) ==")
    for c in R.checks:
        print(f"{c['status']:4}  {c['name']:28} {c['detail'][:200]}")
    print(f"gpu-check: {n_pass} passed, {len(bad)} failed")
    print(f"figures: {os.path.join(a.out, 'gpu-check.md')}, {os.path.join(a.out, 'gpu-check.json')}")
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # a bug or a broken environment, not a verdict
        import traceback
        traceback.print_exc()
        print(f"FAIL  driver                       {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
