//! Weight and metadata loaders: GGUF files and Hugging Face folders.
//!
//! Both sources hand the model definition the same thing, a [`WeightSource`]
//! that returns named matrices (kept in their storage type) and vectors, so
//! the model never knows which file format it came from.

pub mod gguf;
pub mod gguf_weights;
pub mod gguf_writer;
pub mod hf_quant;
pub mod safetensors;

use anyhow::Result;
use pagoda_accel::HostMatrix;

/// The dtype weights are kept in, as chosen by `--dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DType {
    /// Keep each tensor's stored dtype (bf16 stays bf16, quantized stays quantized).
    #[default]
    Auto,
    Float32,
    BFloat16,
    Float16,
}

impl std::str::FromStr for DType {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => DType::Auto,
            "float32" | "f32" | "float" => DType::Float32,
            "bfloat16" | "bf16" => DType::BFloat16,
            "float16" | "f16" | "half" => DType::Float16,
            other => {
                anyhow::bail!("--dtype '{other}' is not one of auto, float32, bfloat16, float16")
            }
        })
    }
}

/// Named tensors of one model, whatever the file format.
pub trait WeightSource {
    /// The matrix `name` as `[rows, cols]` (out × in features) in its
    /// storage type (or the one `--dtype` converts float tensors to),
    /// checked against the expected shape. Backends lay it out for their
    /// kernels when they upload it.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix<'_>>;
    /// The 1-D tensor `name` (norm weights, biases) as f32, checked against
    /// the expected length.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    /// The float tensor `name` of exactly `shape` (a stack of matrices,
    /// such as gpt-oss's fused experts `[experts, rows, cols]`) as f32
    /// values in row-major order, with the storage type its matrices take
    /// (the stored float type, or the one `--dtype` converts to: f32 values
    /// of that type convert back exactly). A source that holds no such
    /// stacks says so.
    fn stacked(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, pagoda_accel::GgmlType)> {
        let _ = shape;
        anyhow::bail!(
            "{}: tensor '{name}' is a stack of matrices, which this format does not provide",
            self.describe()
        )
    }
    /// The stack `name` of `n` matrices `[rows, cols]` (out × in features)
    /// as MXFP4 blocks in ggml's layout (`pagoda_accel::quant::mxfp4`,
    /// 17 bytes per 32 values, matrices and rows in order), where the
    /// source stores that stack in MXFP4 (gpt-oss's `{name}_blocks` and
    /// `{name}_scales`); `None` where it stores it otherwise, to be read
    /// with [`WeightSource::stacked`].
    fn mxfp4_stack(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<u8>>> {
        let _ = (name, n, rows, cols);
        Ok(None)
    }
    /// Whether [`WeightSource::mxfp4_stack`]'s matrices multiply f32
    /// activations (Hugging Face checkpoints, whose reference is the
    /// decoded model) rather than 8-bit ones (GGUF files, as llama.cpp);
    /// see `pagoda_accel::quant::mxfp4`.
    fn mxfp4_f32_activations(&self) -> bool {
        false
    }
    /// Whether the source holds a tensor called `name`.
    fn contains(&self, name: &str) -> bool;
    /// Where the weights come from, for error messages.
    fn describe(&self) -> String;
}
