//! The op-level backend abstraction: what a device must do to run Pagoda's
//! models, stated as operations over buffers that live on the device.
//!
//! The model definitions (in the host crate) are written once against
//! [`Backend`]; each device implements it. The shape follows the ggml
//! backend API and the operator libraries accelerators ship (Ascend's
//! aclnn takes the same block tables and sequence lengths as a CUDA
//! paged-attention kernel), which is why the abstraction sits at the level
//! of operations (RMSNorm, RoPE, paged attention, …) and not kernel
//! launches:
//!
//! - weights cross to the device once, at load ([`Backend::upload_matrix`],
//!   from a [`HostMatrix`] in GGUF's block layout, whatever the file format);
//! - the KV pool is allocated on the device once ([`Backend::alloc_kv`]);
//! - each step, its metadata crosses once as flat arrays
//!   ([`Backend::upload_step`] of a [`StepBatch`]: tokens, positions, slot
//!   mapping, block tables, sequence starts and lengths);
//! - the forward pass is a sequence of operations on device buffers;
//! - sampling runs where the logits are ([`Backend::sample`]): only the
//!   sampled ids and the logprobs asked for come back; rows sampled on the
//!   host (drafts to verify, prompt logprobs) are read back with
//!   [`Backend::to_host`].
//!
//! Operations are recorded in order on the backend's one queue (the CPU runs
//! them at once; a GPU backend enqueues them on its stream). Shapes are
//! passed explicitly: a buffer may be larger than an operation uses, since
//! buffers only grow ([`Backend::reserve`]), so a warm step allocates
//! nothing. Shape errors are bugs in the caller and panic; device faults
//! (a failed launch, an out-of-memory) surface as a [`BackendError`] from
//! the next call that returns a `Result`, at the latest from `to_host`.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::ops::sample::{SampledRows, SamplingMetadata};
use crate::ops::{ConvSpec, GatedDeltaSpec, KvDtype, KvLayout, RopeTable};
use crate::quant::{Affine, GgmlType, WeightError};
use std::borrow::Cow;

pub use cpu::CpuBackend;
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;

/// Why a backend operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A weight's bytes do not fit its declared type and shape.
    #[error(transparent)]
    Weight(#[from] WeightError),
    /// The device could not allocate what was asked.
    #[error("{device}: out of device memory allocating {bytes} bytes for {what}")]
    OutOfMemory {
        device: String,
        what: &'static str,
        bytes: usize,
    },
    /// The backend cannot hold this weight type.
    #[error("{device}: weights of type {ty} are not supported on this device{hint}")]
    Unsupported {
        device: String,
        ty: GgmlType,
        hint: &'static str,
    },
    /// The backend cannot hold a KV pool of this shape.
    #[error("{device}: {detail}")]
    UnsupportedKv { device: String, detail: String },
    /// A device call failed (a launch, a copy, a library call).
    #[error("{device}: {what} failed: {detail}")]
    Device {
        device: String,
        what: String,
        detail: String,
    },
    /// The backend has no kernel for this operation.
    #[error("{device}: the {op} operation is not implemented on this device")]
    UnsupportedOp { device: String, op: &'static str },
}

/// A weight matrix in host memory, `[rows = out_features, cols =
/// in_features]`, in GGUF's layout for its type: row-major, each row
/// `cols / block_len` little-endian blocks (plain elements for the float
/// types). Loaders produce this whatever the file format; each backend lays
/// it out for its own kernels when it uploads it.
#[derive(Clone, Debug)]
pub struct HostMatrix<'a> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Cow<'a, [u8]>,
    /// The checkpoint scheme's transforms around the blocks (see
    /// [`crate::quant::affine`]); `None` for GGUF and dense tensors.
    affine: Option<Box<Affine>>,
    /// MXFP4 only: multiply with f32 activations (Hugging Face
    /// checkpoints) rather than 8-bit ones (GGUF, as llama.cpp); see
    /// [`crate::quant::mxfp4`].
    f32_act: bool,
}

