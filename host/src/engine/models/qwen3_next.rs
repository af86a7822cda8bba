//! The hybrid Qwen models: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
//! (transformers' `modeling_qwen3_next.py`, `modeling_qwen3_5.py`,
//! `modeling_qwen3_5_moe.py`). Pre-norm decoder layers whose token mixer is
//! either a Gated DeltaNet (`linear_attn`, linear attention with a
//! fixed-size recurrent state per sequence) or gated full attention
//! (`self_attn`), as `layer_types` says, then a dense SwiGLU MLP (Qwen3.5)
//! or a mixture of experts with a sigmoid-gated shared expert (Qwen3-Next
//! in the layers `decoder_sparse_step` and `mlp_only_layers` pick,
//! Qwen3.5-MoE in all). Every RMSNorm but the Gated DeltaNet's gated one
//! scales by `1 + w`.
//!
//! Only the attention layers keep K/V in the paged pool; the linear layers'
//! conv and delta-rule states sit in the [`StateCache`], one slot per
//! running sequence.

use super::layers::decoder::FeedForward;
use super::layers::gated_attention::{GatedAttention, GatedAttentionShape};
use super::layers::gated_delta_net::{GatedDeltaNet, GdnForm, GdnShape, RecurrentState};
use super::layers::mlp::GatedMlp;
use super::layers::moe::{hf_expert_names, MoeNames, SparseMoe};
use super::layers::{load_matrix, load_offset_norm, weight_bytes, Workspace};
use super::{CausalLm, StateCache};
use crate::engine::config::{
    Activation, Arch, GgufMeta, HybridConfig, ModelConfig, MoeConfig, MAX_LAYERS,
};
use crate::engine::loader::gguf::GgufFile;
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{GatedDeltaSpec, RopeScaling, RopeStyle, RopeTable, RouterScoring};
use pagoda_accel::{Backend, BackendError, DeviceMatrix, KvLayerSpec};

/// A layer's token mixer.
enum Mixer<B: Backend> {
    /// A Gated DeltaNet and the index of its state in the [`StateCache`].
    Linear(GatedDeltaNet<B>, usize),
    Attention(GatedAttention<B>),
}

struct HybridLayer<B: Backend> {
    /// `1 + input_layernorm.weight`.
    attn_norm: B::Vector,
    mixer: Mixer<B>,
    /// `1 + post_attention_layernorm.weight`.
    ffn_norm: B::Vector,
    ffn: FeedForward<B>,
}

impl<B: Backend> HybridLayer<B> {
    fn matrices(&self) -> Box<dyn Iterator<Item = &B::Matrix> + '_> {
        let mixer: Box<dyn Iterator<Item = &B::Matrix> + '_> = match &self.mixer {
            Mixer::Linear(l, _) => Box::new(l.matrices()),
            Mixer::Attention(a) => Box::new(a.matrices()),
        };
        Box::new(mixer.chain(self.ffn.matrices()))
    }
}

/// A loaded hybrid Qwen model.
pub struct QwenHybrid<B: Backend> {
    config: ModelConfig,
    embed: B::Matrix,
    lm_head: Option<B::Matrix>,
    layers: Vec<HybridLayer<B>>,
    /// `1 + model.norm.weight`.
    norm: B::Vector,
    /// RoPE over the rotary dimensions only.
    rope: B::Rope,
    /// The Gated DeltaNet layers' shape (all alike).
    gdn: GdnShape,
    prompt_kernel: bool,
    weight_type: &'static str,
}

