//! Quantized Hugging Face checkpoints: GPTQ, AWQ, compressed-tensors and
//! Ascend ModelSlim, loaded so that their weights stay quantized.
//!
//! Every scheme stores a linear layer as integer codes plus per-group (or
//! per-channel) scales and zero points, in its own packing. Each scheme's
//! module unpacks its tensors into one plain form, an [`IntLinear`]: the
//! `[out, in]` codes with a scale and an integer zero point per 32-wide
//! lane of each row, and the [`Affine`] transforms the scheme needs around
//! the product (a column order for GPTQ's `desc_act`, per-channel f32
//! scales, a static input scale). [`IntLinear::into_host`] then writes the
//! GGUF block type that holds those values exactly, so the backends run
//! them on the kernels they already have:
//!
//! - 4-bit codes with zero 8 everywhere: Q4_0 (`d · (q − 8)`);
//! - other 4-bit zero points: Q4_1, `d · q + m` with `m = −z · d` rounded
//!   to f16, which is how vLLM's GPTQ and AWQ GPU kernels fold the zero
//!   point into an f16 offset before their fused multiply-add;
//! - 8-bit codes: Q8_0 with codes `q − z`, so any zero point works as long
//!   as `q − z` fits in an int8.
//!
//! Lane scales are f16 in those blocks. GPTQ and AWQ store f16 scales, so
//! they are exact; per-channel schemes keep their scales in f32 outside the
//! blocks ([`Affine::out_scale`], with block scale 1).

mod awq;
mod compressed_tensors;
mod gptq;
mod modelslim;
pub mod mxfp4;

use anyhow::{bail, Context, Result};
use pagoda_accel::{Affine, GgmlType, HostMatrix};
use safetensors::Dtype;
use serde_json::Value;
use std::path::Path;

pub use compressed_tensors::CompressedTensors;
pub use gptq::Gptq;
pub use modelslim::ModelSlim;

/// Elements per lane block of the target GGUF types.
const LANE: usize = 32;

/// A tensor as stored: dtype, shape and little-endian bytes.
pub struct RawTensor<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl RawTensor<'_> {
    /// Checks the shape against what the layer implies.
    fn expect_shape(&self, want: &[usize]) -> Result<()> {
        if self.shape != want {
            bail!(
                "tensor '{}' has shape {:?}, but the layer and the quantization config imply {want:?}",
                self.name,
                self.shape
            );
        }
        Ok(())
    }

    /// The values as i32 (I32 tensors: packed codes, group indices).
    fn i32s(&self) -> Result<Vec<i32>> {
        match self.dtype {
            Dtype::I32 => Ok(self
                .data
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            other => bail!(
                "tensor '{}' is {other:?}; this scheme stores it as I32",
                self.name
            ),
        }
    }

    /// The values as i8 (I8 tensors: int8 weights).
    fn i8s(&self) -> Result<&[i8]> {
        match self.dtype {
            Dtype::I8 => Ok(bytemuck::cast_slice(self.data)),
            other => bail!(
                "tensor '{}' is {other:?}; this scheme stores it as I8",
                self.name
            ),
        }
    }

    /// The values as f32, from any float or integer dtype the schemes use
    /// for scales, offsets and biases.
    fn f32s(&self) -> Result<Vec<f32>> {
        let d = self.data;
        Ok(match self.dtype {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => d
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => d
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::I8 => d.iter().map(|&b| b as i8 as f32).collect(),
            Dtype::I32 => self.i32s()?.into_iter().map(|v| v as f32).collect(),
            other => bail!(
                "tensor '{}' is {other:?}; expected a float tensor (F32, F16 or BF16)",
                self.name
            ),
        })
    }

    /// The one value of a scalar tensor (shape `[]` or `[1]`).
    fn scalar(&self) -> Result<f32> {
        let v = self.f32s()?;
        match v.as_slice() {
            [x] => Ok(*x),
            _ => bail!(
                "tensor '{}' has shape {:?}; expected one value (per-tensor)",
                self.name,
                self.shape
            ),
        }
    }
}

