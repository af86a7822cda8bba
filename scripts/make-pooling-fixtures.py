#!/usr/bin/env python3
"""Writes tiny random-weight pooling models (embedding and reranking), saved
by transformers and sentence-transformers themselves, with their float32
outputs as the reference Pagoda's pooling runner is compared with.

    python3 scripts/make-pooling-fixtures.py OUT_DIR   (tests/fixtures/pooling)

Needs torch, transformers, tokenizers and sentence-transformers (PyPI).

OUT_DIR/<model>/ gets what the Hub holds for such a model, and reference.json:

  qwen3-embed   Qwen3-Embedding's form: a Qwen3 decoder saved from
                `Qwen3Model` (tensor names without the `model.` prefix), a
                tokenizer that appends <|endoftext|>, and sentence-transformers'
                modules.json with last-token pooling and Normalize.
  bert-embed    a sentence-transformers BERT encoder (`BertModel`): mean
                pooling (1_Pooling/config.json) and 2_Normalize, a WordPiece
                tokenizer, layer_norm_eps 1e-7 and 3 token types.
  xlmr-embed    `XLMRobertaModel` (BGE-M3's and multilingual E5's form):
                positions offset by padding_idx + 1, one token type, a
                Unigram tokenizer, CLS pooling and Normalize.
  bert-rerank   a cross-encoder (`BertForSequenceClassification`,
                num_labels 1), scored as sentence-transformers' CrossEncoder
                scores pairs (sigmoid of the logit).
  xlmr-rerank   `XLMRobertaForSequenceClassification`, num_labels 1 (the
                bge-reranker form: classifier.dense, tanh, out_proj).
  qwen3-rerank  the Qwen3-Reranker form: a causal Qwen3 whose pair score is
                P(yes) of the softmax over the "no" and "yes" logits at
                the last token: {"query", "documents", "token_ids",
                "no_yes_ids", "no_yes_logits", "scores"}.
  modernbert-embed  `ModernBertModel` saved by sentence-transformers: a
                byte-level BPE tokenizer, rotary positions with separate
                bases for global and local layers, local layers attending
                8 tokens around each, GeGLU, mean pooling and Normalize; a
                fifth input longer than the local window.
  modernbert-rerank `ModernBertForSequenceClassification`, num_labels 1,
                classifier_pooling mean: CrossEncoder's scores and
                transformers' logits, as bert-rerank's reference.
  bert-classify `BertForSequenceClassification`, num_labels 3 with id2label:
                {"inputs": [{"text", "token_ids", "logits", "probs",
                "label"}]} (softmax of transformers' logits).

reference.json:
  embed models: {"inputs": [{"text", "token_ids", "embedding"}...],
                 "dimensions": {"<n>": [[...]]} (the first n components,
                 renormalized, as Matryoshka truncation asks)}
  rerank model: {"query", "documents", "token_ids" (per pair),
                 "logits", "scores" (sigmoid)}

Every config sets values away from the defaults (rope_theta, eps, head_dim,
token types) so that a key ignored by the loader shows in the numbers.
"""

import json
import os
import sys

import torch

SEED = 45
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "Pagoda serves embeddings",
    "what is the capital of france?",
    "a",
]
QUERY = "what is the capital of france?"
DOCS = [
    "paris is the capital of france",
    "the quick brown fox jumps over the lazy dog",
    "france is a country in europe and its capital is paris",
]