impl<'a> HostMatrix<'a> {
    /// Wraps `data` (borrowed from a mapped file, or owned), checking its
    /// length against the type and shape.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<HostMatrix<'a>, WeightError> {
        let data = data.into();
        let expected = rows
            .checked_mul(ty.row_bytes(cols)?)
            .ok_or(WeightError::TooLarge { rows, cols })?;
        if data.len() != expected {
            return Err(WeightError::WrongLength {
                ty,
                rows,
                cols,
                expected,
                got: data.len(),
                unit: "bytes",
            });
        }
        Ok(HostMatrix {
            ty,
            rows,
            cols,
            data,
            affine: None,
            f32_act: false,
        })
    }

    /// With `on`, for MXFP4 blocks from a Hugging Face checkpoint: the
    /// product keeps the activations in f32, exact against the decoded
    /// values up to summation order, rather than quantizing them to 8 bits
    /// as llama.cpp does for GGUF files (see [`crate::quant::mxfp4`]).
    /// Other types ignore it.
    pub fn with_f32_activations(mut self, on: bool) -> HostMatrix<'a> {
        self.f32_act = on && self.ty == GgmlType::MXFP4;
        self
    }

    /// Whether [`HostMatrix::with_f32_activations`] applies.
    pub fn f32_activations(&self) -> bool {
        self.f32_act
    }

    /// Wraps the blocks in `affine`, checked against the shape; an identity
    /// transform is dropped.
    pub fn with_affine(mut self, affine: Affine) -> Result<HostMatrix<'a>, WeightError> {
        affine.check(self.rows, self.cols)?;
        self.affine = (!affine.is_identity()).then(|| Box::new(affine));
        Ok(self)
    }

    /// The transforms around the blocks, if any.
    pub fn affine(&self) -> Option<&Affine> {
        self.affine.as_deref()
    }

    /// An F32 matrix from row-major values.
    pub fn from_f32(
        rows: usize,
        cols: usize,
        values: &[f32],
    ) -> Result<HostMatrix<'static>, WeightError> {
        HostMatrix::new(
            GgmlType::F32,
            rows,
            cols,
            bytemuck::cast_slice::<f32, u8>(values).to_vec(),
        )
    }

    /// Converts row-major f32 values to a matrix of type `ty`: F32, F16 or
    /// BF16 (rounding to nearest even), or Q8_0, Q4_0 or Q4_1 (ggml's
    /// round-to-nearest quantizers).
    pub fn from_f32_as(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        values: &[f32],
    ) -> Result<HostMatrix<'static>, WeightError> {
        let expected = rows
            .checked_mul(cols)
            .ok_or(WeightError::TooLarge { rows, cols })?;
        if values.len() != expected {
            return Err(WeightError::WrongLength {
                ty,
                rows,
                cols,
                expected,
                got: values.len(),
                unit: "elements",
            });
        }
        let bytes: Vec<u8> = match ty {
            GgmlType::F32 => bytemuck::cast_slice::<f32, u8>(values).to_vec(),
            GgmlType::F16 => values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            GgmlType::BF16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let row_bytes = ty.row_bytes(cols)?;
                let mut bytes = vec![0u8; rows * row_bytes];
                if cols > 0 {
                    for (src, dst) in values
                        .chunks_exact(cols)
                        .zip(bytes.chunks_exact_mut(row_bytes))
                    {
                        crate::quant::formats::quantize_row(ty, src, dst);
                    }
                }
                bytes
            }
            other => return Err(WeightError::QuantizeUnsupported(other)),
        };
        HostMatrix::new(ty, rows, cols, bytes)
    }

    /// All values as row-major f32 (dequantized), for loaders that convert
    /// types.
    pub fn dequantize(&self) -> Result<Vec<f32>, WeightError> {
        let w = crate::Weight::from_raw(self.ty, self.rows, self.cols, &self.data)?
            .with_affine(self.affine().cloned())?;
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols > 0 {
            for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
                w.dequantize_row(r, row);
            }
        }
        Ok(out)
    }

    /// The storage type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The raw bytes, in GGUF's layout for [`HostMatrix::ty`].
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Stacks matrices of one type and column count along rows (the fused
    /// q|k|v and gate|up projections). Rows are whole blocks in GGUF's
    /// layout, so stacking is concatenating the bytes.
    pub fn concat_rows(parts: &[HostMatrix<'_>]) -> Result<HostMatrix<'static>, WeightError> {
        let first = parts.first().ok_or(WeightError::ConcatEmpty)?;
        for (index, p) in parts.iter().enumerate() {
            if p.ty != first.ty || p.cols != first.cols {
                return Err(WeightError::ConcatMismatch {
                    index,
                    ty: first.ty,
                    cols: first.cols,
                    got_ty: p.ty,
                    got_cols: p.cols,
                });
            }
        }
        let affine = HostMatrix::concat_affine(parts)?;
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        let m = HostMatrix::new(first.ty, rows, first.cols, data)?;
        match affine {
            Some(a) => m.with_affine(a),
            None => Ok(m),
        }
    }

    /// Whether [`HostMatrix::concat_rows`] can stack `parts`: one type, one
    /// column count, and inputs read the same way.
    pub fn can_concat(parts: &[HostMatrix<'_>]) -> bool {
        parts.first().is_some_and(|first| {
            parts
                .iter()
                .all(|p| p.ty == first.ty && p.cols == first.cols)
                && HostMatrix::concat_affine(parts).is_ok()
        })
    }

    fn concat_affine(parts: &[HostMatrix<'_>]) -> Result<Option<Affine>, WeightError> {
        let sides: Vec<_> = parts.iter().map(|p| (p.affine(), p.rows)).collect();
        Affine::concat(&sides).ok_or_else(|| {
            let index = parts
                .iter()
                .position(|p| {
                    let a = p.affine().cloned().unwrap_or_default();
                    let b = parts[0].affine().cloned().unwrap_or_default();
                    a.in_perm != b.in_perm || a.act_quant != b.act_quant
                })
                .unwrap_or(0);
            WeightError::ConcatAffineMismatch { index }
        })
    }
}

/// What every backend's weight matrix tells about itself.
pub trait DeviceMatrix: Send + Sync {
    /// The storage type it was uploaded from.
    fn ty(&self) -> GgmlType;
    /// Rows (output features).
    fn rows(&self) -> usize;
    /// Columns (input features).
    fn cols(&self) -> usize;
    /// Bytes it occupies on the device (what a matmul streams).
    fn size_bytes(&self) -> usize;
}

/// One sequence of a [`StepBatch`], as offsets into the batch's arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSeq {
    /// First of this sequence's tokens in [`StepBatch::tokens`].
    pub q_start: u32,
    /// Its tokens in this step.
    pub q_len: u32,
    /// Tokens in the cache once this step's are written.
    pub ctx_len: u32,
    /// First of its block ids in [`StepBatch::block_tables`].
    pub table_start: u32,
    /// Its block ids (enough for `ctx_len` positions).
    pub table_len: u32,
}

/// One step's metadata, the flat arrays that cross to the device once per
/// step. The scheduler fills it; the backend uploads it
/// ([`Backend::upload_step`]); every operation of the step reads it there.
/// Cleared and refilled each step, so its vectors keep their capacity.
#[derive(Clone, Debug, Default)]
pub struct StepBatch {
    /// The tokens to run, all sequences back to back.
    pub tokens: Vec<u32>,
    /// Each token's position in its sequence.
    pub positions: Vec<u32>,
    /// Each token's KV slot: `block * block_size + offset`.
    pub slot_mapping: Vec<u32>,
    /// Per token: whether it is a prompt position of a sequence that runs
    /// its prompt on the backend's prompt kernel, if it has one (see
    /// [`Backend::has_prompt_kernel`]). A backend without one ignores it.
    pub prompt_rows: Vec<bool>,
    /// The sequences, in the order their tokens appear.
    pub seqs: Vec<StepSeq>,
    /// Every sequence's block table, back to back.
    pub block_tables: Vec<u32>,
    /// Indices into `tokens` whose next-token logits are wanted.
    pub logit_rows: Vec<u32>,
    /// Per token: the LoRA slot of its request's adapter
    /// ([`Backend::lora_add`]), [`NO_LORA`] for the base model. Empty when
    /// no token of the step has an adapter.
    pub lora_slots: Vec<u16>,
    /// Per sequence, in [`StepBatch::seqs`]' order: its recurrent-state
    /// slot (the linear-attention layers of a hybrid model; see
    /// [`Backend::causal_conv1d`]). Filled by the engine's runner for
    /// every step; models without such layers ignore it.
    pub state_slots: Vec<u32>,
}

/// The [`StepBatch::lora_slots`] entry of a token without an adapter.
pub const NO_LORA: u16 = u16::MAX;

/// One LoRA adapter's factors for one projection, on the device:
/// `out += scale · B (A x)`. Both are dense matrices (F32, BF16 or F16:
/// vLLM's `--lora-dtype`) uploaded with [`Backend::upload_matrix`].
#[derive(Clone, Debug)]
pub struct DeviceLora<M> {
    /// `A`: `rank` rows of `in` columns.
    pub a: M,
    /// `Bᵀ`: `rank` rows of `out` columns, so that the expansion runs
    /// along contiguous rows.
    pub b: M,
    pub rank: usize,
    /// `lora_alpha / r` (or `/ √r`).
    pub scale: f32,
}

/// The adapters of one logical projection inside a matmul's output: the
/// slots' factors (as [`Backend::lora_add`] takes them) and the output
/// columns `col..col + out_dim` they add to.
#[derive(Clone, Copy, Debug)]
pub struct LoraSlice<'a, M> {
    pub slots: &'a [Option<DeviceLora<M>>],
    pub col: usize,
    pub out_dim: usize,
}

impl StepBatch {
    /// Empties the batch, keeping its capacity.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.prompt_rows.clear();
        self.seqs.clear();
        self.block_tables.clear();
        self.logit_rows.clear();
        self.lora_slots.clear();
        self.state_slots.clear();
    }

    /// Makes `self` a copy of `other`, reusing its vectors' capacity (a
    /// derived `clone_from` would allocate anew), so a warm step's upload to
    /// a host-memory backend allocates nothing.
    pub fn copy_from(&mut self, other: &StepBatch) {
        self.tokens.clone_from(&other.tokens);
        self.positions.clone_from(&other.positions);
        self.slot_mapping.clone_from(&other.slot_mapping);
        self.prompt_rows.clone_from(&other.prompt_rows);
        self.seqs.clone_from(&other.seqs);
        self.block_tables.clone_from(&other.block_tables);
        self.logit_rows.clone_from(&other.logit_rows);
        self.lora_slots.clone_from(&other.lora_slots);
        self.state_slots.clone_from(&other.state_slots);
    }

    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Appends one sequence's share of the step: its tokens `tokens` at
    /// positions `start..start + tokens.len()`, read through `table` (its
    /// whole block table) with blocks of `block_size` positions. The first
    /// `prompt_kernel_until` positions are flagged for the prompt kernel.
    /// The last `logit_rows` of its tokens want their next-token logits:
    /// 1 for a sequence that samples, 0 for a prompt chunk that does not,
    /// more for a prompt whose own log-probabilities were asked for.
    ///
    /// # Panics
    /// If `table` is too short for the new positions.
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        start: usize,
        table: &[u32],
        block_size: usize,
        prompt_kernel_until: usize,
        logit_rows: usize,
    ) {
        let q_start = self.tokens.len();
        let ctx_len = start + tokens.len();
        assert!(
            table.len() * block_size >= ctx_len,
            "push_seq: {} blocks of {block_size} cannot hold {ctx_len} positions",
            table.len()
        );
        for (i, &t) in tokens.iter().enumerate() {
            let p = start + i;
            self.tokens.push(t);
            self.positions.push(p as u32);
            self.slot_mapping
                .push(table[p / block_size] * block_size as u32 + (p % block_size) as u32);
            self.prompt_rows.push(p < prompt_kernel_until);
        }
        let end = self.tokens.len();
        let first = end - logit_rows.min(tokens.len());
        self.logit_rows.extend((first..end).map(|r| r as u32));
        self.seqs.push(StepSeq {
            q_start: q_start as u32,
            q_len: tokens.len() as u32,
            ctx_len: ctx_len as u32,
            table_start: self.block_tables.len() as u32,
            table_len: table.len() as u32,
        });
        self.block_tables.extend_from_slice(table);
    }

    /// The block table of sequence `s`.
    pub fn block_table(&self, s: &StepSeq) -> &[u32] {
        &self.block_tables[s.table_start as usize..(s.table_start + s.table_len) as usize]
    }
}

