//! ModernBERT encoders: `ModernBertModel` (embeddings, as
//! sentence-transformers saves them) and
//! `ModernBertForSequenceClassification` (cross-encoders and classifiers),
//! as transformers' `modeling_modernbert.py` defines them.
//!
//! Input embedding: `LayerNorm(tok_embeddings[id])`, no absolute
//! positions and no token types. Each layer is pre-LayerNorm (the first
//! layer's attention norm is the identity):
//! `x += Wo·attn(rope(Wqkv·LN(x)))`, `x += Wo'·(act(a) · g)` where `[a | g]
//! = Wi·LN(x)`; then `final_norm`. Rotary positions (NeoX halves) rotate q
//! and k with `global_rope_theta` on the global layers (every
//! `global_attn_every_n_layers`-th from layer 0, or `layer_types`'
//! `full_attention`) and `local_rope_theta` on the local ones, which see
//! only the tokens at most `local_attention / 2` positions away on either
//! side. Biases follow `attention_bias` (Wqkv, Wo), `mlp_bias` (Wi, Wo)
//! and `norm_bias` (every LayerNorm).
//!
//! As [`super::bert`], the rows are prefill-only and keep no KV; the
//! forward ends by pooling each sequence into `ws.h`. A classifier pools
//! as its `classifier_pooling` says (the engine's pooler reads it), then
//! applies the head (`head.dense` with `classifier_bias`,
//! `classifier_activation`, `head.norm`) and `classifier`, leaving
//! `num_labels` raw logits per row.

use super::layers::{load_matrix, load_vector, Workspace};
use super::{CausalLm, StateCache};
use crate::engine::config::{Arch, EncoderConfig, ModelConfig, ModernBertConfig};
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{Activation, RopeScaling, RopeStyle, RopeTable, SeqPooling};
use pagoda_accel::{Backend, BackendError, DeviceMatrix, KvLayerSpec, Rows};
use serde_json::Value;

/// The family id of the registry's ModernBERT rows.
pub const MODERNBERT: Arch = Arch::new("ModernBert");

/// transformers' defaults for the two RoPE bases (`default_theta`).
const DEFAULT_GLOBAL_THETA: f64 = 160_000.0;
const DEFAULT_LOCAL_THETA: f64 = 10_000.0;

/// A dense layer, with a bias where the config gives it one.
struct Linear<B: Backend> {
    w: B::Matrix,
    b: Option<B::Vector>,
}

impl<B: Backend> Linear<B> {
    fn load(
        backend: &B,
        source: &dyn WeightSource,
        name: &str,
        rows: usize,
        cols: usize,
        bias: bool,
    ) -> Result<Linear<B>> {
        Ok(Linear {
            w: load_matrix(backend, source, &format!("{name}.weight"), rows, cols)?,
            b: if bias {
                Some(load_vector(backend, source, &format!("{name}.bias"), rows)?)
            } else {
                None
            },
        })
    }

    /// `out = x·wᵀ (+ b)` for `m` rows.
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
        b.matmul(&self.w, x, m, out, step, rows);
        if let Some(bias) = &self.b {
            b.add_bias(out, bias, m, self.w.rows());
        }
        Ok(())
    }
}

/// A LayerNorm; without `norm_bias` its bias is zero.
struct Norm<B: Backend> {
    w: B::Vector,
    b: B::Vector,
}

