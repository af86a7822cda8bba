//! Model definitions: one [`CausalLm`] trait, one file per family, each
//! assembled from the blocks in [`layers`] and written against
//! `pagoda_accel`'s operations with no backend code inside (vLLM's
//! `model_executor/models`, llama.cpp's model graphs).
//!
//! | file | architectures |
//! |---|---|
//! | [`llama`] | `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` |
//! | [`qwen3`] | `Qwen3ForCausalLM` |
//! | [`mixtral`] | `MixtralForCausalLM` |
//! | [`qwen_moe`] | `Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM` |
//! | [`deepseek`] | `DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM` |
//! | [`qwen3_next`] | `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` |
//! | [`gemma3`] | `Gemma3ForCausalLM` |
//! | [`gpt_oss`] | `GptOssForCausalLM` |
//! | [`bert`] | `BertModel`, `BertForSequenceClassification`, `XLMRobertaModel`, `XLMRobertaForSequenceClassification` (encoders, served for pooling) |
//!
//! # Adding a family
//!
//! 1. Read its config in `engine/config.rs` (both transformers forms and
//!    GGUF metadata), implementing or refusing by name every key that
//!    changes the math, and give it an [`Arch`].
//! 2. Write `models/<family>.rs`: load each layer from [`layers`]' blocks
//!    (attention, MLP, mixture of experts, latent attention) under the
//!    checkpoint's tensor names, and hand them to a
//!    [`layers::decoder::DecoderStack`] (or implement [`CausalLm`] itself
//!    if the layer shape differs). A block the device lacks is refused at
//!    load through the backend's `supports_*` queries.
//! 3. Map its GGUF tensor names in `loader/gguf_weights.rs`.
//! 4. Add it to `scripts/make-fixtures.py` (weights, a float64 forward
//!    written from the published definition, GGUF) and to
//!    `host/tests/generated_fixtures.rs`.

pub mod bert;
pub mod deepseek;
pub mod gemma3;
pub mod gpt_oss;
pub mod layers;
pub mod llama;
pub mod mixtral;
pub mod qwen3;
pub mod qwen3_next;
pub mod qwen_moe;

use crate::engine::config::{Arch, ModelConfig};
use crate::engine::loader::WeightSource;
use anyhow::Result;
use pagoda_accel::{Backend, BackendError, KvLayerSpec};

pub use layers::Workspace;

/// The recurrent state of a hybrid model's linear-attention layers on the
/// device: one fixed-size state per slot and layer, where an attention
/// layer keeps K/V per token. The KV-cache manager decides which sequence
/// holds which slot ([`crate::engine::kv_cache::KvCacheManager::state_slot`]);
/// each step says which slot each of its sequences reads and updates.
/// Empty for a model without such layers.
pub struct StateCache<B: Backend> {
    /// Per linear-attention layer, in layer order.
    pub(crate) layers: Vec<layers::gated_delta_net::RecurrentState<B>>,
    /// Slots allocated in each layer.
    num_slots: usize,
    /// This step's slot for each of its sequences, in step order (see
    /// [`pagoda_accel::StepBatch::state_slots`]).
    pub slots: Vec<u32>,
}

impl<B: Backend> Default for StateCache<B> {
    fn default() -> Self {
        StateCache {
            layers: Vec::new(),
            num_slots: 0,
            slots: Vec::new(),
        }
    }
}

impl<B: Backend> StateCache<B> {
    /// Slots allocated per layer.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Copies slot `from` of `src` (a cache of the same model) into slot
    /// `to` of this one, in every layer: a snapshot before a step, or a
    /// snapshot put back.
    pub fn copy_slot(&mut self, b: &mut B, src: &StateCache<B>, from: u32, to: u32) {
        let (from, to) = (from as usize, to as usize);
        for (d, s) in self.layers.iter_mut().zip(&src.layers) {
            // Each buffer as one row of all its slots side by side.
            for (dst, src_buf, len) in [
                (&mut d.conv, &s.conv, s.conv_len),
                (&mut d.delta, &s.delta, s.delta_len),
            ] {
                b.copy_columns(
                    src_buf,
                    src.num_slots * len,
                    from * len,
                    dst,
                    self.num_slots * len,
                    to * len,
                    len,
                    1,
                );
            }
        }
    }
}