/// What one layer keeps per token in the KV pool: `n_kv_heads` heads, each a
/// K of `k_head_dim` and a V of `v_head_dim` elements. Layers may differ (a
/// model can mix attention kinds), which is why the pool is described layer
/// by layer. A latent layer (MLA) is one head of `k_head_dim` and no V
/// ([`KvLayerSpec::latent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayerSpec {
    pub n_kv_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
}

impl KvLayerSpec {
    /// A layer whose K and V heads are alike (`head_dim` each).
    pub fn symmetric(n_kv_heads: usize, head_dim: usize) -> KvLayerSpec {
        KvLayerSpec {
            n_kv_heads,
            k_head_dim: head_dim,
            v_head_dim: head_dim,
        }
    }

    /// An MLA layer: one latent row of `width` values per token, which
    /// serves as both key and value ([`Backend::latent_attention`]).
    pub fn latent(width: usize) -> KvLayerSpec {
        KvLayerSpec {
            n_kv_heads: 1,
            k_head_dim: width,
            v_head_dim: 0,
        }
    }

    /// Whether this is a latent (MLA) layer.
    pub fn is_latent(&self) -> bool {
        self.v_head_dim == 0 && self.n_kv_heads == 1
    }

    /// Elements one token takes in this layer, K and V together.
    pub fn elems_per_token(&self) -> usize {
        self.n_kv_heads * (self.k_head_dim + self.v_head_dim)
    }
}