def here(*p):
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), *p)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def scale_weights(model, std):
    """Random weights of a scale that keeps activations near unit size over
    two layers, so the outputs are not dominated by one component."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------------------
# Qwen3-Embedding form
# ---------------------------------------------------------------------------

def qwen3_embed(out):
    from sentence_transformers import SentenceTransformer
    from transformers import Qwen3Config, Qwen3Model, PreTrainedTokenizerFast

    d = os.path.join(out, "qwen3-embed")
    os.makedirs(d, exist_ok=True)
    # The hf-families tokenizer, with Qwen3-Embedding's post-processor: the
    # model pools the hidden state of the <|endoftext|> appended to every
    # input.
    src = here("..", "tests", "fixtures", "hf-families", "qwen3", "tokenizer.json")
    with open(src) as f:
        tok = json.load(f)
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}},
                 {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                             "tokens": ["<|endoftext|>"]}},
    }
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(d, "tokenizer.json"),
        eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        model_max_length=256, padding_side="left")
    tokenizer.save_pretrained(d)

    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=50000.0, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=0, bos_token_id=None,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(SEED)
    model = Qwen3Model(config).float().eval()
    scale_weights(model, 0.08)
    model.save_pretrained(d, safe_serialization=True)

    write_json(os.path.join(d, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(os.path.join(d, "sentence_bert_config.json"),
               {"max_seq_length": 256, "do_lower_case": False})
    os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
    write_json(os.path.join(d, "1_Pooling", "config.json"), pooling_config(64, "lasttoken"))
    os.makedirs(os.path.join(d, "2_Normalize"), exist_ok=True)

    st = SentenceTransformer(d, device="cpu")
    embed_reference(d, st, tokenizer)


def pooling_config(dim, mode):
    return {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": mode == "lasttoken",
        "include_prompt": True,
    }


def embed_reference(d, st, tokenizer, texts=TEXTS):
    """sentence-transformers' own embeddings, one input per batch so that
    no padding enters, and the Matryoshka truncations of them."""
    inputs = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        emb = st.encode([text], batch_size=1, convert_to_numpy=True)[0]
        inputs.append({"text": text, "token_ids": [int(i) for i in ids],
                       "embedding": [float(x) for x in emb]})
    dims = {}
    for n in (16,):
        truncated = st.encode(texts, batch_size=1, convert_to_numpy=True,
                              truncate_dim=n)
        dims[str(n)] = [[float(x) for x in (v / (v ** 2).sum() ** 0.5)]
                        for v in truncated]
    write_json(os.path.join(d, "reference.json"), {"inputs": inputs, "dimensions": dims})


# ---------------------------------------------------------------------------
# BERT: a WordPiece tokenizer, an embedding encoder and a cross-encoder
# ---------------------------------------------------------------------------

WORDS = ("the quick brown fox jumps over lazy dog what is capital of france paris "
         "country in europe and its a serves pag embed ##s ##ding ##oda ##ings "
         "? , . !").split()


def bert_tokenizer(d):
    """A WordPiece tokenizer laid out as BERT's (lower-casing normalizer,
    BERT pre-tokenizer, [CLS] A [SEP] B [SEP] with token types), built with
    the `tokenizers` library and saved through transformers."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, decoders
    from transformers import BertTokenizerFast
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [w for w in WORDS if w not in vocab]
    vocab += [c for c in "abcdefghijklmnopqrstuvwxyz0123456789" if c not in vocab]
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz" if "##" + c not in vocab]
    ids = {w: i for i, w in enumerate(vocab)}
    tok = Tokenizer(models.WordPiece(ids, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                             pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
                             model_max_length=128)
    fast.save_pretrained(d)
    return fast, len(vocab)


def bert_config(vocab, **kw):
    from transformers import BertConfig
    return BertConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=96, hidden_act="gelu",
        max_position_embeddings=128, type_vocab_size=3,
        layer_norm_eps=1e-7, pad_token_id=0, **kw)


