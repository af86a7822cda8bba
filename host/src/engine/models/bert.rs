//! BERT encoders: `BertModel` (embeddings, sentence-transformers' form)
//! and `BertForSequenceClassification` (cross-encoders), as transformers
//! defines them; and `XLMRobertaModel`, the same encoder whose positions
//! start after `padding_idx` and which has one token type, with
//! `XLMRobertaForSequenceClassification` (tensors under `roberta.`; its
//! head, `classifier.dense`, tanh, `classifier.out_proj` on the <s> row,
//! is BERT's pooler and classifier under other names).
//!
//! Input embedding: word + absolute position + token type, then LayerNorm.
//! Each layer is post-LayerNorm: `h = LN(x + O·attn(x))`, `x = LN(h +
//! W2·gelu(W1·h))`, with biases everywhere, and the attention runs both
//! ways over each sequence's own rows. Encoder rows are prefill-only: the
//! whole prompt runs in one step, its K and V come from the step's rows
//! and nothing goes into the KV pool (the model declares no KV layers).
//!
//! The forward ends by pooling each sequence (CLS, mean or last token, the
//! pooler the engine resolved) into `ws.h`, one row per logit row; a
//! classifier then applies BERT's pooler (dense, tanh) and its classifier,
//! leaving `num_labels` raw logits per row.
//!
//! A pair's token types (`[CLS] q [SEP]` 0, `d [SEP]` 1) travel packed in
//! the token ids ([`pagoda_accel::ops::TOKEN_TYPE_SHIFT`]), as vLLM packs
//! them.

use super::layers::{load_matrix, load_vector, Workspace};
use super::{CausalLm, StateCache};
use crate::engine::config::{Arch, EncoderConfig, ModelConfig};
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{Activation, RopeScaling, RopeStyle, SeqPooling};
use pagoda_accel::{Backend, BackendError, DeviceMatrix, KvLayerSpec, Rows};
use serde_json::Value;

/// A dense layer with a bias.
struct Linear<B: Backend> {
    w: B::Matrix,
    b: B::Vector,
}