/// Where a scheme reads its tensors: the checkpoint's shards.
pub trait TensorStore {
    /// The tensor `name`, or `None` when the checkpoint has none.
    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>>;

    /// The tensor `name`, which the scheme requires.
    fn require(&self, name: &str) -> Result<RawTensor<'_>> {
        self.raw(name)?.with_context(|| {
            format!("tensor '{name}' is missing, and the quantization config requires it")
        })
    }
}

/// The quantization scheme of a Hugging Face checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub enum Scheme {
    Gptq(Gptq),
    Awq(awq::Awq),
    CompressedTensors(CompressedTensors),
    ModelSlim(ModelSlim),
    /// gpt-oss's MXFP4 experts (its linear layers stay dense).
    Mxfp4(mxfp4::Mxfp4),
}

impl Scheme {
    /// Reads the scheme from the folder: `config.json`'s
    /// `quantization_config`, else `quantize_config.json` (GPTQ) or
    /// `quant_config.json` (AWQ), else ModelSlim's
    /// `quant_model_description.json`. `None` for a float checkpoint.
    pub fn detect(dir: &Path) -> Result<Option<Scheme>> {
        let read = |file: &str| -> Result<Option<Value>> {
            let path = dir.join(file);
            if !path.exists() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("{}: cannot read", path.display()))?;
            let v = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", path.display()))?;
            Ok(Some(v))
        };
        let in_file = |file: &str, r: Result<Scheme>| {
            r.with_context(|| format!("{}: quantization config", dir.join(file).display()))
        };
        if let Some(q) = read("config.json")?
            .as_ref()
            .and_then(|c| c.get("quantization_config"))
        {
            return in_file("config.json", Scheme::from_config(q)).map(Some);
        }
        if let Some(q) = read("quantize_config.json")? {
            return in_file(
                "quantize_config.json",
                Gptq::from_config(&q).map(Scheme::Gptq),
            )
            .map(Some);
        }
        if let Some(q) = read("quant_config.json")? {
            return in_file(
                "quant_config.json",
                awq::Awq::from_config(&q).map(Scheme::Awq),
            )
            .map(Some);
        }
        if let Some(d) = read(modelslim::DESCRIPTION)? {
            return in_file(
                modelslim::DESCRIPTION,
                ModelSlim::from_description(&d).map(Scheme::ModelSlim),
            )
            .map(Some);
        }
        Ok(None)
    }

    /// Interprets a `quantization_config` object by its `quant_method`.
    fn from_config(q: &Value) -> Result<Scheme> {
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .context("'quant_method' is missing")?;
        Ok(match method {
            "gptq" => Scheme::Gptq(Gptq::from_config(q)?),
            "awq" => Scheme::Awq(awq::Awq::from_config(q)?),
            "compressed-tensors" => Scheme::CompressedTensors(CompressedTensors::from_config(q)?),
            "mxfp4" => Scheme::Mxfp4(mxfp4::Mxfp4),
            other => bail!(
                "quant_method '{other}' is not supported; Pagoda loads gptq, awq, compressed-tensors (int8 W8A8, int4/int8 pack-quantized), Ascend ModelSlim W8A8 and (gpt-oss) mxfp4 checkpoints, and GGUF files"
            ),
        })
    }

    /// The scheme's name as `--quantization` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Scheme::Gptq(_) => "gptq",
            Scheme::Awq(_) => "awq",
            Scheme::CompressedTensors(_) => "compressed-tensors",
            Scheme::ModelSlim(_) => "ascend",
            Scheme::Mxfp4(_) => "mxfp4",
        }
    }

    /// What the folder holds, for messages and logs ("gptq int4, group 128").
    pub fn describe(&self) -> String {
        match self {
            Scheme::Gptq(g) => g.describe(),
            Scheme::Awq(a) => a.describe(),
            Scheme::CompressedTensors(c) => c.describe(),
            Scheme::ModelSlim(m) => m.describe(),
            Scheme::Mxfp4(m) => m.describe(),
        }
    }

    /// Whether the checkpoint's weights are int8 with int8 activations
    /// (what the seed's `--quantization w8a8` asks for).
    fn is_w8a8(&self) -> bool {
        match self {
            Scheme::CompressedTensors(c) => c.is_w8a8(),
            Scheme::ModelSlim(_) => true,
            _ => false,
        }
    }

    /// Loads the linear layer `prefix` (`model.layers.0.mlp.down_proj`),
    /// `[rows = out, cols = in]`, if the scheme quantized it; `None` when
    /// the checkpoint keeps it dense (`{prefix}.weight` in a float dtype).
    pub fn linear(
        &self,
        store: &dyn TensorStore,
        prefix: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<HostMatrix<'static>>> {
        let int = match self {
            Scheme::Gptq(g) => g.linear(store, prefix, rows, cols)?,
            Scheme::Awq(a) => a.linear(store, prefix, rows, cols)?,
            Scheme::CompressedTensors(c) => c.linear(store, prefix, rows, cols)?,
            Scheme::ModelSlim(m) => m.linear(store, prefix, rows, cols)?,
            // Only the experts' stacks are quantized (see
            // `WeightSource::stacked`).
            Scheme::Mxfp4(_) => None,
        };
        int.map(|i| i.into_host(prefix)).transpose()
    }

    /// The bias `name` for a checkpoint that folded it into the layer's
    /// integer bias (ModelSlim's static W8A8 `quant_bias`): zeros of `len`,
    /// since [`Scheme::linear`] already adds it. `None` otherwise.
    pub fn folded_bias(
        &self,
        store: &dyn TensorStore,
        name: &str,
        len: usize,
    ) -> Result<Option<Vec<f32>>> {
        match self {
            Scheme::ModelSlim(m) => m.folded_bias(store, name, len),
            _ => Ok(None),
        }
    }
}

