//! The pre-norm decoder stack every family here shares: embed, then per
//! layer `x += attn(norm(x))` and `x += ffn(norm(x))`, then a final norm
//! and the LM head on the rows that sample. A family's file decides what
//! each layer's attention and feed-forward block are.

use super::attention::AttentionParts;
use super::attention::SelfAttention;
use super::lora::LayerLora;
use super::mla::LatentAttention;
use super::mlp::GatedMlp;
use super::moe::SparseMoe;
use super::{load_matrix, load_vector, Workspace};
use crate::engine::config::{ModelConfig, MAX_CONTEXT};
use crate::engine::loader::WeightSource;
use crate::engine::lora::LoraAdapter;
use crate::engine::models::CausalLm;
use anyhow::{bail, Result};
use pagoda_accel::ops::RopeTable;
use pagoda_accel::{Backend, BackendError, DeviceMatrix, KvLayerSpec, Rows};

/// A layer's feed-forward block.
pub enum FeedForward<B: Backend> {
    Dense(GatedMlp<B>),
    Moe(SparseMoe<B>),
}

impl<B: Backend> FeedForward<B> {
    pub(crate) fn matrices(&self) -> Box<dyn Iterator<Item = &B::Matrix> + '_> {
        match self {
            FeedForward::Dense(m) => Box::new(m.matrices()),
            FeedForward::Moe(m) => m.matrices(),
        }
    }

    pub(crate) fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n: usize,
        ws: &mut Workspace<B>,
        lora: Option<&LayerLora<B>>,
    ) -> Result<(), BackendError> {
        match self {
            FeedForward::Dense(m) => m.forward(b, step, n, ws, lora),
            // Adapters on experts are refused when they load.
            FeedForward::Moe(m) => m.forward(b, step, n, ws),
        }
    }
}

/// A layer's attention block.
pub enum Attention<B: Backend> {
    /// Grouped-query attention over paged K/V.
    Gqa(SelfAttention<B>),
    /// DeepSeek's multi-head latent attention over latent rows.
    Latent(LatentAttention<B>),
}

impl<B: Backend> Attention<B> {
    fn kv_layer(&self) -> KvLayerSpec {
        match self {
            Attention::Gqa(a) => a.kv_layer(),
            Attention::Latent(a) => a.kv_layer(),
        }
    }

    fn matrices(&self) -> Box<dyn Iterator<Item = &B::Matrix> + '_> {
        match self {
            Attention::Gqa(a) => Box::new(a.matrices()),
            Attention::Latent(a) => a.matrices(),
        }
    }

    /// The output projection, whose type the logs report.
    fn output(&self) -> Option<&B::Matrix> {
        self.matrices().last()
    }

    fn forward(
        &self,
        b: &mut B,
        rope: &B::Rope,
        step: &B::Step,
        n: usize,
        kv: &mut B::Kv,
        ws: &mut Workspace<B>,
        lora: Option<&LayerLora<B>>,
    ) -> Result<(), BackendError> {
        match self {
            Attention::Gqa(a) => a.forward(b, rope, step, n, kv, ws, lora),
            // Adapters on latent attention are refused when they load.
            Attention::Latent(a) => a.forward(b, rope, step, n, kv, ws),
        }
    }
}

/// One decoder layer.
pub struct DecoderLayer<B: Backend> {
    pub attn_norm: B::Vector,
    pub attn: Attention<B>,
    pub ffn_norm: B::Vector,
    pub ffn: FeedForward<B>,
}

impl<B: Backend> DecoderLayer<B> {
    /// Loads layer `i`'s norms and attention with HF's names
    /// (`model.layers.N.input_layernorm`, `self_attn`,
    /// `post_attention_layernorm`), then the feed-forward block the family
    /// builds with `ffn` (in the checkpoint's order, so the first bad
    /// tensor is the one reported).
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        c: &ModelConfig,
        i: usize,
        parts: AttentionParts,
        max_positions: usize,
        ffn: impl FnOnce() -> Result<FeedForward<B>>,
    ) -> Result<DecoderLayer<B>> {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let vector = |name: &str| load_vector(backend, source, name, c.hidden_size);
        Ok(DecoderLayer {
            attn_norm: vector(&p("input_layernorm.weight"))?,
            attn: Attention::Gqa(SelfAttention::load(
                backend,
                source,
                c,
                i,
                &p("self_attn"),
                parts,
                max_positions,
            )?),
            ffn_norm: vector(&p("post_attention_layernorm.weight"))?,
            ffn: ffn()?,
        })
    }
}