def bert_embed(out):
    from sentence_transformers import SentenceTransformer
    from transformers import BertModel

    d = os.path.join(out, "bert-embed")
    os.makedirs(d, exist_ok=True)
    tok, vocab = bert_tokenizer(d)
    torch.manual_seed(SEED)
    model = BertModel(bert_config(vocab), add_pooling_layer=False).float().eval()
    scale_weights(model, 0.15)
    model.save_pretrained(d, safe_serialization=True)
    write_json(os.path.join(d, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(os.path.join(d, "sentence_bert_config.json"),
               {"max_seq_length": 128, "do_lower_case": False})
    os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
    write_json(os.path.join(d, "1_Pooling", "config.json"), pooling_config(64, "mean"))
    os.makedirs(os.path.join(d, "2_Normalize"), exist_ok=True)
    st = SentenceTransformer(d, device="cpu")
    embed_reference(d, st, tok)


def bert_rerank(out):
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    d = os.path.join(out, "bert-rerank")
    os.makedirs(d, exist_ok=True)
    tok, vocab = bert_tokenizer(d)
    torch.manual_seed(SEED + 1)
    model = BertForSequenceClassification(bert_config(vocab, num_labels=1)).float().eval()
    scale_weights(model, 0.15)
    model.save_pretrained(d, safe_serialization=True)
    ce = CrossEncoder(d, device="cpu")
    pairs = [(QUERY, doc) for doc in DOCS]
    logits = []
    ids = []
    for q, doc in pairs:
        enc = tok(q, doc, return_tensors="pt")
        ids.append([int(i) for i in enc["input_ids"][0]])
        with torch.no_grad():
            logits.append(float(model(**enc).logits[0, 0]))
    scores = [float(s) for s in ce.predict(pairs, batch_size=1)]
    write_json(os.path.join(d, "reference.json"), {
        "query": QUERY, "documents": DOCS, "token_ids": ids,
        "logits": logits, "scores": scores,
    })


# ---------------------------------------------------------------------------
# XLM-RoBERTa: a Unigram tokenizer, an embedding encoder with CLS pooling
# ---------------------------------------------------------------------------

def xlmr_tokenizer(d):
    """A Unigram tokenizer laid out as XLM-R's (Metaspace, `<s> A </s>` and
    `<s> A </s></s> B </s>`, ids 0-3 for <s> <pad> </s> <unk>), built with
    the `tokenizers` library and saved through transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import XLMRobertaTokenizerFast
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    words = [w for w in WORDS if not w.startswith("##")]
    pieces = [(t, 0.0) for t in specials]
    pieces += [("\u2581" + w, -2.0) for w in dict.fromkeys(words)]
    pieces += [("\u2581", -4.0)]
    pieces += [(c, -6.0) for c in "abcdefghijklmnopqrstuvwxyzP?,.!"]
    pieces += [("<mask>", 0.0)]
    ids = {p: i for i, (p, _) in enumerate(pieces)}
    tok = Tokenizer(models.Unigram(pieces, unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])])
    fast = XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                   pad_token="<pad>", mask_token="<mask>", model_max_length=64)
    fast.save_pretrained(d)
    return fast, len(pieces)


def xlmr_embed(out):
    """`XLMRobertaModel` as multilingual embedders (BGE-M3, E5) are saved:
    positions offset by padding_idx + 1 (66 rows for a context of 64), one
    token type, CLS pooling and Normalize."""
    from sentence_transformers import SentenceTransformer
    from transformers import XLMRobertaConfig, XLMRobertaModel

    d = os.path.join(out, "xlmr-embed")
    os.makedirs(d, exist_ok=True)
    tok, vocab = xlmr_tokenizer(d)
    torch.manual_seed(SEED + 2)
    config = XLMRobertaConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=96, hidden_act="gelu",
        max_position_embeddings=66, type_vocab_size=1,
        layer_norm_eps=1e-6, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    model = XLMRobertaModel(config, add_pooling_layer=False).float().eval()
    scale_weights(model, 0.15)
    model.save_pretrained(d, safe_serialization=True)
    write_json(os.path.join(d, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(os.path.join(d, "sentence_bert_config.json"),
               {"max_seq_length": 64, "do_lower_case": False})
    os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
    write_json(os.path.join(d, "1_Pooling", "config.json"), pooling_config(64, "cls"))
    os.makedirs(os.path.join(d, "2_Normalize"), exist_ok=True)
    st = SentenceTransformer(d, device="cpu")
    embed_reference(d, st, tok)


def xlmr_rerank(out):
    """`XLMRobertaForSequenceClassification` with one label (bge-reranker's
    form): XLM-R's head is dense, tanh and out_proj on the <s> row, named
    `classifier.dense` and `classifier.out_proj`, beside `roberta.`."""
    from sentence_transformers import CrossEncoder
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    d = os.path.join(out, "xlmr-rerank")
    os.makedirs(d, exist_ok=True)
    tok, vocab = xlmr_tokenizer(d)
    torch.manual_seed(SEED + 3)
    config = XLMRobertaConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=96, hidden_act="gelu",
        max_position_embeddings=66, type_vocab_size=1, num_labels=1,
        layer_norm_eps=1e-6, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    model = XLMRobertaForSequenceClassification(config).float().eval()
    scale_weights(model, 0.15)
    model.save_pretrained(d, safe_serialization=True)
    ce = CrossEncoder(d, device="cpu")
    pairs = [(QUERY, doc) for doc in DOCS]
    logits = []
    ids = []
    for q, doc in pairs:
        enc = tok(q, doc, return_tensors="pt")
        ids.append([int(i) for i in enc["input_ids"][0]])
        with torch.no_grad():
            logits.append(float(model(**enc).logits[0, 0]))
    scores = [float(s) for s in ce.predict(pairs, batch_size=1)]
    write_json(os.path.join(d, "reference.json"), {
        "query": QUERY, "documents": DOCS, "token_ids": ids,
        "logits": logits, "scores": scores,
    })


def bert_classify(out):
    """`BertForSequenceClassification` with three labels (id2label from the
    config), served on /classify: transformers' logits and their softmax."""
    from transformers import BertForSequenceClassification

    d = os.path.join(out, "bert-classify")
    os.makedirs(d, exist_ok=True)
    tok, vocab = bert_tokenizer(d)
    torch.manual_seed(SEED + 4)
    config = bert_config(vocab, num_labels=3,
                         id2label={0: "negative", 1: "neutral", 2: "positive"},
                         label2id={"negative": 0, "neutral": 1, "positive": 2})
    model = BertForSequenceClassification(config).float().eval()
    scale_weights(model, 0.3)
    model.save_pretrained(d, safe_serialization=True)
    inputs = []
    for text in TEXTS:
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            logits = model(**enc).logits[0]
        probs = torch.softmax(logits, dim=-1)
        inputs.append({"text": text, "token_ids": [int(i) for i in enc["input_ids"][0]],
                       "logits": [float(x) for x in logits],
                       "probs": [float(x) for x in probs],
                       "label": config.id2label[int(probs.argmax())]})
    write_json(os.path.join(d, "reference.json"), {"inputs": inputs})


def qwen3_rerank(out):
    """Qwen3-Reranker's form: a causal Qwen3 (`Qwen3ForCausalLM`, tied
    embeddings) whose score of a pair is P(yes) of the softmax over the
    logits of "yes" and "no" at the pair's last token, as the model card
    computes it. The hf-families tokenizer gains "no" and "yes" as added
    tokens (ids 507, 508); a pair is the two texts' tokens concatenated,
    as transformers' tokenizer(text, text_pair) gives them."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, PreTrainedTokenizerFast

    d = os.path.join(out, "qwen3-rerank")
    os.makedirs(d, exist_ok=True)
    src = here("..", "tests", "fixtures", "hf-families", "qwen3", "tokenizer.json")
    with open(src) as f:
        tok = json.load(f)
    base = len(tok["model"]["vocab"])
    for i, word in enumerate(["no", "yes"]):
        tok["added_tokens"].append({"id": base + i, "content": word, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": False})
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(d, "tokenizer.json"),
        eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=256)
    tokenizer.save_pretrained(d)
    no_id, yes_id = tokenizer.convert_tokens_to_ids(["no", "yes"])
    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=50000.0, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=0, bos_token_id=None,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(SEED + 5)
    model = Qwen3ForCausalLM(config).float().eval()
    scale_weights(model, 0.3)
    model.save_pretrained(d, safe_serialization=True)
    docs = DOCS + ["yes no yes"]
    ids, scores, logits = [], [], []
    for doc in docs:
        enc = tokenizer(QUERY, doc, return_tensors="pt")
        ids.append([int(i) for i in enc["input_ids"][0]])
        with torch.no_grad():
            last = model(input_ids=enc["input_ids"]).logits[0, -1]
        pair = torch.stack([last[no_id], last[yes_id]])
        logits.append([float(pair[0]), float(pair[1])])
        scores.append(float(torch.softmax(pair, dim=-1)[1]))
    write_json(os.path.join(d, "reference.json"), {
        "query": QUERY, "documents": docs, "token_ids": ids,
        "no_yes_ids": [int(no_id), int(yes_id)], "no_yes_logits": logits,
        "scores": scores,
    })


# ---------------------------------------------------------------------------
# ModernBERT: a byte-level BPE tokenizer, rotary positions, local and
# global attention layers
# ---------------------------------------------------------------------------

# Longer than the local layers' window (local_attention 8: four tokens on
# each side), so that the window shows in the numbers.
LONG_TEXT = ("the lazy dog sleeps while the quick brown fox jumps over it again and again, "
             "and paris, the capital of france, is a city in europe that serves embeddings")
MODERNBERT_TEXTS = TEXTS + [LONG_TEXT]


def modernbert_tokenizer(d):
    """A byte-level BPE tokenizer laid out as ModernBERT's (GPT-NeoX style
    byte-level pieces, `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]` with
    token types 0 then 1), trained with the `tokenizers` library on the
    fixture's own texts and saved through transformers; its inputs are ids
    and mask only, as ModernBERT's tokenizer_config says."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = MODERNBERT_TEXTS + DOCS + [QUERY, " ".join(WORDS)]
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    ids = {t: tok.token_to_id(t) for t in specials}
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
                                   model_max_length=128,
                                   model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(d)
    return fast, tok.get_vocab_size(), ids


def modernbert_config(vocab, ids, **kw):
    """Five layers, every third global (layers 0 and 3), the others
    attending to 8 tokens around them; RoPE bases away from the defaults
    (160000 and 10000)."""
    from transformers import ModernBertConfig
    return ModernBertConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=80, num_hidden_layers=5,
        num_attention_heads=4, hidden_activation="gelu", max_position_embeddings=128,
        norm_eps=1e-6, global_attn_every_n_layers=3, local_attention=8,
        global_rope_theta=20000.0, local_rope_theta=5000.0,
        pad_token_id=ids["[PAD]"], cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"],
        bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"], **kw)


def modernbert_embed(out):
    """`ModernBertModel` as sentence-transformers saves it (ModernBERT
    embedders such as gte-modernbert and nomic-embed-text-v2's kin): mean
    pooling and Normalize. LayerNorms without bias (norm_bias false, as
    released), attention and MLP biases on (both off by default)."""
    from sentence_transformers import SentenceTransformer
    from transformers import ModernBertModel

    d = os.path.join(out, "modernbert-embed")
    os.makedirs(d, exist_ok=True)
    tok, vocab, ids = modernbert_tokenizer(d)
    torch.manual_seed(SEED + 6)
    config = modernbert_config(vocab, ids, norm_bias=False, attention_bias=True, mlp_bias=True)
    config.architectures = ["ModernBertModel"]
    model = ModernBertModel(config).float().eval()
    scale_weights(model, 0.15)
    model.save_pretrained(d, safe_serialization=True)
    write_json(os.path.join(d, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(os.path.join(d, "sentence_bert_config.json"),
               {"max_seq_length": 128, "do_lower_case": False})
    os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
    write_json(os.path.join(d, "1_Pooling", "config.json"), pooling_config(64, "mean"))
    os.makedirs(os.path.join(d, "2_Normalize"), exist_ok=True)
    st = SentenceTransformer(d, device="cpu")
    embed_reference(d, st, tok, MODERNBERT_TEXTS)


def modernbert_rerank(out):
    """`ModernBertForSequenceClassification` with one label (the
    gte-reranker-modernbert form): the mean of the final-normed rows
    (classifier_pooling "mean"), the head (dense with classifier_bias,
    gelu, LayerNorm) and the classifier; LayerNorms with bias (norm_bias
    true), no attention or MLP biases. Pairs `[CLS] q [SEP] d [SEP]`, whose
    token types the model does not read."""
    from sentence_transformers import CrossEncoder
    from transformers import ModernBertForSequenceClassification

    d = os.path.join(out, "modernbert-rerank")
    os.makedirs(d, exist_ok=True)
    tok, vocab, ids = modernbert_tokenizer(d)
    torch.manual_seed(SEED + 7)
    config = modernbert_config(vocab, ids, norm_bias=True, attention_bias=False, mlp_bias=False,
                               num_labels=1, classifier_pooling="mean", classifier_bias=True,
                               classifier_activation="gelu")
    model = ModernBertForSequenceClassification(config).float().eval()
    scale_weights(model, 0.15)
    model.save_pretrained(d, safe_serialization=True)
    ce = CrossEncoder(d, device="cpu")
    docs = DOCS + [LONG_TEXT]
    pairs = [(QUERY, doc) for doc in docs]
    logits = []
    token_ids = []
    for q, doc in pairs:
        enc = tok(q, doc, return_tensors="pt")
        token_ids.append([int(i) for i in enc["input_ids"][0]])
        with torch.no_grad():
            logits.append(float(model(**enc).logits[0, 0]))
    scores = [float(s) for s in ce.predict(pairs, batch_size=1)]
    write_json(os.path.join(d, "reference.json"), {
        "query": QUERY, "documents": docs, "token_ids": token_ids,
        "logits": logits, "scores": scores,
    })


FIXTURES = {
    "qwen3-embed": qwen3_embed,
    "bert-embed": bert_embed,
    "bert-rerank": bert_rerank,
    "xlmr-embed": xlmr_embed,
    "xlmr-rerank": xlmr_rerank,
    "bert-classify": bert_classify,
    "qwen3-rerank": qwen3_rerank,
    "modernbert-embed": modernbert_embed,
    "modernbert-rerank": modernbert_rerank,
}


def main():
    """python3 scripts/make-pooling-fixtures.py OUT_DIR [NAME...]: every
    fixture, or only those named."""
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name in sys.argv[2:] or list(FIXTURES):
        FIXTURES[name](out)


if __name__ == "__main__":
    main()