/// Loads a Qwen3-Next, Qwen3.5 or Qwen3.5-MoE model (HF tensor names),
/// refusing it on a device without the linear-attention operations.
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<QwenHybrid<B>> {
    if !backend.supports_linear_attention() {
        bail!(
            "the model mixes Gated DeltaNet (linear-attention) layers into its attention, and this device has no linear-attention kernels yet ({}); serve it with --device cpu",
            backend.describe()
        );
    }
    let c = &config;
    let hybrid = c
        .hybrid
        .clone()
        .context("a hybrid Qwen config without its layer types")?;
    let form = match c.arch {
        Arch::Qwen3Next => GdnForm::Qwen3Next,
        Arch::Qwen35 | Arch::Qwen35Moe => GdnForm::Qwen35,
        other => bail!("{other:?} is not a hybrid Qwen architecture"),
    };
    let gdn = GdnShape {
        hidden: c.hidden_size,
        heads: GatedDeltaSpec {
            n_k_heads: hybrid.n_k_heads,
            n_v_heads: hybrid.n_v_heads,
            k_dim: hybrid.k_dim,
            v_dim: hybrid.v_dim,
        },
        conv_kernel: hybrid.conv_kernel,
        eps: c.rms_norm_eps,
    };
    let attn = GatedAttentionShape {
        hidden: c.hidden_size,
        n_heads: c.num_heads,
        n_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        rotary_dim: hybrid.rotary_dim,
        eps: c.rms_norm_eps,
    };
    let d = c.hidden_size;
    let (mut n_linear, mut n_attn) = (0, 0);
    let mut layers = Vec::with_capacity(c.num_layers);
    for (i, &linear) in hybrid.linear_layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let attn_norm = load_offset_norm(backend, source, &p("input_layernorm.weight"), d)?;
        let mixer = if linear {
            let l = GatedDeltaNet::load(backend, source, gdn, form, &p("linear_attn"))?;
            n_linear += 1;
            Mixer::Linear(l, n_linear - 1)
        } else {
            let a = GatedAttention::load(backend, source, attn, &p("self_attn"), n_attn)?;
            n_attn += 1;
            Mixer::Attention(a)
        };
        let ffn_norm = load_offset_norm(backend, source, &p("post_attention_layernorm.weight"), d)?;
        let sparse = c
            .moe
            .as_ref()
            .is_some_and(|m| m.sparse_layers.get(i).copied().unwrap_or(false));
        let ffn = match (&c.moe, sparse) {
            (Some(moe), true) => {
                let expert = hf_expert_names(p("mlp"));
                let names = MoeNames {
                    router: p("mlp.gate.weight"),
                    expert: &expert,
                    bias: None,
                    shared: moe.shared_ffn.map(|_| {
                        (
                            p("mlp.shared_expert"),
                            Some(p("mlp.shared_expert_gate.weight")),
                        )
                    }),
                };
                FeedForward::Moe(
                    SparseMoe::load(backend, source, c, moe, &names)
                        .with_context(|| format!("layer {i}'s experts"))?,
                )
            }
            _ => FeedForward::Dense(GatedMlp::load(
                backend,
                source,
                &p("mlp"),
                d,
                c.intermediate_size,
                false,
            )?),
        };
        layers.push(HybridLayer {
            attn_norm,
            mixer,
            ffn_norm,
            ffn,
        });
    }
    let upload = |name: &str, rows, cols| load_matrix(backend, source, name, rows, cols);
    let embed = upload("model.embed_tokens.weight", c.vocab_size, d)?;
    let lm_head = if c.tie_word_embeddings && !source.contains("lm_head.weight") {
        None
    } else {
        Some(upload("lm_head.weight", c.vocab_size, d)?)
    };
    let norm = load_offset_norm(backend, source, "model.norm.weight", d)?;
    let rope = backend.upload_rope(&RopeTable::new(
        hybrid.rotary_dim,
        c.rope_theta,
        max_positions,
        &RopeScaling::None,
        c.rope_style,
    ))?;
    let head = lm_head.as_ref().unwrap_or(&embed);
    let prompt_kernel = backend.has_prompt_kernel(head)
        || layers
            .iter()
            .any(|l| l.matrices().any(|m| backend.has_prompt_kernel(m)));
    let weight_type = layers
        .iter()
        .find_map(|l| match &l.mixer {
            Mixer::Attention(a) => a.matrices().last().map(|o| o.ty().name()),
            Mixer::Linear(..) => None,
        })
        .unwrap_or("none");
    Ok(QwenHybrid {
        config,
        embed,
        lm_head,
        layers,
        norm,
        rope,
        gdn,
        prompt_kernel,
        weight_type,
    })
}

impl<B: Backend> QwenHybrid<B> {
    fn num_linear(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| matches!(l.mixer, Mixer::Linear(..)))
            .count()
    }
}