/// `--quantization`, as vLLM names the methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizationArg {
    /// A GGUF file's own block types.
    Gguf,
    /// GPTQ (vLLM's `gptq`, and `gptq_marlin`, its kernel choice for it).
    Gptq,
    /// AWQ (`awq`, `awq_marlin`).
    Awq,
    /// compressed-tensors (llm-compressor's format).
    CompressedTensors,
    /// Ascend ModelSlim (vllm-ascend's `ascend`).
    Ascend,
    /// Whichever int8-weight, int8-activation format the folder holds.
    W8A8,
    /// Quantize a float checkpoint's linear layers to int8 at load.
    Int8,
    /// gpt-oss's MXFP4 experts (`mxfp4`).
    Mxfp4,
}

impl std::str::FromStr for QuantizationArg {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "gguf" => QuantizationArg::Gguf,
            "gptq" | "gptq_marlin" => QuantizationArg::Gptq,
            "awq" | "awq_marlin" => QuantizationArg::Awq,
            "compressed-tensors" | "compressed_tensors" => QuantizationArg::CompressedTensors,
            "ascend" => QuantizationArg::Ascend,
            "w8a8" => QuantizationArg::W8A8,
            "int8" => QuantizationArg::Int8,
            "mxfp4" => QuantizationArg::Mxfp4,
            other => bail!(
                "--quantization {other} is not supported; use one of gguf, gptq, awq, compressed-tensors, ascend, mxfp4, w8a8 (a checkpoint's own int8 format) or int8 (quantize a float checkpoint at load), or omit it to use the model's own"
            ),
        })
    }
}