impl<B: Backend> Linear<B> {
    fn load(
        backend: &B,
        source: &dyn WeightSource,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Linear<B>> {
        Ok(Linear {
            w: load_matrix(backend, source, &format!("{name}.weight"), rows, cols)?,
            b: load_vector(backend, source, &format!("{name}.bias"), rows)?,
        })
    }

    /// `out = x·wᵀ + b` for `m` rows.
    fn run(
        &self,
        b: &mut B,
        x: &B::Buffer,
        m: usize,
        out: &mut B::Buffer,
        step: &B::Step,
        rows: Rows,
    ) -> Result<(), BackendError> {
        b.reserve(out, m * self.w.rows())?;
        match rows {
            // Encoder rows: whole prompts, never decoded.
            Rows::Tokens => b.matmul_encoder(&self.w, x, m, out, step),
            Rows::Logits => b.matmul(&self.w, x, m, out, step, rows),
        }
        b.add_bias(out, &self.b, m, self.w.rows());
        Ok(())
    }
}

/// A LayerNorm's weight and bias.
struct Norm<B: Backend> {
    w: B::Vector,
    b: B::Vector,
}

impl<B: Backend> Norm<B> {
    fn load(backend: &B, source: &dyn WeightSource, name: &str, d: usize) -> Result<Norm<B>> {
        Ok(Norm {
            w: load_vector(backend, source, &format!("{name}.weight"), d)?,
            b: load_vector(backend, source, &format!("{name}.bias"), d)?,
        })
    }
}

struct Layer<B: Backend> {
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    attn_norm: Norm<B>,
    up: Linear<B>,
    down: Linear<B>,
    ffn_norm: Norm<B>,
}

/// BERT's pooler and the classifier after it.
struct Classifier<B: Backend> {
    pooler: Linear<B>,
    classifier: Linear<B>,
}

/// A loaded BERT encoder.
pub struct Bert<B: Backend> {
    config: ModelConfig,
    enc: EncoderConfig,
    word: B::Matrix,
    position: B::Matrix,
    token_type: Option<B::Matrix>,
    emb_norm: Norm<B>,
    layers: Vec<Layer<B>>,
    head: Option<Classifier<B>>,
    pooling: SeqPooling,
    weight_type: &'static str,
    bytes: usize,
}

/// Loads a BERT checkpoint (`BertModel` names its tensors from
/// `embeddings.`; `BertForSequenceClassification` from `bert.`, with
/// `classifier.` beside). `max_positions` (the engine's `--max-model-len`)
/// must fit the position table.
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<Bert<B>> {
    let enc = config
        .encoder
        .clone()
        .context("a BERT model needs its encoder config")?;
    if !backend.supports_encoder() {
        bail!(
            "this device has no encoder kernels yet ({}); serve BERT models with --device cpu",
            backend.describe()
        );
    }
    if max_positions + enc.position_offset > enc.position_rows {
        bail!(
            "--max-model-len {max_positions} exceeds the {} positions of the model's position embeddings; lower --max-model-len",
            enc.position_rows.saturating_sub(enc.position_offset)
        );
    }
    let p = if source.contains("bert.embeddings.word_embeddings.weight") {
        "bert."
    } else if source.contains("roberta.embeddings.word_embeddings.weight") {
        "roberta."
    } else {
        ""
    };
    let (d, ffn) = (config.hidden_size, config.intermediate_size);
    let e = format!("{p}embeddings");
    let word = load_matrix(
        backend,
        source,
        &format!("{e}.word_embeddings.weight"),
        config.vocab_size,
        d,
    )?;
    let position = load_matrix(
        backend,
        source,
        &format!("{e}.position_embeddings.weight"),
        enc.position_rows,
        d,
    )?;
    let token_type = if enc.type_vocab_size > 0 {
        Some(load_matrix(
            backend,
            source,
            &format!("{e}.token_type_embeddings.weight"),
            enc.type_vocab_size,
            d,
        )?)
    } else {
        None
    };
    let emb_norm = Norm::load(backend, source, &format!("{e}.LayerNorm"), d)?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let l = format!("{p}encoder.layer.{i}");
        layers.push(Layer {
            q: Linear::load(backend, source, &format!("{l}.attention.self.query"), d, d)?,
            k: Linear::load(backend, source, &format!("{l}.attention.self.key"), d, d)?,
            v: Linear::load(backend, source, &format!("{l}.attention.self.value"), d, d)?,
            o: Linear::load(
                backend,
                source,
                &format!("{l}.attention.output.dense"),
                d,
                d,
            )?,
            attn_norm: Norm::load(
                backend,
                source,
                &format!("{l}.attention.output.LayerNorm"),
                d,
            )?,
            up: Linear::load(backend, source, &format!("{l}.intermediate.dense"), ffn, d)?,
            down: Linear::load(backend, source, &format!("{l}.output.dense"), d, ffn)?,
            ffn_norm: Norm::load(backend, source, &format!("{l}.output.LayerNorm"), d)?,
        });
    }
    let head = match enc.num_labels {
        // XLM-R's `XLMRobertaClassificationHead`: the same dense, tanh and
        // projection of the <s> row, named under `classifier.`.
        Some(n) if source.contains("classifier.out_proj.weight") => Some(Classifier {
            pooler: Linear::load(backend, source, "classifier.dense", d, d)?,
            classifier: Linear::load(backend, source, "classifier.out_proj", n, d)?,
        }),
        Some(n) => Some(Classifier {
            pooler: Linear::load(backend, source, &format!("{p}pooler.dense"), d, d)?,
            classifier: Linear::load(backend, source, "classifier", n, d)?,
        }),
        None => None,
    };
    let mut bytes = word.size_bytes()
        + position.size_bytes()
        + token_type.as_ref().map_or(0, |t| t.size_bytes());
    for l in &layers {
        for m in [&l.q, &l.k, &l.v, &l.o, &l.up, &l.down] {
            bytes += m.w.size_bytes();
        }
    }
    if let Some(h) = &head {
        bytes += h.pooler.w.size_bytes() + h.classifier.w.size_bytes();
    }
    let weight_type = layers.first().map_or("none", |l| l.q.w.ty().name());
    Ok(Bert {
        config,
        // A classifier pools its [CLS] row, as BERT's pooler does; an
        // embedding model pools as the engine sets it.
        pooling: if enc.num_labels.is_some() {
            SeqPooling::First
        } else {
            SeqPooling::Mean
        },
        enc,
        word,
        position,
        token_type,
        emb_norm,
        layers,
        head,
        weight_type,
        bytes,
    })
}

