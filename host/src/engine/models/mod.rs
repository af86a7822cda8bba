//! Model definitions: one [`CausalLm`] trait, one file per family, each
//! assembled from the blocks in [`layers`] and written against
//! `pagoda_accel`'s operations with no backend code inside (vLLM's
//! `model_executor/models`, llama.cpp's model graphs).
//!
//! Which file builds which architecture, and how each architecture's
//! config is read, is one table: [`registry::Architectures::TABLE`] (HF
//! and GGUF names, family id, config readers, loader). `pagoda models`
//! prints it.
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
//! | [`modernbert`] | `ModernBertModel`, `ModernBertForSequenceClassification` (encoders, served for pooling) |
//!
//! # Adding a family
//!
//! One new file, `models/<family>.rs` (with its `pub mod` line below, as
//! Rust declares every file), and one line in
//! [`registry::Architectures::TABLE`].
//!
//! The file holds:
//! - its family id, `pub const MINE: Arch = Arch::new("Mine");`
//!   ([`crate::engine::config::Arch`]; the ids of the families that
//!   predate the table are kept there);
//! - its config reading, as [`bert`] reads `config.json` and [`gemma3`]
//!   its GGUF metadata (through [`crate::engine::config::GgufMeta`]):
//!   both transformers forms and GGUF, implementing or refusing by name
//!   every key that changes the math, and ending in
//!   [`ModelConfig::validate`];
//! - its definition: each layer loaded from [`layers`]' blocks (attention,
//!   MLP, mixture of experts, latent attention, gated delta net) under the
//!   checkpoint's tensor names and handed to a
//!   [`layers::decoder::DecoderStack`], or its own [`CausalLm`] where the
//!   layer shape differs (LoRA is refused by default). A block the device
//!   lacks is refused at load through the backend's `supports_*` queries.
//!
//! The table's line names its HF `architectures` and `model_type`, its GGUF
//! `general.architecture`, the models it serves, the family id, the two
//! readers and `load`. Its tests: a fixture in `scripts/make-fixtures.py`
//! (weights, a float64 forward written from the published definition,
//! GGUF) checked in `host/tests/generated_fixtures.rs`.
//!
//! What the file does not hold yet: GGUF tensors that llama.cpp's
//! converter renames or rearranges beyond the Llama names are mapped in
//! `loader/gguf_weights.rs`.

pub mod bert;
pub mod deepseek;
pub mod gemma3;
pub mod gpt_oss;
pub mod layers;
pub mod llama;
pub mod mixtral;
pub mod modernbert;
pub mod qwen3;
pub mod qwen3_next;
pub mod qwen_moe;
pub mod registry;

use crate::engine::config::ModelConfig;
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
    /// weights, or says why this model or device cannot take them. A
    /// family that computes no adapter deltas keeps this refusal.
    fn enable_lora(
        &mut self,
        backend: &B,
        slots: usize,
        dtype: crate::engine::lora::LoraDtype,
    ) -> Result<()> {
        let _ = (backend, slots, dtype);
        anyhow::bail!(
            "LoRA adapters on {:?} models are not computed yet; serve this model without --enable-lora",
            self.config().arch
        )
    }
    /// Puts `adapter`'s factors in LoRA slot `slot` (or empties it): the
    /// tokens of the step whose slot it is get its deltas. Refused unless
    /// [`CausalLm::enable_lora`] made room.
    fn set_lora(
        &mut self,
        backend: &B,
        slot: usize,
        adapter: Option<&crate::engine::lora::LoraAdapter>,
    ) -> Result<()> {
        let _ = (backend, slot, adapter);
        anyhow::bail!("LoRA adapters are not enabled (--enable-lora)")
    }
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
    let entry = registry::entry::<B>(config.arch)?;
    (entry.load)(backend, source, config, max_positions)
}