impl QuantizationArg {
    /// The flag's value as given on the command line.
    pub fn name(self) -> &'static str {
        match self {
            QuantizationArg::Gguf => "gguf",
            QuantizationArg::Gptq => "gptq",
            QuantizationArg::Awq => "awq",
            QuantizationArg::CompressedTensors => "compressed-tensors",
            QuantizationArg::Ascend => "ascend",
            QuantizationArg::W8A8 => "w8a8",
            QuantizationArg::Int8 => "int8",
            QuantizationArg::Mxfp4 => "mxfp4",
        }
    }

    /// Checks the flag against what the HF folder `dir` holds.
    pub fn check_folder(self, dir: &Path, scheme: Option<&Scheme>) -> Result<()> {
        let fits = match (self, scheme) {
            (QuantizationArg::Int8, None) => true,
            (QuantizationArg::Gptq, Some(Scheme::Gptq(_)))
            | (QuantizationArg::Awq, Some(Scheme::Awq(_)))
            | (QuantizationArg::CompressedTensors, Some(Scheme::CompressedTensors(_)))
            | (QuantizationArg::Ascend, Some(Scheme::ModelSlim(_)))
            | (QuantizationArg::Mxfp4, Some(Scheme::Mxfp4(_))) => true,
            (QuantizationArg::W8A8, Some(s)) => s.is_w8a8(),
            _ => false,
        };
        if fits {
            return Ok(());
        }
        let holds = scheme.map_or_else(
            || "an unquantized (float) checkpoint".to_string(),
            |s| format!("a {} checkpoint ({})", s.name(), s.describe()),
        );
        let fix = match (self, scheme) {
            (QuantizationArg::Gguf, _) => "--quantization gguf needs a .gguf model file".to_string(),
            (QuantizationArg::Int8, Some(_)) => {
                "--quantization int8 quantizes float checkpoints; this one is quantized already, so omit the flag".to_string()
            }
            (_, Some(s)) => format!("use --quantization {} or omit the flag", s.name()),
            (_, None) => "omit the flag, or use --quantization int8 to quantize it at load".to_string(),
        };
        bail!(
            "--quantization {}, but {} holds {holds}: {fix}",
            self.name(),
            dir.display()
        )
    }
}

/// A linear layer's integer codes and per-lane parameters, in the layer's
/// `[out, in]` orientation and the stored column order (see the module
/// docs). Value of stored element `(r, j)`: `scale[r, j / 32] · (code − zero[r, j / 32])`,
/// then the [`Affine`] around the product.
pub struct IntLinear {
    pub rows: usize,
    pub cols: usize,
    /// 4 or 8.
    pub bits: u32,
    /// Unsigned codes `0..2^bits`, row-major `[rows, cols]`.
    pub codes: Vec<u8>,
    /// Scale per lane, `[rows, cols / 32]`.
    pub scales: Vec<f32>,
    /// Integer zero point per lane, in code units, `[rows, cols / 32]`.
    pub zeros: Vec<i32>,
    pub affine: Affine,
}

impl IntLinear {
    /// Checks that `cols` splits into lanes and groups into whole lanes.
    fn check_group(prefix: &str, cols: usize, group: usize) -> Result<()> {
        if cols % LANE != 0 || group % LANE != 0 || cols % group != 0 {
            bail!(
                "{prefix}: {cols} input features in groups of {group}: Pagoda runs quantized weights in blocks of 32, so both must be multiples of 32 (and the features a whole number of groups)"
            );
        }
        Ok(())
    }