impl<B: Backend> CausalLm<B> for Bert<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// None: encoder rows keep nothing after their step.
    fn kv_layers(&self) -> Vec<KvLayerSpec> {
        Vec::new()
    }

    fn set_pooling(&mut self, how: SeqPooling) -> Result<()> {
        self.pooling = how;
        Ok(())
    }

    fn pooled_width(&self) -> usize {
        self.enc.num_labels.unwrap_or(self.config.hidden_size)
    }

    fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n: usize,
        n_logits: usize,
        _kv: &mut B::Kv,
        _state: &mut StateCache<B>,
        ws: &mut Workspace<B>,
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (d, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim);
        let eps = self.enc.layer_norm_eps;
        for buf in [
            &mut ws.x,
            &mut ws.h,
            &mut ws.q,
            &mut ws.k,
            &mut ws.v,
            &mut ws.attn,
        ] {
            b.reserve(buf, n * d)?;
        }
        b.encoder_embed(
            &self.word,
            &self.position,
            self.enc.position_offset,
            self.token_type.as_ref(),
            step,
            &mut ws.h,
        )?;
        b.layer_norm(
            &ws.h,
            &self.emb_norm.w,
            &self.emb_norm.b,
            eps,
            n,
            d,
            &mut ws.x,
        )?;
        let scale = 1.0 / (hd as f32).sqrt();
        for l in &self.layers {
            l.q.run(b, &ws.x, n, &mut ws.q, step, Rows::Tokens)?;
            l.k.run(b, &ws.x, n, &mut ws.k, step, Rows::Tokens)?;
            l.v.run(b, &ws.x, n, &mut ws.v, step, Rows::Tokens)?;
            b.bidirectional_attention(
                &ws.q,
                &ws.k,
                &ws.v,
                heads,
                heads,
                hd,
                scale,
                None,
                step,
                &mut ws.attn,
            )?;
            l.o.run(b, &ws.attn, n, &mut ws.proj, step, Rows::Tokens)?;
            b.add(&mut ws.proj, &ws.x, n * d);
            b.layer_norm(
                &ws.proj,
                &l.attn_norm.w,
                &l.attn_norm.b,
                eps,
                n,
                d,
                &mut ws.x,
            )?;
            l.up.run(b, &ws.x, n, &mut ws.act, step, Rows::Tokens)?;
            b.activation(&mut ws.act, n * c.intermediate_size, Activation::GeluErf)?;
            l.down
                .run(b, &ws.act, n, &mut ws.proj, step, Rows::Tokens)?;
            b.add(&mut ws.proj, &ws.x, n * d);
            b.layer_norm(&ws.proj, &l.ffn_norm.w, &l.ffn_norm.b, eps, n, d, &mut ws.x)?;
        }
        if n_logits == 0 {
            return Ok(());
        }
        b.reserve(&mut ws.h, n_logits * d)?;
        b.pool_seqs(&ws.x, d, self.pooling, step, &mut ws.h)?;
        if let Some(head) = &self.head {
            head.pooler
                .run(b, &ws.h, n_logits, &mut ws.rows, step, Rows::Logits)?;
            b.activation(&mut ws.rows, n_logits * d, Activation::Tanh)?;
            head.classifier
                .run(b, &ws.rows, n_logits, &mut ws.h, step, Rows::Logits)?;
        }
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        self.bytes
    }

    fn weight_type(&self) -> &'static str {
        self.weight_type
    }

    fn has_prompt_kernel(&self) -> bool {
        false
    }
}