/// The shape of a KV pool: `num_blocks` blocks of `block_size` token slots,
/// shared by every layer (a block id means the same tokens in each), and
/// per layer what a slot holds, in `dtype`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSpec {
    pub dtype: KvDtype,
    pub num_blocks: usize,
    pub block_size: usize,
    pub layers: Vec<KvLayerSpec>,
}

impl KvSpec {
    /// Bytes one block takes across all layers, K and V.
    pub fn bytes_per_block(&self) -> usize {
        let per_token: usize = self.layers.iter().map(KvLayerSpec::elems_per_token).sum();
        per_token * self.block_size * self.dtype.size()
    }

    /// Bytes one token takes across all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        self.layers
            .iter()
            .map(KvLayerSpec::elems_per_token)
            .sum::<usize>()
            * self.dtype.size()
    }

    /// The K (and V) cache layout of layer `i`, for backends whose caches
    /// hold K and V heads of one width; `None` when they differ.
    pub fn symmetric_layout(&self, i: usize) -> Option<KvLayout> {
        let l = self.layers.get(i)?;
        (l.k_head_dim == l.v_head_dim).then_some(KvLayout {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            n_kv_heads: l.n_kv_heads,
            head_dim: l.k_head_dim,
        })
    }
}

/// Which rows a matmul runs on, for backends whose kernel may depend on it
/// (the CPU's prompt kernel): the step's tokens, or its logit rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// One row per token of the step, in order.
    Tokens,
    /// One row per entry of [`StepBatch::logit_rows`], in order.
    Logits,
}

