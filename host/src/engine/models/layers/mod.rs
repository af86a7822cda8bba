//! The blocks family definitions are assembled from, as in vLLM's
//! `model_executor/layers`: each written once against
//! [`pagoda_accel::Backend`].

pub mod attention;
pub mod decoder;
pub mod gated_attention;
pub mod gated_delta_net;
pub mod lora;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod projection;

use crate::engine::loader::WeightSource;
use anyhow::{Context, Result};
use pagoda_accel::{Backend, DeviceMatrix};

/// Bytes a model's weights hold on the device: its layers' `matrices`,
/// the token embedding, and the LM head where it is not the embedding.
pub fn weight_bytes<'a, M: DeviceMatrix + 'a>(
    matrices: impl Iterator<Item = &'a M>,
    embed: &M,
    lm_head: Option<&M>,
) -> usize {
    matrices.map(|m| m.size_bytes()).sum::<usize>()
        + embed.size_bytes()
        + lm_head.map_or(0, |h| h.size_bytes())
}

/// Uploads the checkpoint's `[rows, cols]` matrix `name` to `backend`'s
/// device, in its storage type; errors name the tensor.
pub fn load_matrix<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<B::Matrix> {
    let m = source.matrix(name, rows, cols)?;
    backend
        .upload_matrix(&m)
        .with_context(|| format!("{}: tensor '{name}'", source.describe()))
}

/// Uploads the checkpoint's vector `name` (`len` values) as f32.
pub fn load_vector<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    name: &str,
    len: usize,
) -> Result<B::Vector> {
    Ok(backend.upload_vector(&source.vector(name, len)?)?)
}

/// Uploads the checkpoint's RMSNorm weight `name` as `1 + w`: the hybrid
/// Qwen models' norms (`Qwen3NextRMSNorm`) and Gemma's (`Gemma3RMSNorm`)
/// scale by `1 + w` (the weight is stored zero-centred), which is the plain
/// RMSNorm with the weight moved by one. In float32 `1 + w` rounds as
/// transformers' own `1.0 + self.weight.float()` does.
pub fn load_offset_norm<B: Backend>(
    backend: &B,
    source: &dyn WeightSource,
    name: &str,
    len: usize,
) -> Result<B::Vector> {
    let w: Vec<f32> = source
        .vector(name, len)?
        .into_iter()
        .map(|w| 1.0 + w)
        .collect();
    Ok(backend.upload_vector(&w)?)
}

/// Activation buffers reused across steps, so a warm step allocates
/// nothing. Each block grows what it uses ([`Backend::reserve`]).
pub struct Workspace<B: Backend> {
    /// The residual stream, `[tokens, hidden]`.
    pub(crate) x: B::Buffer,
    /// The normed residual a block reads.
    pub(crate) h: B::Buffer,
    pub(crate) qkv: B::Buffer,
    pub(crate) q: B::Buffer,
    pub(crate) k: B::Buffer,
    pub(crate) v: B::Buffer,
    /// Where the per-head q/k norms write, swapped with `q` / `k` after.
    pub(crate) normed: B::Buffer,
    pub(crate) attn: B::Buffer,
    /// A block's output, added into `x`.
    pub(crate) proj: B::Buffer,
    pub(crate) gate_up: B::Buffer,
    pub(crate) act: B::Buffer,
    pub(crate) split_tmp: B::Buffer,
    /// The logit rows' hidden states.
    pub(crate) rows: B::Buffer,
    /// The mixture-of-experts blocks' buffers.
    pub(crate) moe: moe::MoeWorkspace<B>,
    /// The latent attention's buffers.
    pub(crate) mla: mla::MlaWorkspace<B>,
    /// The rotated part of q or k under partial RoPE.
    pub(crate) rot: B::Buffer,
    /// The Gated DeltaNet layers' buffers.
    pub(crate) gdn: gated_delta_net::GdnWorkspace<B>,
    /// The logits of the step's logit rows.
    pub logits: B::Buffer,
}

impl<B: Backend> Default for Workspace<B> {
    fn default() -> Self {
        Workspace {
            x: Default::default(),
            h: Default::default(),
            qkv: Default::default(),
            q: Default::default(),
            k: Default::default(),
            v: Default::default(),
            normed: Default::default(),
            attn: Default::default(),
            proj: Default::default(),
            gate_up: Default::default(),
            act: Default::default(),
            split_tmp: Default::default(),
            rows: Default::default(),
            moe: Default::default(),
            mla: Default::default(),
            rot: Default::default(),
            gdn: Default::default(),
            logits: Default::default(),
        }
    }
}
