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

pub mod deepseek;
pub mod layers;
pub mod llama;
pub mod mixtral;
pub mod qwen3;
pub mod qwen_moe;

use crate::engine::config::{Arch, ModelConfig};
use crate::engine::loader::WeightSource;
use anyhow::Result;
use pagoda_accel::{Backend, BackendError, KvLayerSpec};

pub use layers::Workspace;

/// A causal language model loaded onto the device of `B`.
pub trait CausalLm<B: Backend>: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// What each layer keeps per token in the KV pool, in layer order.
    fn kv_layers(&self) -> Vec<KvLayerSpec>;
    /// Runs one step, whose metadata `step` already holds on the device
    /// (`n_tokens` tokens, `n_logits` logit rows), and leaves the logits of
    /// the logit rows in `ws.logits` (`[n_logits, vocab]`), and their
    /// final-normed hidden states in `ws.h` (`[n_logits, hidden]`: what a
    /// pooling request's vector is made from). K/V of every token are
    /// written into `kv` at the step's slots.
    fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n_tokens: usize,
        n_logits: usize,
        kv: &mut B::Kv,
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
    })
}