/// A whole decoder-only model: what a family's file assembles.
pub struct DecoderStack<B: Backend> {
    config: ModelConfig,
    embed: B::Matrix,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<B::Matrix>,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Vector,
    rope: B::Rope,
    /// See [`CausalLm::has_prompt_kernel`]; fixed at load, since it
    /// depends only on the weights and the device.
    prompt_kernel: bool,
    weight_type: &'static str,
    /// Per layer, the LoRA adapters' device slots (empty without
    /// `--enable-lora`).
    lora: Vec<LayerLora<B>>,
}

/// Checks the context length a model is loaded for, and that the device
/// can honour the config's sliding windows within it.
pub fn check_context<B: Backend>(backend: &B, c: &ModelConfig, max_positions: usize) -> Result<()> {
    if max_positions == 0 || max_positions > MAX_CONTEXT {
        bail!("max_model_len {max_positions} must be between 1 and {MAX_CONTEXT}");
    }
    if c.moe.is_some() && !backend.supports_experts() {
        bail!(
            "the model is a mixture of experts, and this device has no expert kernels yet ({}); serve it with --device cpu",
            backend.describe()
        );
    }
    if c.mla.is_some() && !backend.supports_latent_attention() {
        bail!(
            "the model uses multi-head latent attention, and this device has no latent-attention kernels yet ({}); serve it with --device cpu",
            backend.describe()
        );
    }
    if let Some(w) = c.min_sliding_window() {
        if w < max_positions && !backend.supports_sliding_window() {
            bail!(
                "the model attends over a sliding window of {w} tokens, which a context of {max_positions} would exceed, and this device's attention has no sliding window yet; serve it on the CPU, or with --max-model-len {w} or less"
            );
        }
    }
    Ok(())
}

impl<B: Backend> DecoderStack<B> {
    /// Assembles the stack: loads the embedding, the final norm and the LM
    /// head with HF's names, and takes `layers` as the family built them.
    pub fn new(
        backend: &B,
        source: &dyn WeightSource,
        config: ModelConfig,
        layers: Vec<DecoderLayer<B>>,
        max_positions: usize,
    ) -> Result<DecoderStack<B>> {
        let c = &config;
        let d = c.hidden_size;
        let upload = |name: &str, rows, cols| load_matrix(backend, source, name, rows, cols);
        let embed = upload("model.embed_tokens.weight", c.vocab_size, d)?;
        let lm_head = if c.tie_word_embeddings && !source.contains("lm_head.weight") {
            None
        } else {
            Some(upload("lm_head.weight", c.vocab_size, d)?)
        };
        let norm = load_vector(backend, source, "model.norm.weight", d)?;
        let rope = backend.upload_rope(&RopeTable::new(
            c.head_dim,
            c.rope_theta,
            max_positions,
            &c.rope_scaling,
            c.rope_style,
        ))?;
        let head = lm_head.as_ref().unwrap_or(&embed);
        let prompt_kernel = backend.has_prompt_kernel(head)
            || layers.iter().any(|l| {
                l.attn
                    .matrices()
                    .chain(l.ffn.matrices())
                    .any(|m| backend.has_prompt_kernel(m))
            });
        let weight_type = layers
            .first()
            .and_then(|l| l.attn.output())
            .map_or("none", |o| o.ty().name());
        Ok(DecoderStack {
            config,
            embed,
            lm_head,
            layers,
            norm,
            rope,
            prompt_kernel,
            weight_type,
            lora: Vec::new(),
        })
    }
}