impl<B: Backend> Norm<B> {
    fn load(
        backend: &B,
        source: &dyn WeightSource,
        name: &str,
        d: usize,
        bias: bool,
    ) -> Result<Norm<B>> {
        Ok(Norm {
            w: load_vector(backend, source, &format!("{name}.weight"), d)?,
            b: if bias {
                load_vector(backend, source, &format!("{name}.bias"), d)?
            } else {
                backend.upload_vector(&vec![0.0; d])?
            },
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        b: &mut B,
        x: &B::Buffer,
        eps: f32,
        m: usize,
        d: usize,
        out: &mut B::Buffer,
    ) -> Result<(), BackendError> {
        b.reserve(out, m * d)?;
        b.layer_norm(x, &self.w, &self.b, eps, m, d, out)
    }
}

struct Layer<B: Backend> {
    /// `None` for layer 0, whose attention norm is the identity.
    attn_norm: Option<Norm<B>>,
    qkv: Linear<B>,
    o: Linear<B>,
    mlp_norm: Norm<B>,
    wi: Linear<B>,
    wo: Linear<B>,
    /// The local layers' half window.
    window: Option<usize>,
}

/// The head of `ModernBertForSequenceClassification`.
struct Classifier<B: Backend> {
    dense: Linear<B>,
    act: Activation,
    norm: Norm<B>,
    classifier: Linear<B>,
}

/// A loaded ModernBERT encoder.
pub struct ModernBert<B: Backend> {
    config: ModelConfig,
    eps: f32,
    num_labels: Option<usize>,
    hidden_act: Activation,
    tok: B::Matrix,
    emb_norm: Norm<B>,
    layers: Vec<Layer<B>>,
    final_norm: Norm<B>,
    global_rope: B::Rope,
    local_rope: B::Rope,
    head: Option<Classifier<B>>,
    pooling: SeqPooling,
    weight_type: &'static str,
    bytes: usize,
}

/// Loads a ModernBERT checkpoint (`ModernBertModel` names its tensors from
/// `embeddings.`; `ModernBertForSequenceClassification` from `model.`,
/// with `head.` and `classifier.` beside). `max_positions` (the engine's
/// `--max-model-len`) sizes the rotary tables.
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<ModernBert<B>> {
    let enc = config
        .encoder
        .clone()
        .context("a ModernBERT model needs its encoder config")?;
    let mb = enc
        .modernbert
        .clone()
        .context("a ModernBERT model needs its ModernBERT config")?;
    if !backend.supports_encoder() {
        bail!(
            "this device has no encoder kernels yet ({}); serve ModernBERT models with --device cpu",
            backend.describe()
        );
    }
    let p = if source.contains("model.embeddings.tok_embeddings.weight") {
        "model."
    } else {
        ""
    };
    let (d, ffn, nb) = (config.hidden_size, config.intermediate_size, mb.norm_bias);
    let tok = load_matrix(
        backend,
        source,
        &format!("{p}embeddings.tok_embeddings.weight"),
        config.vocab_size,
        d,
    )?;
    let emb_norm = Norm::load(backend, source, &format!("{p}embeddings.norm"), d, nb)?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for (i, &window) in mb.windows.iter().enumerate() {
        let l = format!("{p}layers.{i}");
        layers.push(Layer {
            attn_norm: if i == 0 {
                None
            } else {
                Some(Norm::load(
                    backend,
                    source,
                    &format!("{l}.attn_norm"),
                    d,
                    nb,
                )?)
            },
            qkv: Linear::load(
                backend,
                source,
                &format!("{l}.attn.Wqkv"),
                3 * d,
                d,
                config.attention_bias,
            )?,
            o: Linear::load(
                backend,
                source,
                &format!("{l}.attn.Wo"),
                d,
                d,
                config.attention_bias,
            )?,
            mlp_norm: Norm::load(backend, source, &format!("{l}.mlp_norm"), d, nb)?,
            wi: Linear::load(
                backend,
                source,
                &format!("{l}.mlp.Wi"),
                2 * ffn,
                d,
                config.mlp_bias,
            )?,
            wo: Linear::load(
                backend,
                source,
                &format!("{l}.mlp.Wo"),
                d,
                ffn,
                config.mlp_bias,
            )?,
            window,
        });
    }
    let final_norm = Norm::load(backend, source, &format!("{p}final_norm"), d, nb)?;
    let rope = |theta: f32| {
        backend.upload_rope(&RopeTable::new(
            config.head_dim,
            theta,
            max_positions,
            &RopeScaling::None,
            RopeStyle::Neox,
        ))
    };
    let global_rope = rope(config.rope_theta)?;
    let local_rope = rope(mb.local_rope_theta)?;
    let head = match enc.num_labels {
        Some(n) => Some(Classifier {
            dense: Linear::load(backend, source, "head.dense", d, d, mb.classifier_bias)?,
            act: mb.classifier_act,
            norm: Norm::load(backend, source, "head.norm", d, nb)?,
            // `nn.Linear` with its default bias.
            classifier: Linear::load(backend, source, "classifier", n, d, true)?,
        }),
        None => None,
    };
    let mut bytes = tok.size_bytes();
    for l in &layers {
        for m in [&l.qkv, &l.o, &l.wi, &l.wo] {
            bytes += m.w.size_bytes();
        }
    }
    if let Some(h) = &head {
        bytes += h.dense.w.size_bytes() + h.classifier.w.size_bytes();
    }
    let weight_type = layers.first().map_or("none", |l| l.qkv.w.ty().name());
    Ok(ModernBert {
        eps: enc.layer_norm_eps,
        num_labels: enc.num_labels,
        hidden_act: mb.hidden_act,
        config,
        tok,
        emb_norm,
        layers,
        final_norm,
        global_rope,
        local_rope,
        head,
        // The engine sets the pooling it resolved (for a classifier, its
        // `classifier_pooling`).
        pooling: SeqPooling::First,
        weight_type,
        bytes,
    })
}

impl<B: Backend> CausalLm<B> for ModernBert<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// None: encoder rows keep nothing after their step.
    fn kv_layers(&self) -> Vec<KvLayerSpec> {
        Vec::new()
    }

    fn set_pooling(&mut self, how: SeqPooling) -> Result<()> {
        if how == SeqPooling::Last && self.head.is_some() {
            bail!("last-token pooling of a ModernBERT classifier is not what it was trained with: its classifier_pooling is cls or mean");
        }
        self.pooling = how;
        Ok(())
    }

    fn pooled_width(&self) -> usize {
        self.num_labels.unwrap_or(self.config.hidden_size)
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
        let (d, heads, hd, ffn) = (c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size);
        let eps = self.eps;
        for buf in [
            &mut ws.x,
            &mut ws.h,
            &mut ws.q,
            &mut ws.k,
            &mut ws.v,
            &mut ws.attn,
            &mut ws.proj,
        ] {
            b.reserve(buf, n * d)?;
        }
        b.reserve(&mut ws.act, n * ffn)?;
        b.embed(&self.tok, step, &mut ws.h);
        self.emb_norm.run(b, &ws.h, eps, n, d, &mut ws.x)?;
        let scale = 1.0 / (hd as f32).sqrt();
        for l in &self.layers {
            let input = match &l.attn_norm {
                Some(norm) => {
                    norm.run(b, &ws.x, eps, n, d, &mut ws.h)?;
                    &ws.h
                }
                None => &ws.x,
            };
            l.qkv.run(b, input, n, &mut ws.qkv, step, Rows::Tokens)?;
            // Wqkv's rows are q, then k, then v, each `heads × head_dim`.
            b.copy_columns(&ws.qkv, 3 * d, 0, &mut ws.q, d, 0, d, n);
            b.copy_columns(&ws.qkv, 3 * d, d, &mut ws.k, d, 0, d, n);
            b.copy_columns(&ws.qkv, 3 * d, 2 * d, &mut ws.v, d, 0, d, n);
            let rope = if l.window.is_some() {
                &self.local_rope
            } else {
                &self.global_rope
            };
            b.rope(rope, &mut ws.q, heads, step);
            b.rope(rope, &mut ws.k, heads, step);
            b.bidirectional_attention(
                &ws.q,
                &ws.k,
                &ws.v,
                heads,
                heads,
                hd,
                scale,
                l.window,
                step,
                &mut ws.attn,
            )?;
            l.o.run(b, &ws.attn, n, &mut ws.proj, step, Rows::Tokens)?;
            b.add(&mut ws.x, &ws.proj, n * d);
            l.mlp_norm.run(b, &ws.x, eps, n, d, &mut ws.h)?;
            l.wi.run(b, &ws.h, n, &mut ws.gate_up, step, Rows::Tokens)?;
            b.act_mul(&ws.gate_up, n, ffn, self.hidden_act, &mut ws.act)?;
            l.wo.run(b, &ws.act, n, &mut ws.proj, step, Rows::Tokens)?;
            b.add(&mut ws.x, &ws.proj, n * d);
        }
        if n_logits == 0 {
            return Ok(());
        }
        self.final_norm.run(b, &ws.x, eps, n, d, &mut ws.proj)?;
        b.reserve(&mut ws.h, n_logits * d)?;
        b.pool_seqs(&ws.proj, d, self.pooling, step, &mut ws.h)?;
        if let Some(head) = &self.head {
            head.dense
                .run(b, &ws.h, n_logits, &mut ws.rows, step, Rows::Logits)?;
            b.activation(&mut ws.rows, n_logits * d, head.act)?;
            head.norm.run(b, &ws.rows, eps, n_logits, d, &mut ws.proj)?;
            head.classifier
                .run(b, &ws.proj, n_logits, &mut ws.h, step, Rows::Logits)?;
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

/// Interprets the `config.json` of a ModernBERT checkpoint (`arch`:
/// `ModernBertModel`, `ModernBertForSequenceClassification`, or the model
/// type `modernbert`), in both the form transformers 5 writes
/// (`layer_types`, `rope_parameters` per layer type) and the older one on
/// the Hub (`global_attn_every_n_layers`, `global_rope_theta`,
/// `local_rope_theta`). Every key that would change its math and is not
/// computed here is refused by name.
pub fn hf_config(v: &Value, arch: &str) -> Result<ModelConfig> {
    let usize_of = |key: &str| crate::engine::config::required_count(v, key);
    let usize_or = |key: &str, default: usize| -> Result<usize> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => usize_of(key),
        }
    };
    let f64_of = |key: &str| -> Result<Option<f64>> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => Ok(Some(
                x.as_f64()
                    .with_context(|| format!("'{key}' must be a number"))?,
            )),
        }
    };
    let flag = |key: &str, default: bool| -> Result<bool> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_bool()
                .with_context(|| format!("'{key}' must be true or false")),
        }
    };
    let act_of = |key: &str| -> Result<Activation> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(Activation::GeluErf),
            Some(Value::String(s)) if s == "gelu" => Ok(Activation::GeluErf),
            Some(Value::String(s)) if s == "tanh" && key == "classifier_activation" => {
                Ok(Activation::Tanh)
            }
            Some(other) => bail!(
                "{key} {other} is not implemented for ModernBERT (only 'gelu', the erf form{}, is)",
                if key == "classifier_activation" {
                    ", and 'tanh'"
                } else {
                    ""
                }
            ),
        }
    };
    let hidden_size = usize_of("hidden_size")?;
    let num_heads = usize_of("num_attention_heads")?;
    if num_heads == 0 || !hidden_size.is_multiple_of(num_heads) {
        bail!("hidden_size {hidden_size} is not a whole number of {num_heads} attention heads");
    }
    let head_dim = hidden_size / num_heads;
    // The attention splits hidden_size by the heads; a head_dim that says
    // otherwise would give the rotary tables another width.
    if let Some(h) = v.get("head_dim").filter(|h| !h.is_null()) {
        if h.as_u64() != Some(head_dim as u64) {
            bail!("head_dim {h} differs from hidden_size / num_attention_heads = {head_dim}, which ModernBERT's attention uses");
        }
    }
    let num_layers = usize_of("num_hidden_layers")?;
    // Which layers are local: `layer_types`, else every
    // `global_attn_every_n_layers`-th layer from 0 is global.
    let local: Vec<bool> = match v.get("layer_types") {
        None | Some(Value::Null) => {
            let every = usize_or("global_attn_every_n_layers", 3)?;
            if every == 0 {
                bail!("global_attn_every_n_layers must be positive");
            }
            (0..num_layers).map(|i| i % every != 0).collect()
        }
        Some(Value::Array(types)) => {
            if types.len() != num_layers {
                bail!(
                    "layer_types names {} layers, num_hidden_layers is {num_layers}",
                    types.len()
                );
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(false),
                    Some("sliding_attention") => Ok(true),
                    _ => bail!("layer_types: {t} is not implemented for ModernBERT (only full_attention and sliding_attention are)"),
                })
                .collect::<Result<_>>()?
        }
        Some(other) => bail!("layer_types {other} must be a list"),
    };
    let local_attention = usize_or("local_attention", 128)?;
    let half = local_attention / 2;
    // transformers derives `sliding_window` from local_attention; one
    // given beside it must agree.
    if let Some(w) = v.get("sliding_window").filter(|w| !w.is_null()) {
        if w.as_u64() != Some(half as u64) {
            bail!("sliding_window {w} disagrees with local_attention {local_attention} (whose half, {half}, is the window)");
        }
    }
    // RoPE: `rope_parameters` per layer type, its bases falling back to
    // global_rope_theta and local_rope_theta as transformers fills them.
    if v.get("rope_scaling").is_some_and(|x| !x.is_null()) {
        bail!(
            "rope_scaling {} is not implemented for ModernBERT (only the default RoPE is)",
            v["rope_scaling"]
        );
    }
    let params = match v.get("rope_parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => Some(o),
        Some(other) => bail!("rope_parameters {other} must be an object"),
    };
    if let Some(o) = params {
        for k in o.keys() {
            if k != "full_attention" && k != "sliding_attention" {
                bail!("rope_parameters.{k} is not implemented for ModernBERT (only full_attention and sliding_attention, each with rope_type default and rope_theta)");
            }
        }
    }
    let theta = |layer_type: &str, flat_key: &str, default: f64| -> Result<f32> {
        let mut theta = None;
        if let Some(p) = params
            .and_then(|o| o.get(layer_type))
            .filter(|p| !p.is_null())
        {
            let p = p
                .as_object()
                .with_context(|| format!("rope_parameters.{layer_type} must be an object"))?;
            for (k, x) in p {
                match k.as_str() {
                    "rope_type" if x.as_str() == Some("default") => {}
                    "rope_theta" => {
                        theta = Some(x.as_f64().with_context(|| {
                            format!("rope_parameters.{layer_type}.rope_theta must be a number")
                        })?)
                    }
                    _ => bail!("rope_parameters.{layer_type}.{k} ({x}) is not implemented for ModernBERT (only rope_type default and rope_theta are)"),
                }
            }
        }
        let t = match theta {
            Some(t) => t,
            None => f64_of(flat_key)?.unwrap_or(default),
        };
        if !(t.is_finite() && t > 0.0) {
            bail!("the {layer_type} layers' RoPE base {t} must be a positive number");
        }
        Ok(t as f32)
    };
    let global_theta = theta("full_attention", "global_rope_theta", DEFAULT_GLOBAL_THETA)?;
    let local_theta = theta("sliding_attention", "local_rope_theta", DEFAULT_LOCAL_THETA)?;
    let norm_eps = f64_of("norm_eps")?.unwrap_or(1e-5) as f32;
    let num_labels = super::bert::num_labels(v, arch)?;
    let (classifier_bias, classifier_act) = if num_labels.is_some() {
        match v.get("classifier_pooling").and_then(Value::as_str) {
            None | Some("cls" | "mean") => {}
            Some(other) => bail!("classifier_pooling '{other}' is not implemented for ModernBERT (only cls and mean are)"),
        }
        (
            flag("classifier_bias", false)?,
            act_of("classifier_activation")?,
        )
    } else {
        (false, Activation::GeluErf)
    };
    let hidden_act = act_of("hidden_activation")?;
    let attention_bias = flag("attention_bias", false)?;
    let mlp_bias = flag("mlp_bias", false)?;
    let max_position_embeddings = usize_or("max_position_embeddings", 8192)?;
    let cfg = ModelConfig {
        arch: MODERNBERT,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads: num_heads,
        head_dim,
        intermediate_size: usize_of("intermediate_size")?,
        vocab_size: usize_of("vocab_size")?,
        rms_norm_eps: norm_eps,
        rope_theta: global_theta,
        rope_scaling: RopeScaling::None,
        rope_style: RopeStyle::Neox,
        max_position_embeddings,
        tie_word_embeddings: false,
        attention_bias,
        o_bias: attention_bias,
        mlp_bias,
        sliding_windows: Vec::new(),
        moe: None,
        mla: None,
        hybrid: None,
        hidden_act: crate::engine::config::Activation::Silu,
        gemma: None,
        gpt_oss: None,
        encoder: Some(EncoderConfig {
            layer_norm_eps: norm_eps,
            type_vocab_size: 0,
            position_offset: 0,
            position_rows: max_position_embeddings,
            num_labels,
            modernbert: Some(ModernBertConfig {
                norm_bias: flag("norm_bias", false)?,
                windows: local.into_iter().map(|l| l.then_some(half)).collect(),
                local_rope_theta: local_theta,
                hidden_act,
                classifier_bias,
                classifier_act,
            }),
        }),
    };
    cfg.validate()?;
    Ok(cfg)
}