/// Interprets the `config.json` of a BERT checkpoint (`arch`:
/// `BertModel`, `BertForSequenceClassification`, `XLMRobertaModel`, or
/// the model type `bert` or `xlm-roberta`). Every key that would change its math and is not computed
/// here is refused by name.
pub fn hf_config(v: &Value, arch: &str) -> Result<ModelConfig> {
    let usize_of = |key: &str| crate::engine::config::required_count(v, key);
    match v.get("hidden_act").and_then(Value::as_str) {
        None | Some("gelu") => {}
        Some(other) => bail!(
            "hidden_act '{other}' is not implemented for BERT (only 'gelu', the erf form, is)"
        ),
    }
    match v.get("position_embedding_type") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "absolute" => {}
        Some(other) => bail!(
            "position_embedding_type {other} is not implemented for BERT (only 'absolute' is)"
        ),
    }
    for key in ["is_decoder", "add_cross_attention"] {
        if v.get(key).and_then(Value::as_bool) == Some(true) {
            bail!("'{key}' is true: a BERT decoder is not served (only encoders are)");
        }
    }
    let hidden_size = usize_of("hidden_size")?;
    let num_heads = usize_of("num_attention_heads")?;
    if num_heads == 0 || !hidden_size.is_multiple_of(num_heads) {
        bail!("hidden_size {hidden_size} is not a whole number of {num_heads} attention heads");
    }
    let layer_norm_eps = match v.get("layer_norm_eps") {
        None | Some(Value::Null) => 1e-12,
        Some(x) => x.as_f64().context("'layer_norm_eps' must be a number")? as f32,
    };
    let type_vocab_size = match v.get("type_vocab_size") {
        None | Some(Value::Null) => 2,
        Some(_) => usize_of("type_vocab_size")?,
    };
    // XLM-R (RoBERTa's embeddings): positions count from padding_idx
    // + 1, as transformers' `create_position_ids_from_input_ids` gives
    // them for a prompt without padding.
    let xlmr = matches!(
        arch,
        "XLMRobertaModel" | "XLMRobertaForSequenceClassification" | "xlm-roberta"
    );
    let position_offset = if xlmr {
        let pad = v
            .get("pad_token_id")
            .and_then(Value::as_u64)
            .context("XLM-R needs 'pad_token_id' (its positions start after it)")?;
        pad as usize + 1
    } else {
        0
    };
    let position_rows = usize_of("max_position_embeddings")?;
    if position_rows <= position_offset {
        bail!("max_position_embeddings {position_rows} leaves no position after the offset of {position_offset}");
    }
    let num_labels = num_labels(v, arch)?;
    let cfg = ModelConfig {
        arch: Arch::Bert,
        hidden_size,
        num_layers: usize_of("num_hidden_layers")?,
        num_heads,
        num_kv_heads: num_heads,
        head_dim: hidden_size / num_heads,
        intermediate_size: usize_of("intermediate_size")?,
        vocab_size: usize_of("vocab_size")?,
        rms_norm_eps: layer_norm_eps,
        // No rotary embedding: the positions are a learned table.
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        rope_style: RopeStyle::Neox,
        max_position_embeddings: position_rows - position_offset,
        tie_word_embeddings: false,
        attention_bias: true,
        o_bias: true,
        mlp_bias: true,
        sliding_windows: Vec::new(),
        moe: None,
        mla: None,
        hybrid: None,
        hidden_act: crate::engine::config::Activation::Silu,
        gemma: None,
        gpt_oss: None,
        encoder: Some(EncoderConfig {
            layer_norm_eps,
            type_vocab_size,
            position_offset,
            position_rows,
            num_labels,
            modernbert: None,
        }),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The labels of a `*ForSequenceClassification` checkpoint (`arch`):
/// `num_labels`, else as many as `id2label` names, else transformers' 2;
/// `None` for a headless encoder. A `problem_type` other than single-label
/// classification (or regression, for one label) is refused. ModernBERT's
/// reader shares it.
pub(crate) fn num_labels(v: &Value, arch: &str) -> Result<Option<usize>> {
    Ok(if arch.ends_with("ForSequenceClassification") {
        let n = match v.get("num_labels") {
            Some(x) => x.as_u64().context("'num_labels' must be a number")? as usize,
            None => v
                .get("id2label")
                .and_then(Value::as_object)
                .map_or(2, |m| m.len()),
        };
        if n == 0 {
            bail!("{arch} with 0 labels: 'num_labels' must be at least 1");
        }
        // Several labels: /classify's softmax is single-label
        // classification's; a multi-label head's independent sigmoids
        // are not served.
        if let Some(p) = v.get("problem_type").and_then(Value::as_str) {
            let fits = if n == 1 {
                p == "regression" || p == "single_label_classification"
            } else {
                p == "single_label_classification"
            };
            if !fits {
                bail!("problem_type '{p}' is not served for a classifier with {n} labels (only single_label_classification, whose probabilities are a softmax{})", if n == 1 { ", or regression" } else { "" });
            }
        }
        Some(n)
    } else {
        None
    })
}
