#!/usr/bin/env python3
"""Writes a BERT-base-shaped sentence-transformers model with random weights
for the embedding throughput benchmark (bench/embed.sh), and the texts it
embeds. Nothing here is committed: the output goes under a cache folder.

    python3 scripts/make-bert-bench.py OUT_DIR [--texts N] [--tokens T]

Needs torch, transformers, tokenizers and sentence-transformers (PyPI); no
Hub access: the WordPiece vocabulary is trained here, with the `tokenizers`
library's WordPieceTrainer, on English prose found on this machine (the
docstrings and comments of Python's standard library, and the text files
under /usr/share/doc), to BERT's 30522 entries where the corpus allows.

OUT_DIR/model/   BertModel (12 layers, hidden 768, 12 heads, intermediate
                 3072, 512 positions, 2 token types, layer_norm_eps 1e-12:
                 bert-base-uncased's shape), float32 safetensors, with
                 sentence-transformers' modules.json, mean pooling and
                 Normalize (all-mpnet / all-MiniLM's pipeline), and a
                 BertTokenizerFast (lower-casing, [CLS] A [SEP]).
OUT_DIR/model-bf16/  the same weights rounded to bfloat16 (torch_dtype
                 bfloat16 in config.json), for a bf16-weights comparison
                 that both sides run in bf16.
OUT_DIR/texts.json   N texts (default 512) of T tokens (default 128,
                 [CLS] and [SEP] included) each within T-16..T, from a
                 fixed seed: runs of the corpus' prose lines.
"""

import argparse
import glob
import json
import os
import random
import re
import sys

import torch

SEED = 45


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def prose_lines():
    """English-looking lines: comment and docstring lines of the standard
    library and the lines of /usr/share/doc's plain text files."""
    import sysconfig
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"),
                             recursive=True))
    files += sorted(p for p in glob.glob("/usr/share/doc/**/*", recursive=True)
                    if os.path.isfile(p) and not p.endswith((".gz", ".html", ".png", ".svg")))
    word = re.compile(r"^[A-Za-z][A-Za-z'\-]*[,.;:?!]?$")
    out = []
    for p in files:
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        for line in text.splitlines():
            s = line.strip().lstrip("#").strip()
            ws = s.split()
            # Mostly words, a few of them: prose rather than code.
            if len(ws) >= 5 and sum(bool(word.match(w)) for w in ws) >= 0.8 * len(ws):
                out.append(s)
    if len(out) < 10000:
        sys.exit(f"only {len(out)} prose lines found: too little to train a vocabulary")
    return out


def tokenizer(lines, d):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, decoders, trainers
    from transformers import BertTokenizerFast
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=30522, special_tokens=special,
                                        continuing_subword_prefix="##")
    tok.train_from_iterator(lines, trainer=trainer)
    ids = tok.get_vocab()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                             pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                             model_max_length=512)
    fast.save_pretrained(d)
    return fast, tok.get_vocab_size()


def st_files(d, dim):
    write_json(os.path.join(d, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(os.path.join(d, "sentence_bert_config.json"),
               {"max_seq_length": 512, "do_lower_case": False})
    os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
    write_json(os.path.join(d, "1_Pooling", "config.json"), {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    })
    os.makedirs(os.path.join(d, "2_Normalize"), exist_ok=True)


def texts(lines, tok, n, tokens):
    """n texts of tokens-16..tokens tokens: runs of consecutive corpus lines
    from random starting points, cut at a word boundary."""
    rng = random.Random(SEED)
    out = []
    while len(out) < n:
        i = rng.randrange(len(lines) - 64)
        target = rng.randint(tokens - 16, tokens)
        words = " ".join(lines[i:i + 64]).split()
        lo, hi = 1, len(words)
        # The longest prefix of words within target tokens.
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tok(" ".join(words[:mid]))["input_ids"]) <= target:
                lo = mid
            else:
                hi = mid - 1
        t = " ".join(words[:lo])
        if len(tok(t)["input_ids"]) >= tokens - 16:
            out.append(t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    from transformers import BertConfig, BertModel

    d = os.path.join(a.out, "model")
    os.makedirs(d, exist_ok=True)
    lines = prose_lines()
    tok, vocab = tokenizer(lines, d)
    print(f"{len(lines)} prose lines, vocabulary of {vocab}", file=sys.stderr)
    config = BertConfig(
        vocab_size=vocab, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512,
        type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0)
    torch.manual_seed(SEED)
    # transformers' own initialisation (normal, std 0.02), with LayerNorm
    # weights and biases moved off 1 and 0 so that they count.
    model = BertModel(config, add_pooling_layer=False).float().eval()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(d, safe_serialization=True)
    st_files(d, 768)

    d16 = os.path.join(a.out, "model-bf16")
    os.makedirs(d16, exist_ok=True)
    tok.save_pretrained(d16)
    model.to(torch.bfloat16).save_pretrained(d16, safe_serialization=True)
    st_files(d16, 768)

    ts = texts(lines, tok, a.texts, a.tokens)
    n_tok = [len(tok(t)["input_ids"]) for t in ts]
    write_json(os.path.join(a.out, "texts.json"), ts)
    print(f"{len(ts)} texts, {sum(n_tok)} tokens ({min(n_tok)}..{max(n_tok)} each)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