impl<B: Backend> CausalLm<B> for QwenHybrid<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layers(&self) -> Vec<KvLayerSpec> {
        self.layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some(a.kv_spec()),
                Mixer::Linear(..) => None,
            })
            .collect()
    }

    fn state_bytes_per_seq(&self) -> usize {
        let per_layer =
            (self.gdn.conv_kernel - 1) * self.gdn.conv_dim() + self.gdn.heads.state_len();
        // The states are kept in f32 whatever the weights' type.
        self.num_linear() * per_layer * std::mem::size_of::<f32>()
    }

    fn alloc_state(&self, b: &mut B, slots: usize) -> Result<StateCache<B>> {
        let layers = (0..self.num_linear())
            .map(|_| RecurrentState::alloc(b, &self.gdn, slots))
            .collect::<Result<Vec<_>, _>>()
            .context("allocating the linear-attention layers' state")?;
        Ok(StateCache {
            layers,
            num_slots: slots,
            slots: Vec::new(),
        })
    }

    fn weight_bytes(&self) -> usize {
        weight_bytes(
            self.layers.iter().flat_map(|l| l.matrices()),
            &self.embed,
            self.lm_head.as_ref(),
        )
    }

    fn weight_type(&self) -> &'static str {
        self.weight_type
    }

    fn has_prompt_kernel(&self) -> bool {
        self.prompt_kernel
    }

    fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n_tokens: usize,
        n_logits: usize,
        kv: &mut B::Kv,
        state: &mut StateCache<B>,
        ws: &mut Workspace<B>,
    ) -> Result<(), BackendError> {
        let c = &self.config;
        let (d, n, eps) = (c.hidden_size, n_tokens, c.rms_norm_eps);
        b.reserve(&mut ws.x, n * d)?;
        b.reserve(&mut ws.h, n * d)?;
        b.embed(&self.embed, step, &mut ws.x);
        for layer in &self.layers {
            b.rms_norm(&ws.x, &layer.attn_norm, eps, n, d, &mut ws.h);
            match &layer.mixer {
                Mixer::Linear(l, i) => {
                    let Some(st) = state.layers.get_mut(*i) else {
                        return Err(BackendError::Device {
                            device: b.describe(),
                            what: "a linear-attention layer".into(),
                            detail: format!(
                                "no recurrent state for its layer {i} ({} allocated); the engine allocates it with the model",
                                state.layers.len()
                            ),
                        });
                    };
                    l.forward(
                        b,
                        step,
                        n,
                        &ws.h,
                        st,
                        &state.slots,
                        &mut ws.gdn,
                        &mut ws.proj,
                    )?;
                }
                Mixer::Attention(a) => a.forward(b, &self.rope, step, n, kv, ws)?,
            }
            b.add(&mut ws.x, &ws.proj, n * d);
            b.rms_norm(&ws.x, &layer.ffn_norm, eps, n, d, &mut ws.h);
            layer.ffn.forward(b, step, n, ws, None)?;
            b.add(&mut ws.x, &ws.proj, n * d);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        super::layers::decoder::final_logits(b, step, c, &self.norm, head, n_logits, ws)
    }
}