    /// Writes the blocks (see the module docs for the type chosen).
    fn into_host(self, prefix: &str) -> Result<HostMatrix<'static>> {
        let lanes = self.cols / LANE;
        debug_assert_eq!(self.scales.len(), self.rows * lanes);
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        let (ty, block) = match self.bits {
            4 if self.zeros.iter().all(|&z| z == 8) => (GgmlType::Q4_0, 18),
            4 => (GgmlType::Q4_1, 20),
            8 => (GgmlType::Q8_0, 34),
            b => bail!("{prefix}: {b}-bit codes have no block type"),
        };
        let mut data = vec![0u8; self.rows * lanes * block];
        for (l, out) in data.chunks_exact_mut(block).enumerate() {
            let (d, z) = (self.scales[l], self.zeros[l]);
            let codes = &self.codes[l * LANE..(l + 1) * LANE];
            out[0..2].copy_from_slice(&f16(d));
            match ty {
                GgmlType::Q8_0 => {
                    for (o, &c) in out[2..].iter_mut().zip(codes) {
                        let v = c as i32 - z;
                        let v = i8::try_from(v).map_err(|_| {
                            anyhow::anyhow!(
                                "{prefix}: row {}: code {c} with zero point {z} leaves the int8 range; Pagoda holds 8-bit weights as q − zero in int8",
                                l / lanes
                            )
                        })?;
                        *o = v as u8;
                    }
                }
                _ => {
                    let qs = if ty == GgmlType::Q4_1 {
                        out[2..4].copy_from_slice(&f16(-(z as f32) * d));
                        &mut out[4..]
                    } else {
                        &mut out[2..]
                    };
                    for j in 0..16 {
                        qs[j] = (codes[j] & 0x0f) | (codes[j + 16] << 4);
                    }
                }
            }
        }
        HostMatrix::new(ty, self.rows, self.cols, data)
            .and_then(|m| m.with_affine(self.affine))
            .with_context(|| format!("{prefix}: building the quantized matrix"))
    }
}

/// Whether `prefix` is a decoder layer's linear projection
/// (`model.layers.3.mlp.up_proj`): the layers GPTQ and AWQ quantize. The
/// embeddings and the LM head stay float unless a config says otherwise.
fn is_decoder_linear(prefix: &str) -> bool {
    prefix.starts_with("model.layers.") && prefix.ends_with("_proj")
}

/// The packed tensor `{prefix}.{packed}` of a layer the config quantizes,
/// or `None` for a layer that stays dense; refuses a checkpoint whose
/// tensors and config disagree about which it is.
fn quantized_or_dense<'s>(
    store: &'s dyn TensorStore,
    prefix: &str,
    packed: &str,
    skipped: bool,
    scheme: &str,
) -> Result<Option<RawTensor<'s>>> {
    let name = format!("{prefix}.{packed}");
    match (store.raw(&name)?, skipped) {
        (None, true) => Ok(None),
        (None, false) if !is_decoder_linear(prefix) => Ok(None),
        (None, false) => bail!(
            "tensor '{name}' is missing: the quantization config ({scheme}) quantizes '{prefix}', so the checkpoint's tensors do not match its config"
        ),
        (Some(_), true) => bail!(
            "tensor '{name}' is quantized, but the quantization config ({scheme}) leaves '{prefix}' unquantized"
        ),
        (Some(t), false) => Ok(Some(t)),
    }
}

/// Unpacks int32 words of `32 / bits` codes each, low bits first.
fn unpack_words(words: &[i32], bits: u32) -> impl Iterator<Item = u8> + '_ {
    let per = 32 / bits as usize;
    let mask = (1u32 << bits) - 1;
    words
        .iter()
        .flat_map(move |&w| (0..per).map(move |j| ((w as u32 >> (bits as usize * j)) & mask) as u8))
}

/// Reads `field` of a config as a bool, with a default.
fn bool_field(q: &Value, field: &str, default: bool) -> Result<bool> {
    match q.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_bool()
            .with_context(|| format!("'{field}' must be true or false, got {v}")),
    }
}

/// Reads `field` (or its alias) of a config as an integer.
fn int_field(q: &Value, fields: &[&str]) -> Result<Option<i64>> {
    for f in fields {
        if let Some(v) = q.get(*f) {
            if v.is_null() {
                continue;
            }
            return v
                .as_i64()
                .map(Some)
                .with_context(|| format!("'{f}' must be an integer, got {v}"));
        }
    }
    Ok(None)
}