impl<B: Backend> CausalLm<B> for DecoderStack<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layers(&self) -> Vec<KvLayerSpec> {
        self.layers.iter().map(|l| l.attn.kv_layer()).collect()
    }

    fn weight_bytes(&self) -> usize {
        super::weight_bytes(
            self.layers
                .iter()
                .flat_map(|l| l.attn.matrices().chain(l.ffn.matrices())),
            &self.embed,
            self.lm_head.as_ref(),
        )
    }

    fn has_prompt_kernel(&self) -> bool {
        self.prompt_kernel
    }

    fn weight_type(&self) -> &'static str {
        self.weight_type
    }

    fn enable_lora(
        &mut self,
        backend: &B,
        slots: usize,
        dtype: crate::engine::lora::LoraDtype,
    ) -> Result<()> {
        if self.config.mla.is_some() {
            bail!("LoRA adapters on latent attention (DeepSeek) are not computed yet; serve this model without --enable-lora");
        }
        if !backend.supports_lora() {
            bail!(
                "this device has no LoRA kernels yet ({}); serve adapters with --device cpu",
                backend.describe()
            );
        }
        // "auto" follows the projections' storage (what vLLM calls the
        // model's dtype).
        let base = self
            .layers
            .first()
            .and_then(|l| l.attn.output())
            .map_or(pagoda_accel::GgmlType::F32, |o| o.ty());
        let ty = dtype.resolve(base);
        tracing::info!(
            "LoRA factors stored as {} (--lora-dtype {dtype:?}, base {})",
            ty.name(),
            base.name()
        );
        self.lora = (0..self.layers.len())
            .map(|i| LayerLora::new(i, slots, ty))
            .collect();
        Ok(())
    }

    fn set_lora(&mut self, backend: &B, slot: usize, adapter: Option<&LoraAdapter>) -> Result<()> {
        if self.lora.is_empty() {
            bail!("LoRA adapters are not enabled (--enable-lora)");
        }
        for l in &mut self.lora {
            l.set(backend, slot, adapter)?;
        }
        Ok(())
    }

    fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n_tokens: usize,
        n_logits: usize,
        kv: &mut B::Kv,
        _state: &mut crate::engine::models::StateCache<B>,
        ws: &mut Workspace<B>,
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (d, n, eps) = (c.hidden_size, n_tokens, c.rms_norm_eps);
        b.reserve(&mut ws.x, n * d)?;
        b.reserve(&mut ws.h, n * d)?;
        b.embed(&self.embed, step, &mut ws.x);
        for (i, layer) in self.layers.iter().enumerate() {
            let lora = self.lora.get(i);
            b.rms_norm(&ws.x, &layer.attn_norm, eps, n, d, &mut ws.h);
            layer.attn.forward(b, &self.rope, step, n, kv, ws, lora)?;
            b.add(&mut ws.x, &ws.proj, n * d);
            b.rms_norm(&ws.x, &layer.ffn_norm, eps, n, d, &mut ws.h);
            layer.ffn.forward(b, step, n, ws, lora)?;
            b.add(&mut ws.x, &ws.proj, n * d);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        final_logits(b, step, c, &self.norm, head, n_logits, ws)
    }
}

/// The model's tail: the logit rows of the step's hidden states `ws.x`,
/// final-normed into `ws.h` (`[n_logits, hidden]`, what a pooling row's
/// vector is read from) and projected by `head` into `ws.logits`. `ws.h`
/// must already hold the step's `n_tokens ≥ n_logits` rows.
pub fn final_logits<B: Backend>(
    b: &mut B,
    step: &B::Step,
    c: &ModelConfig,
    norm: &B::Vector,
    head: &B::Matrix,
    n_logits: usize,
    ws: &mut Workspace<B>,
) -> Result<(), BackendError> {
    let (r, d) = (n_logits, c.hidden_size);
    if r == 0 {
        return Ok(());
    }
    b.reserve(&mut ws.rows, r * d)?;
    b.reserve(&mut ws.logits, r * c.vocab_size)?;
    b.gather_logit_rows(&ws.x, d, step, &mut ws.rows);
    b.rms_norm(&ws.rows, norm, c.rms_norm_eps, r, d, &mut ws.h);
    b.matmul(head, &ws.h, r, &mut ws.logits, step, Rows::Logits);
    Ok(())
}
