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
use super::layers::{load_matrix, load_offset_norm, Workspace};
use super::{CausalLm, StateCache};
use crate::engine::config::{Arch, ModelConfig};
use crate::engine::loader::WeightSource;
use crate::engine::lora::LoraAdapter;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{GatedDeltaSpec, RopeScaling, RopeTable};
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
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| l.matrices())
            .map(|m| m.size_bytes())
            .sum();
        layers + self.embed.size_bytes() + self.lm_head.as_ref().map_or(0, |h| h.size_bytes())
    }

    fn weight_type(&self) -> &'static str {
        self.weight_type
    }

    fn has_prompt_kernel(&self) -> bool {
        self.prompt_kernel
    }

    fn enable_lora(
        &mut self,
        _backend: &B,
        _slots: usize,
        _dtype: crate::engine::lora::LoraDtype,
    ) -> Result<()> {
        bail!("LoRA adapters on a hybrid (Gated DeltaNet) model are not computed yet; serve this model without --enable-lora")
    }

    fn set_lora(
        &mut self,
        _backend: &B,
        _slot: usize,
        _adapter: Option<&LoraAdapter>,
    ) -> Result<()> {
        bail!("LoRA adapters are not enabled (--enable-lora)")
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