/// The hybrid Qwen models as llama.cpp's converter writes them
/// (`qwen3next`, `qwen35`, `qwen35moe`): the Gated DeltaNet's shape from
/// `ssm.group_count` (key heads), `ssm.time_step_rank` (value heads),
/// `ssm.state_size` (key head width), `ssm.inner_size` (all value
/// heads' width) and `ssm.conv_kernel`; the layer mix from
/// `attention.recurrent_layers` (else `full_attention_interval`); the
/// partial RoPE's width from `rope.dimension_count` and, for Qwen3.5,
/// its M-RoPE `rope.dimension_sections`, which text-only positions make
/// an ordinary RoPE (checked, as transformers' `mrope_section` is).
/// Multi-token-prediction layers (`nextn_predict_layers`) past the
/// model's own are left unread. The tensors' layout is undone by
/// [`crate::engine::loader::gguf_weights::GgufWeights`]. `arch` is
/// the member `name` is, as the registry gives it.
pub fn gguf_config(g: &GgufFile, name: &str, arch: Arch) -> Result<ModelConfig> {
    let m = GgufMeta::new(g, name);
    let hidden_size = m.req("embedding_length")?;
    let num_heads = m.req("attention.head_count")?;
    let num_kv_heads = m.opt("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = m.req("attention.key_length")?;
    if let Some(v) = m.opt("attention.value_length")? {
        if v != head_dim {
            bail!(
                "{} = {v} differs from {} = {head_dim}; the gated attention's values are as wide as its keys",
                m.key("attention.value_length"),
                m.key("attention.key_length")
            );
        }
    }
    let block_count = m.req("block_count")?;
    let mtp = m.opt("nextn_predict_layers")?.unwrap_or(0);
    let num_layers = block_count.checked_sub(mtp).with_context(|| {
        format!(
            "{} ({mtp}) is more than {} ({block_count})",
            m.key("nextn_predict_layers"),
            m.key("block_count")
        )
    })?;
    if num_layers > MAX_LAYERS {
        bail!(
            "{} = {num_layers} is beyond the supported maximum of {MAX_LAYERS}",
            m.key("block_count")
        );
    }
    let linear_layers = match g.get_bool_array(&m.key("attention.recurrent_layers"))? {
        Some(l) => {
            if l.len() != block_count {
                bail!(
                    "{} lists {} layers, but {} is {block_count}",
                    m.key("attention.recurrent_layers"),
                    l.len(),
                    m.key("block_count")
                );
            }
            l[..num_layers].to_vec()
        }
        None => {
            let every = m.opt("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                bail!("{} must be positive", m.key("full_attention_interval"));
            }
            (0..num_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    let n_k_heads = m.req("ssm.group_count")?;
    let n_v_heads = m.req("ssm.time_step_rank")?;
    let inner = m.req("ssm.inner_size")?;
    if n_k_heads == 0 || n_v_heads == 0 || !n_v_heads.is_multiple_of(n_k_heads) {
        bail!(
            "{} ({n_v_heads} value heads) must be a positive multiple of {} ({n_k_heads} key heads)",
            m.key("ssm.time_step_rank"),
            m.key("ssm.group_count")
        );
    }
    if !inner.is_multiple_of(n_v_heads) {
        bail!(
            "{} = {inner} is not a whole number of {n_v_heads} value heads",
            m.key("ssm.inner_size")
        );
    }
    let rotary_dim = m.req("rope.dimension_count")?;
    let hybrid = HybridConfig {
        linear_layers,
        n_k_heads,
        n_v_heads,
        k_dim: m.req("ssm.state_size")?,
        v_dim: inner / n_v_heads,
        conv_kernel: m.req("ssm.conv_kernel")?,
        rotary_dim,
    };
    if hybrid.conv_kernel < 2 || hybrid.conv_kernel > 64 {
        bail!(
            "{} = {} must be between 2 and 64",
            m.key("ssm.conv_kernel"),
            hybrid.conv_kernel
        );
    }
    for (k, x) in [
        ("ssm.time_step_rank", hybrid.n_v_heads),
        ("ssm.state_size", hybrid.k_dim),
        ("ssm.inner_size / ssm.time_step_rank", hybrid.v_dim),
    ] {
        if x == 0 || x > 1 << 12 {
            bail!("{} = {x} must be between 1 and {}", m.key(k), 1 << 12);
        }
    }
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
        bail!(
            "{} = {rotary_dim}: RoPE needs a positive even number of dimensions, at most the {head_dim} of a head",
            m.key("rope.dimension_count")
        );
    }
    match (arch, g.get_i32_array(&m.key("rope.dimension_sections"))?) {
        (_, None) => {}
        (Arch::Qwen35 | Arch::Qwen35Moe, Some(sec))
            if sec.iter().all(|&s| s >= 0)
                && sec.iter().map(|&s| s as usize).sum::<usize>() == rotary_dim / 2 => {}
        (_, Some(sec)) => bail!(
            "{} = {sec:?}: only M-RoPE sections of a Qwen3.5 model, summing to half the {rotary_dim} rotary dimensions, are supported",
            m.key("rope.dimension_sections")
        ),
    }
    match m.str("rope.scaling.type")? {
        None | Some("none") => {}
        Some(other) => bail!(
            "{} = '{other}': RoPE scaling on the partial RoPE of a hybrid Qwen model is not supported",
            m.key("rope.scaling.type")
        ),
    }
    if let Some(w) = m.opt("attention.sliding_window")?.filter(|&w| w > 0) {
        bail!(
            "{} = {w}: the hybrid Qwen models' attention layers attend over the whole context",
            m.key("attention.sliding_window")
        );
    }
    let experts = m.opt("expert_count")?.unwrap_or(0);
    let intermediate_size = match (arch, m.opt("feed_forward_length")?) {
        (_, Some(f)) => f,
        // Qwen3.5-MoE has no dense MLP: the experts' width stands in.
        (Arch::Qwen35Moe, None) => m.req("expert_feed_forward_length")?,
        (_, None) => m.req("feed_forward_length")?,
    };
    let moe = match arch {
        Arch::Qwen35 => {
            if experts > 0 {
                bail!(
                    "{} = {experts} in a dense Qwen3.5 model ('qwen35'); a mixture is 'qwen35moe'",
                    m.key("expert_count")
                );
            }
            None
        }
        _ => {
            let top_k = m.req("expert_used_count")?;
            if experts == 0 || experts > 1 << 12 {
                bail!(
                    "{} = {experts} must be between 1 and 4096",
                    m.key("expert_count")
                );
            }
            if top_k == 0 || top_k > experts {
                bail!(
                    "{} = {top_k} must be between 1 and {} ({experts})",
                    m.key("expert_used_count"),
                    m.key("expert_count")
                );
            }
            // llama.cpp builds both with softmax routing whose chosen
            // weights are renormalized, as transformers does.
            if let Some(f) = m.opt("expert_gating_func")?.filter(|&f| f != 1) {
                bail!(
                    "{} = {f}: these models route with softmax (1)",
                    m.key("expert_gating_func")
                );
            }
            if m.bool("expert_weights_norm")? == Some(false) {
                bail!(
                    "{} = false: these models renormalize the chosen experts' weights",
                    m.key("expert_weights_norm")
                );
            }
            if let Some(s) = m.f32("expert_weights_scale")?.filter(|&s| s != 1.0) {
                bail!(
                    "{} = {s}: these models do not scale the routed experts",
                    m.key("expert_weights_scale")
                );
            }
            Some(MoeConfig {
                n_experts: experts,
                top_k,
                normalize: true,
                expert_ffn: m.req("expert_feed_forward_length")?,
                shared_ffn: m
                    .opt("expert_shared_feed_forward_length")?
                    .filter(|&f| f > 0),
                // A layer is a mixture where the file has its router
                // (Qwen3-Next's `mlp_only_layers` are dense).
                sparse_layers: (0..num_layers)
                    .map(|i| m.has(&format!("blk.{i}.ffn_gate_inp.weight")))
                    .collect(),
                scoring: RouterScoring::Softmax,
                routed_scale: 1.0,
                groups: None,
                score_bias: false,
                shared_gated: true,
            })
        }
    };
    let vocab_size = m.vocab_size()?;
    let cfg = ModelConfig {
        arch,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        rms_norm_eps: m.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        rope_theta: m.f32("rope.freq_base")?.unwrap_or(10_000.0),
        rope_scaling: RopeScaling::None,
        rope_style: RopeStyle::Neox,
        max_position_embeddings: m.opt("context_length")?.unwrap_or(2048),
        tie_word_embeddings: !m.has("output.weight"),
        attention_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_windows: Vec::new(),
        moe,
        mla: None,
        hybrid: Some(hybrid),
        hidden_act: Activation::Silu,
        gemma: None,
        gpt_oss: None,
        encoder: None,
    };
    if let Some(t) = g
        .tensors()
        .iter()
        .find(|t| t.name.contains(".attn_") && t.name.ends_with(".bias"))
    {
        bail!(
            "tensor '{}': biases on the gated attention of a hybrid Qwen model are not supported",
            t.name
        );
    }
    cfg.validate()?;
    Ok(cfg)
}