/// A causal language model loaded onto the device of `B`.
pub trait CausalLm<B: Backend>: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// What each layer keeps per token in the KV pool, in layer order. A
    /// hybrid model lists only its attention layers: its linear layers keep
    /// a state per sequence instead ([`CausalLm::state_bytes_per_seq`]).
    fn kv_layers(&self) -> Vec<KvLayerSpec>;
    /// Bytes of recurrent state one sequence holds across the model's
    /// linear-attention layers; 0 for a model without them.
    fn state_bytes_per_seq(&self) -> usize {
        0
    }
    /// The recurrent state of `slots` sequences on `b`'s device (empty for
    /// a model without linear layers).
    fn alloc_state(&self, b: &mut B, slots: usize) -> Result<StateCache<B>> {
        let _ = (b, slots);
        Ok(StateCache::default())
    }
    /// Sets how a pooling row's vector is made from its sequence's hidden
    /// states. A decoder leaves its last token's final-normed state in
    /// `ws.h` and takes only [`SeqPooling::Last`]; an encoder pools there
    /// whichever way it is set.
    fn set_pooling(&mut self, how: pagoda_accel::ops::SeqPooling) -> Result<()> {
        if how != pagoda_accel::ops::SeqPooling::Last {
            anyhow::bail!(
                "{how:?} pooling of a decoder model is not implemented (its runner pools the last token); use --pooler-config '{{\"pooling_type\": \"LAST\"}}'"
            );
        }
        Ok(())
    }
    /// Values per logit row the forward leaves in `ws.h` for pooling: the
    /// hidden size, or a classifier's number of labels.
    fn pooled_width(&self) -> usize {
        self.config().hidden_size
    }
    /// Runs one step, whose metadata `step` already holds on the device
    /// (`n_tokens` tokens, `n_logits` logit rows), and leaves the logits of
    /// the logit rows in `ws.logits` (`[n_logits, vocab]`), and their
    /// final-normed hidden states in `ws.h` (`[n_logits, hidden]`: what a
    /// pooling request's vector is made from). K/V of every token are
    /// written into `kv` at the step's slots; a hybrid model's linear
    /// layers read and update `state` at `state.slots`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n_tokens: usize,
        n_logits: usize,
        kv: &mut B::Kv,
        state: &mut StateCache<B>,
        ws: &mut Workspace<B>,
    ) -> Result<(), BackendError>;
    /// Bytes of weights held on the device.
    fn weight_bytes(&self) -> usize;
    /// The storage type of the layers' projections, for logs ("Q4_1").
    fn weight_type(&self) -> &'static str;
    /// Whether prompt rows can run on other kernels than generated rows on
    /// this device (see [`Backend::has_prompt_kernel`]).
    fn has_prompt_kernel(&self) -> bool;
    /// Makes room for `slots` LoRA adapters at once (`--max-loras`),
    /// their factors stored as `dtype` resolves beside this model's
    /// weights, or says why this model or device cannot take them.
    fn enable_lora(
        &mut self,
        backend: &B,
        slots: usize,
        dtype: crate::engine::lora::LoraDtype,
    ) -> Result<()>;
    /// Puts `adapter`'s factors in LoRA slot `slot` (or empties it): the
    /// tokens of the step whose slot it is get its deltas.
    fn set_lora(
        &mut self,
        backend: &B,
        slot: usize,
        adapter: Option<&crate::engine::lora::LoraAdapter>,
    ) -> Result<()>;
}

/// A loaded model of any family.
pub type Model<B> = Box<dyn CausalLm<B>>;

/// Builds the model `config` describes from `source` onto `backend`'s
/// device, checking every tensor's shape against the config.
/// `max_positions` bounds the RoPE table (the engine's `--max-model-len`).
pub fn load<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    config: ModelConfig,
    max_positions: usize,
) -> Result<Model<B>> {
    layers::decoder::check_context(backend, &config, max_positions)?;
    Ok(match config.arch {
        Arch::Llama | Arch::Qwen2 => Box::new(llama::load(backend, source, config, max_positions)?),
        Arch::Qwen3 => Box::new(qwen3::load(backend, source, config, max_positions)?),
        Arch::Mixtral => Box::new(mixtral::load(backend, source, config, max_positions)?),
        Arch::Deepseek => Box::new(deepseek::load(backend, source, config, max_positions)?),
        Arch::Qwen2Moe | Arch::Qwen3Moe => {
            Box::new(qwen_moe::load(backend, source, config, max_positions)?)
        }
        Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe => {
            Box::new(qwen3_next::load(backend, source, config, max_positions)?)
        }
        Arch::Gemma3 => Box::new(gemma3::load(backend, source, config, max_positions)?),
        Arch::GptOss => Box::new(gpt_oss::load(backend, source, config, max_positions)?),
        Arch::Bert => Box::new(bert::load(backend, source, config, max_positions)?),
    })
}