/// A device that runs Pagoda's models: the operations a Llama-family
/// forward pass needs, over buffers of the device's own.
///
/// Activations are f32, row-major `[rows, width]` in [`Backend::Buffer`]s.
/// Every operation takes its shape explicitly and touches only the first
/// `rows × width` elements of its buffers.
pub trait Backend: Send + 'static {
    /// A weight matrix laid out for this device's kernels.
    type Matrix: DeviceMatrix;
    /// An f32 vector (norm weights, biases).
    type Vector: Send + Sync;
    /// An f32 activation buffer; grows with [`Backend::reserve`].
    type Buffer: Default + Send;
    /// The K/V tensors of every layer.
    type Kv: Send;
    /// The cos/sin table of rotary embeddings.
    type Rope: Send + Sync;
    /// One step's metadata as the device holds it.
    type Step: Default + Send;
    /// One step's expert routing as the device holds it (see
    /// [`Backend::route_experts`]).
    type Routes: Default + Send;

    /// A one-line description for logs ("cpu: 2 threads, AVX-512 VNNI").
    fn describe(&self) -> String;

    /// Lays a host matrix out for this device and copies it there.
    fn upload_matrix(&self, m: &HostMatrix<'_>) -> Result<Self::Matrix, BackendError>;
    /// Copies an f32 vector to the device.
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Vector, BackendError>;
    /// Copies a rotary table to the device.
    fn upload_rope(&self, table: &RopeTable) -> Result<Self::Rope, BackendError>;
    /// Allocates a zeroed KV pool.
    fn alloc_kv(&self, spec: &KvSpec) -> Result<Self::Kv, BackendError>;
    /// Whether rows flagged in [`StepBatch::prompt_rows`] may run on other
    /// kernels than the rest for this matrix (and so compute slightly
    /// different numbers). The engine then fixes per sequence, at
    /// admission, whether its prompt runs there, so a sequence computes the
    /// same numbers alone, batched, chunked or recomputed.
    fn has_prompt_kernel(&self, _m: &Self::Matrix) -> bool {
        false
    }
    /// Whether [`Backend::attention`] takes a sliding window. A model with
    /// windows shorter than its context is refused on backends without.
    fn supports_sliding_window(&self) -> bool {
        false
    }
    /// Whether [`Backend::attention`] takes a sink logit per head. A model
    /// with attention sinks (GPT-OSS) is refused at load on backends
    /// without.
    fn supports_attention_sinks(&self) -> bool {
        false
    }
    /// Whether the mixture-of-experts operations ([`Backend::route_experts`]
    /// and the four after it) run here. A MoE model is refused at load on
    /// a backend without them, so they are never called there.
    fn supports_experts(&self) -> bool {
        false
    }
    /// Whether the latent-attention operations ([`Backend::write_latent`],
    /// [`Backend::latent_attention`], [`Backend::matmul_heads`]) run here,
    /// and the KV pool takes latent layers. An MLA model is refused at load
    /// on a backend without them, so they are never called there.
    fn supports_latent_attention(&self) -> bool {
        false
    }
    /// Whether [`Backend::lora_add`] is implemented. The engine refuses
    /// `--enable-lora` on a backend without it, so it is never called there.
    fn supports_lora(&self) -> bool {
        false
    }
    /// Whether the recurrent-layer operations ([`Backend::causal_conv1d`],
    /// [`Backend::gated_delta_rule`], [`Backend::rms_norm_gated`],
    /// [`Backend::mul_sigmoid`]) run
    /// here. A hybrid linear-attention model (Qwen3-Next, Qwen3.5) is
    /// refused at load on a backend without them; should one be called
    /// anyway, it returns [`BackendError::UnsupportedOp`].
    fn supports_linear_attention(&self) -> bool {
        false
    }
    /// Whether Gemma's operations ([`Backend::gelu_tanh_mul`],
    /// [`Backend::scale`], [`Backend::softcap`]) run here. A model that
    /// needs them is refused at load on a backend without; should one be
    /// called anyway, it returns [`BackendError::UnsupportedOp`].
    fn supports_gemma_ops(&self) -> bool {
        false
    }
    /// Whether the encoder operations ([`Backend::encoder_embed`],
    /// [`Backend::layer_norm`], [`Backend::activation`], [`Backend::act_mul`],
    /// [`Backend::bidirectional_attention`], [`Backend::pool_seqs`]) run
    /// here. An encoder model (BERT) is refused at load on a backend
    /// without them; should one be called anyway, it returns
    /// [`BackendError::UnsupportedOp`].
    fn supports_encoder(&self) -> bool {
        false
    }
    /// Free and total bytes of the device's own memory, for devices that
    /// have one (the engine then sizes the KV pool from
    /// `--gpu-memory-utilization` after a profile forward); `None` for the
    /// CPU, whose pool is sized by `--kv-cache-memory`.
    fn memory_info(&self) -> Result<Option<(usize, usize)>, BackendError> {
        Ok(None)
    }

    /// Grows `buf` to hold at least `len` elements (never shrinks).
    fn reserve(&mut self, buf: &mut Self::Buffer, len: usize) -> Result<(), BackendError>;
    /// Copies one step's metadata to the device.
    fn upload_step(&mut self, batch: &StepBatch, step: &mut Self::Step)
        -> Result<(), BackendError>;
    /// Waits for the queued operations and returns the first `len` values
    /// of `buf` in host memory.
    fn to_host<'a>(
        &'a mut self,
        buf: &'a mut Self::Buffer,
        len: usize,
    ) -> Result<&'a mut [f32], BackendError>;

    /// `out[t] = table[step.tokens[t]]` for every token of the step
    /// (`out: [tokens, table.cols()]`).
    fn embed(&mut self, table: &Self::Matrix, step: &Self::Step, out: &mut Self::Buffer);
    /// `out[i][n] = Σ_k x[i][k] · w[n][k]` for `x: [m, w.cols()]`, `out:
    /// [m, w.rows()]`; `rows` says which of the step's rows `x` holds.
    fn matmul(
        &mut self,
        w: &Self::Matrix,
        x: &Self::Buffer,
        m: usize,
        out: &mut Self::Buffer,
        step: &Self::Step,
        rows: Rows,
    );
    /// [`Backend::matmul`] of the step's token rows when they are encoder
    /// rows (whole prompts that never decode), which a backend may compute
    /// with a prefill-sized kernel that rounds differently from `matmul`
    /// (each row still a function of itself alone). By default `matmul`.
    fn matmul_encoder(
        &mut self,
        w: &Self::Matrix,
        x: &Self::Buffer,
        m: usize,
        out: &mut Self::Buffer,
        step: &Self::Step,
    ) {
        self.matmul(w, x, m, out, step, Rows::Tokens)
    }
    /// RMSNorm of each row of `x: [m, d]` times `weight`, into `out`.
    fn rms_norm(
        &mut self,
        x: &Self::Buffer,
        weight: &Self::Vector,
        eps: f32,
        m: usize,
        d: usize,
        out: &mut Self::Buffer,
    );
    /// `x[i] += y[i]` for the first `n` elements.
    fn add(&mut self, x: &mut Self::Buffer, y: &Self::Buffer, n: usize);
    /// Adds `bias` (`d` wide) to each row of `x: [m, d]`.
    fn add_bias(&mut self, x: &mut Self::Buffer, bias: &Self::Vector, m: usize, d: usize);
    /// For each of `m` rows, copies `width` columns from `src` (rows
    /// `src_width` wide, from column `src_col`) to `dst` (rows `dst_width`
    /// wide, at column `dst_col`).
    #[allow(clippy::too_many_arguments)]
    fn copy_columns(
        &mut self,
        src: &Self::Buffer,
        src_width: usize,
        src_col: usize,
        dst: &mut Self::Buffer,
        dst_width: usize,
        dst_col: usize,
        width: usize,
        m: usize,
    );
    /// `out[r][j] = silu(gate_up[r][j]) · gate_up[r][ffn + j]` for `m` rows
    /// (`gate_up: [m, 2·ffn]`, `out: [m, ffn]`).
    fn silu_mul(&mut self, gate_up: &Self::Buffer, m: usize, ffn: usize, out: &mut Self::Buffer);
    /// `out[r][j] = gelu_tanh(gate_up[r][j]) · gate_up[r][ffn + j]` for `m`
    /// rows, GELU's tanh approximation (see [`crate::ops::gelu_tanh_mul`]);
    /// one of Gemma's operations ([`Backend::supports_gemma_ops`]).
    fn gelu_tanh_mul(
        &mut self,
        gate_up: &Self::Buffer,
        m: usize,
        ffn: usize,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (gate_up, m, ffn, out);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "gelu_tanh_mul",
        })
    }
    /// `x[i] *= s` for the first `n` elements (Gemma's embedding scale).
    fn scale(&mut self, x: &mut Self::Buffer, n: usize, s: f32) -> Result<(), BackendError> {
        let _ = (x, n, s);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "scale",
        })
    }
    /// `x[i] = tanh(x[i] / cap) · cap` for the first `n` elements (Gemma's
    /// final logit soft-capping).
    fn softcap(&mut self, x: &mut Self::Buffer, n: usize, cap: f32) -> Result<(), BackendError> {
        let _ = (x, n, cap);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "softcap",
        })
    }
    /// Rotates each of the step's token rows of `x` (`n_heads` heads of the
    /// table's head dimension) by its position.
    fn rope(&mut self, table: &Self::Rope, x: &mut Self::Buffer, n_heads: usize, step: &Self::Step);
    /// Writes each token's K and V rows (`[tokens, kv_dim]`) into `layer`
    /// of the pool at the token's slot.
    fn write_kv(
        &mut self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Buffer,
        v: &Self::Buffer,
        step: &Self::Step,
    );
    /// Causal grouped-query attention of the step's queries (`q: [tokens,
    /// n_heads · head_dim]`) over `layer` of the pool, through the step's
    /// block tables: prefill chunks and decodes in one call. Scores are
    /// scaled by `scale`. With a `window` of `w`, a query sees only the `w`
    /// most recent positions, itself included; only backends whose
    /// [`Backend::supports_sliding_window`] says so are given one. With
    /// `sinks` (`n_heads` values, GPT-OSS), each q head's sink logit joins
    /// its softmax denominator unscaled and contributes no value; only
    /// backends whose [`Backend::supports_attention_sinks`] says so are
    /// given them.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        kv: &Self::Kv,
        layer: usize,
        q: &Self::Buffer,
        n_heads: usize,
        scale: f32,
        window: Option<usize>,
        sinks: Option<&Self::Vector>,
        step: &Self::Step,
        out: &mut Self::Buffer,
    );
    /// Gathers the step's logit rows of `x: [tokens, d]` into `out:
    /// [logit_rows, d]`.
    fn gather_logit_rows(
        &mut self,
        x: &Self::Buffer,
        d: usize,
        step: &Self::Step,
        out: &mut Self::Buffer,
    );

    /// Samples the rows `meta` describes from `logits` (`[rows, vocab]`):
    /// each row's logit processors, then greedy or top-k / top-p / min-p
    /// sampling with the row's pre-drawn uniform, as
    /// [`crate::ops::sample`] defines them. Waits for the queued
    /// operations and returns in `out`, in host memory, only the sampled
    /// ids and the logprobs the rows asked for. The sampled rows of
    /// `logits` are overwritten; the others are left as they were.
    ///
    /// # Panics
    /// If `meta` is for another vocabulary, or its logit rows are not
    /// strictly increasing or lie past the buffer (bugs in the caller).
    fn sample(
        &mut self,
        logits: &mut Self::Buffer,
        vocab: usize,
        meta: &SamplingMetadata,
        out: &mut SampledRows,
    ) -> Result<(), BackendError>;

    /// Routes the `m` tokens whose router logits are the rows of `logits`
    /// (`[m, spec.n_experts]`) by `spec`, with `bias` added to the scores
    /// for the choice only, into `routes`: each token's `spec.top_k`
    /// experts and weights, and the (token, choice) pairs grouped by
    /// expert. The grouped rows of the ops below are these pairs.
    fn route_experts(
        &mut self,
        logits: &Self::Buffer,
        m: usize,
        spec: &crate::ops::RouterSpec,
        bias: Option<&Self::Vector>,
        routes: &mut Self::Routes,
    ) {
        let _ = (logits, m, spec, bias, routes);
        panic!(
            "{}: no mixture-of-experts operations (supports_experts is false)",
            self.describe()
        );
    }
    /// `out[s] = x[token of pair s]` for every grouped row `s` (`x: [m,
    /// d]`, `out: [m·k, d]`).
    fn gather_routed(
        &mut self,
        x: &Self::Buffer,
        d: usize,
        routes: &Self::Routes,
        out: &mut Self::Buffer,
    ) {
        let _ = (x, d, routes, out);
        panic!(
            "{}: no mixture-of-experts operations (supports_experts is false)",
            self.describe()
        );
    }
    /// For every expert `e`, its grouped rows of `x` times `experts[e]`
    /// (`x: [m·k, cols]`, `out: [m·k, rows]`): each expert's weights are
    /// read once for all the tokens routed to it.
    fn grouped_matmul(
        &mut self,
        experts: &[Self::Matrix],
        x: &Self::Buffer,
        routes: &Self::Routes,
        out: &mut Self::Buffer,
    ) {
        let _ = (experts, x, routes, out);
        panic!(
            "{}: no mixture-of-experts operations (supports_experts is false)",
            self.describe()
        );
    }
    /// Adds expert `e`'s bias (row `e` of `bias`, `[n_experts, d]`) to each
    /// of its grouped rows of `x` (`[m·k, d]`): GPT-OSS's expert biases.
    fn add_routed_bias(
        &mut self,
        x: &mut Self::Buffer,
        bias: &Self::Vector,
        d: usize,
        routes: &Self::Routes,
    ) {
        let _ = (x, bias, d, routes);
        panic!(
            "{}: no mixture-of-experts operations (supports_experts is false)",
            self.describe()
        );
    }
    /// GPT-OSS's clamped SwiGLU ([`crate::ops::swiglu_clamped`]) over `m`
    /// rows (`gate_up: [m, 2·ffn]`, gate then up; `out: [m, ffn]`); one of
    /// the expert operations.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_clamped(
        &mut self,
        gate_up: &Self::Buffer,
        m: usize,
        ffn: usize,
        alpha: f32,
        limit: f32,
        out: &mut Self::Buffer,
    ) {
        let _ = (gate_up, m, ffn, alpha, limit, out);
        panic!(
            "{}: no mixture-of-experts operations (supports_experts is false)",
            self.describe()
        );
    }
    /// `out[t] = Σ_j weight(t, j) · y[slot(t, j)]`: each token's experts'
    /// outputs, weighted, in choice order (`y: [m·k, d]`, `out: [m, d]`).
    fn scatter_routed(
        &mut self,
        y: &Self::Buffer,
        d: usize,
        routes: &Self::Routes,
        out: &mut Self::Buffer,
    ) {
        let _ = (y, d, routes, out);
        panic!(
            "{}: no mixture-of-experts operations (supports_experts is false)",
            self.describe()
        );
    }
    /// `x[t] += sigmoid(gate[t]) · y[t]` for `m` rows of `d` (`gate: [m,
    /// 1]`): Qwen-MoE's gated shared expert.
    fn add_gated(
        &mut self,
        x: &mut Self::Buffer,
        y: &Self::Buffer,
        gate: &Self::Buffer,
        m: usize,
        d: usize,
    ) {
        let _ = (x, y, gate, m, d);
        panic!(
            "{}: no mixture-of-experts operations (supports_experts is false)",
            self.describe()
        );
    }

    /// Adds LoRA deltas to a projection's output: for every token `t` of
    /// the step whose [`StepBatch::lora_slots`] entry `s` has factors in
    /// `slots[s]`, `out[t·out_stride + col + j] += Σ_k bᵀ[k,j] · scale ·
    /// Σ_i a[k,i] · x[t·in_dim + i]` for `j < out_dim` (see
    /// [`crate::ops::lora`]). Tokens of other slots, or none, are left
    /// alone, and a token's result does not depend on the others.
    #[allow(clippy::too_many_arguments)]
    fn lora_add(
        &mut self,
        x: &Self::Buffer,
        in_dim: usize,
        slots: &[Option<DeviceLora<Self::Matrix>>],
        step: &Self::Step,
        out: &mut Self::Buffer,
        out_stride: usize,
        col: usize,
        out_dim: usize,
    ) -> Result<(), BackendError> {
        let _ = (x, in_dim, slots, step, out, out_stride, col, out_dim);
        panic!(
            "{}: no LoRA kernels (supports_lora is false)",
            self.describe()
        );
    }

    /// A projection with adapters: `out = x · wᵀ` over the step's tokens
    /// (`Rows::Tokens`, `m` of them), plus `bias` on every row, plus each
    /// slice's LoRA deltas ([`Backend::lora_add`] with `out_stride =
    /// w.rows()`, `in_dim = w.cols()`), in that order and with the same
    /// bits as those calls made one after another. One call, so that a
    /// backend can compute the deltas, which read only `x`, beside the
    /// matmul instead of after it.
    #[allow(clippy::too_many_arguments)]
    fn matmul_lora(
        &mut self,
        w: &Self::Matrix,
        x: &Self::Buffer,
        m: usize,
        out: &mut Self::Buffer,
        bias: Option<&Self::Vector>,
        slices: &[LoraSlice<'_, Self::Matrix>],
        step: &Self::Step,
    ) -> Result<(), BackendError> {
        self.matmul(w, x, m, out, step, Rows::Tokens);
        if let Some(bias) = bias {
            self.add_bias(out, bias, m, w.rows());
        }
        for s in slices {
            self.lora_add(x, w.cols(), s.slots, step, out, w.rows(), s.col, s.out_dim)?;
        }
        Ok(())
    }

    /// Writes the step's latent rows (`latent: [tokens, width]`) into latent
    /// layer `layer` of `kv` at the step's slots.
    fn write_latent(
        &mut self,
        kv: &mut Self::Kv,
        layer: usize,
        latent: &Self::Buffer,
        step: &Self::Step,
    ) {
        let _ = (kv, layer, latent, step);
        panic!(
            "{}: no latent attention (supports_latent_attention is false)",
            self.describe()
        );
    }
    /// Causal multi-head latent attention over latent layer `layer`:
    /// `q: [tokens, n_heads, width]` (each head's absorbed query), `out:
    /// [tokens, n_heads, v_width]`, each head's softmax-weighted sum of the
    /// rows' first `v_width` values (see [`crate::ops::mla`]).
    #[allow(clippy::too_many_arguments)]
    fn latent_attention(
        &mut self,
        kv: &Self::Kv,
        layer: usize,
        q: &Self::Buffer,
        n_heads: usize,
        v_width: usize,
        scale: f32,
        step: &Self::Step,
        out: &mut Self::Buffer,
    ) {
        let _ = (kv, layer, q, n_heads, v_width, scale, step, out);
        panic!(
            "{}: no latent attention (supports_latent_attention is false)",
            self.describe()
        );
    }
    /// One matrix per head: for each of `m` rows and each head `h`,
    /// `out[r][h·out_stride + out_col ..][..w[h].rows()] = w[h] ·
    /// x[r][h·x_stride + x_col ..][..w[h].cols()]`. MLA's absorbed key and
    /// value up-projections.
    #[allow(clippy::too_many_arguments)]
    fn matmul_heads(
        &mut self,
        w: &[Self::Matrix],
        x: &Self::Buffer,
        m: usize,
        x_stride: usize,
        x_col: usize,
        out: &mut Self::Buffer,
        out_stride: usize,
        out_col: usize,
    ) {
        let _ = (w, x, m, x_stride, x_col, out, out_stride, out_col);
        panic!(
            "{}: no latent attention (supports_latent_attention is false)",
            self.describe()
        );
    }

    /// The short causal convolution of the step's sequences, then SiLU
    /// (see [`crate::ops::conv1d`]). `x`: rows of `x_stride` whose first
    /// `spec.channels` columns are the input; `weight`: `[spec.kernel,
    /// spec.channels]`, tap-major; `state`: `[slots, spec.state_len()]`,
    /// sequence `i` of the step reading and updating slot `slots[i]` (from
    /// zeros when its first token is at position 0); `out`: `[tokens,
    /// spec.channels]`.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv1d(
        &mut self,
        spec: ConvSpec,
        x: &Self::Buffer,
        x_stride: usize,
        weight: &Self::Vector,
        state: &mut Self::Buffer,
        slots: &[u32],
        step: &Self::Step,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (spec, x, x_stride, weight, state, slots, step, out);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "causal_conv1d",
        })
    }
    /// The gated delta rule over the step's sequences (see
    /// [`crate::ops::gated_delta`]): `qkv: [tokens, spec.qkv_width()]` (the
    /// convolution's output), at `row · ba_stride + ba_col` of `ba` each
    /// token's `n_v_heads` beta logits then `n_v_heads` decay inputs,
    /// `a_log` and `dt_bias` the layer's `[n_v_heads]`; `state: [slots,
    /// spec.state_len()]`, used as in [`Backend::causal_conv1d`]; `out:
    /// [tokens, spec.out_width()]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &mut self,
        spec: GatedDeltaSpec,
        qkv: &Self::Buffer,
        ba: &Self::Buffer,
        ba_stride: usize,
        ba_col: usize,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        state: &mut Self::Buffer,
        slots: &[u32],
        step: &Self::Step,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (
            spec, qkv, ba, ba_stride, ba_col, a_log, dt_bias, state, slots, step, out,
        );
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "gated_delta_rule",
        })
    }
    /// The output gate of gated attention (see [`crate::ops::mul_sigmoid`]):
    /// `x[r][j] *= sigmoid(gate[r·gate_stride + gate_col + j])` for `m` rows
    /// of `width`. One of the recurrent-layer operations
    /// ([`Backend::supports_linear_attention`]): only the hybrid models use
    /// it.
    #[allow(clippy::too_many_arguments)]
    fn mul_sigmoid(
        &mut self,
        x: &mut Self::Buffer,
        gate: &Self::Buffer,
        gate_stride: usize,
        gate_col: usize,
        m: usize,
        width: usize,
    ) -> Result<(), BackendError> {
        let _ = (x, gate, gate_stride, gate_col, m, width);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "mul_sigmoid",
        })
    }
    /// The gated RMSNorm (see [`crate::ops::gated_norm`]): each group of
    /// `weight`'s length of `x: [m, width]` RMS-normalized, times `weight`,
    /// times `silu` of the same columns of `z` (rows of `z_stride`, from
    /// column `z_col`), into `out: [m, width]`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gated(
        &mut self,
        x: &Self::Buffer,
        z: &Self::Buffer,
        z_stride: usize,
        z_col: usize,
        weight: &Self::Vector,
        eps: f32,
        m: usize,
        width: usize,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (x, z, z_stride, z_col, weight, eps, m, width, out);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "rms_norm_gated",
        })
    }

    /// An encoder's input embedding: for every token of the step, `out[t] =
    /// word[id] + position[position(t) + position_offset] + token_type[type]`
    /// (no type table: none added), the id and type unpacked from the
    /// step's token ([`crate::ops::encoder::unpack_token`]). Errors if an
    /// id, position or type lies past its table.
    #[allow(clippy::too_many_arguments)]
    fn encoder_embed(
        &mut self,
        word: &Self::Matrix,
        position: &Self::Matrix,
        position_offset: usize,
        token_type: Option<&Self::Matrix>,
        step: &Self::Step,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (word, position, position_offset, token_type, step, out);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "encoder_embed",
        })
    }
    /// LayerNorm of each row of `x: [m, d]` with `weight` and `bias`
    /// (see [`crate::ops::encoder::layer_norm`]), into `out`.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &mut self,
        x: &Self::Buffer,
        weight: &Self::Vector,
        bias: &Self::Vector,
        eps: f32,
        m: usize,
        d: usize,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (x, weight, bias, eps, m, d, out);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "layer_norm",
        })
    }
    /// Applies `act` to the first `n` elements of `x`.
    fn activation(
        &mut self,
        x: &mut Self::Buffer,
        n: usize,
        act: crate::ops::encoder::Activation,
    ) -> Result<(), BackendError> {
        let _ = (x, n, act);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "activation",
        })
    }
    /// `out[r][j] = act(x[r][j]) · x[r][ffn + j]` for `m` rows of `x: [m,
    /// 2·ffn]` into `out: [m, ffn]` (see [`crate::ops::encoder::act_mul`]):
    /// ModernBERT's gated MLP. One of the encoder operations.
    fn act_mul(
        &mut self,
        x: &Self::Buffer,
        m: usize,
        ffn: usize,
        act: crate::ops::encoder::Activation,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (x, m, ffn, act, out);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "act_mul",
        })
    }
    /// Attention in both directions within each of the step's sequences
    /// (see [`crate::ops::encoder::bidirectional_attention`]): `q: [tokens,
    /// n_heads · head_dim]`, `k`, `v`: `[tokens, n_kv_heads · head_dim]`,
    /// `out` as `q`; with a `window` of `w`, each row sees only the rows at
    /// most `w` positions away on either side. Every sequence must have its
    /// whole prompt in the step (it starts at position 0); one that does
    /// not is an error.
    #[allow(clippy::too_many_arguments)]
    fn bidirectional_attention(
        &mut self,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        window: Option<usize>,
        step: &Self::Step,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (
            q, k, v, n_heads, n_kv_heads, head_dim, scale, window, step, out,
        );
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "bidirectional_attention",
        })
    }
    /// For each logit row `i` of the step, `out[i]` (`d` wide) is the
    /// pooling `how` of the rows of `x: [tokens, d]` that belong to the
    /// logit row's sequence (see [`crate::ops::encoder::pool_rows`]).
    /// Every such sequence must have its whole prompt in the step.
    fn pool_seqs(
        &mut self,
        x: &Self::Buffer,
        d: usize,
        how: crate::ops::encoder::SeqPooling,
        step: &Self::Step,
        out: &mut Self::Buffer,
    ) -> Result<(), BackendError> {
        let _ = (x, d, how, step, out);
        Err(BackendError::UnsupportedOp {
            device: self.describe(),
            op: "pool_seqs",
        })
    }
}
