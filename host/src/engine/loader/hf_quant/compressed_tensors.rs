//! compressed-tensors checkpoints (llm-compressor's format, as vLLM loads
//! them): int8 `int-quantized` (W8A8, W8A16) and `pack-quantized` int4 or
//! int8 (W4A16).
//!
//! Per quantized linear layer `p`:
//! - `int-quantized`: `p.weight` I8 `[out, in]`, signed codes;
//! - `pack-quantized`: `p.weight_packed` I32 `[out, in · b / 32]`, packed
//!   along the input (element `32/b · c + j` of a row at bits `j · b` of its
//!   word `c`), each code stored as `q + 2^(b−1)` so it is unsigned; and
//!   `p.weight_shape` `[2]`, the unpacked `[out, in]`;
//! - `p.weight_scale`: `[out, 1]` (strategy `channel`), `[out, in / g]`
//!   (`group`) or `[1]` (`tensor`); `p.weight_zero_point` of the same shape
//!   for asymmetric weights;
//! - `p.input_scale` (`[1]`) when the input activations are static.
//!
//! Value: `w[n][k] = scale · (q − zero_point)`. Layers named in `ignore`
//! (exact module names, or `re:` regular expressions) stay dense.

use super::{bool_field, int_field, IntLinear, RawTensor, TensorStore, LANE};
use anyhow::{bail, Context, Result};
use pagoda_accel::{Affine, StaticActQuant};
use regex::Regex;
use serde_json::Value;

/// How the weights of a config group are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Tensor,
    Channel,
    Group(usize),
}

/// One of `config_groups`: which layers, and how they are quantized.
#[derive(Clone, Debug)]
struct ConfigGroup {
    /// `Linear` (every linear layer), module names, or `re:` patterns.
    targets: Vec<Target>,
    bits: u32,
    symmetric: bool,
    strategy: Strategy,
    /// int8 activations: `None` for weight-only (W4A16, W8A16), else
    /// whether the scale is static (`input_scale`).
    activations: Option<bool>,
}

/// A module selector of `targets` or `ignore`.
#[derive(Clone, Debug)]
enum Target {
    AnyLinear,
    Name(String),
    Pattern(Regex),
}

impl Target {
    fn parse(s: &str) -> Result<Target> {
        Ok(match s {
            "Linear" => Target::AnyLinear,
            s => match s.strip_prefix("re:") {
                // Anchored, as compressed-tensors matches with re.match.
                Some(p) => Target::Pattern(
                    Regex::new(&format!("^(?:{p})"))
                        .with_context(|| format!("target '{s}' is not a valid pattern"))?,
                ),
                None => Target::Name(s.to_string()),
            },
        })
    }

    fn matches(&self, module: &str) -> bool {
        match self {
            // Linear modules: a decoder layer's projections and the LM head
            // (not the embedding, which is no Linear).
            Target::AnyLinear => super::is_decoder_linear(module) || module == "lm_head",
            Target::Name(n) => n == module,
            Target::Pattern(r) => r.is_match(module),
        }
    }
}

/// A compressed-tensors `quantization_config`.
#[derive(Clone, Debug)]
pub struct CompressedTensors {
    packed: bool,
    groups: Vec<ConfigGroup>,
    ignore: Vec<Target>,
}

impl PartialEq for CompressedTensors {
    fn eq(&self, other: &Self) -> bool {
        self.describe() == other.describe()
    }
}

impl CompressedTensors {
    /// Reads `format`, `config_groups` and `ignore`.
    pub fn from_config(q: &Value) -> Result<CompressedTensors> {
        let packed = match q.get("format").and_then(Value::as_str) {
            Some("int-quantized") => false,
            Some("pack-quantized") => true,
            Some(other) => bail!(
                "compressed-tensors format '{other}' is not supported (int-quantized and pack-quantized are)"
            ),
            None => bail!("'format' is missing"),
        };
        let groups_v = q
            .get("config_groups")
            .and_then(Value::as_object)
            .context("'config_groups' is missing")?;
        let mut groups = Vec::new();
        for (name, g) in groups_v {
            groups.push(
                ConfigGroup::from_config(g, packed)
                    .with_context(|| format!("config_groups.{name}"))?,
            );
        }
        let ignore = match q.get("ignore") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .context("'ignore' entries must be strings")
                        .and_then(Target::parse)
                })
                .collect::<Result<_>>()?,
            Some(v) => bail!("'ignore' must be a list, got {v}"),
        };
        Ok(CompressedTensors {
            packed,
            groups,
            ignore,
        })
    }

    pub(super) fn describe(&self) -> String {
        let parts: Vec<String> = self
            .groups
            .iter()
            .map(|g| {
                let acts = match g.activations {
                    None => format!("W{}A16", g.bits),
                    Some(true) => format!("W{}A8 static", g.bits),
                    Some(false) => format!("W{}A8", g.bits),
                };
                let strategy = match g.strategy {
                    Strategy::Tensor => "per-tensor".to_string(),
                    Strategy::Channel => "per-channel".to_string(),
                    Strategy::Group(n) => format!("group {n}"),
                };
                let sym = if g.symmetric { "" } else { ", asymmetric" };
                format!("{acts} {strategy}{sym}")
            })
            .collect();
        format!(
            "compressed-tensors {}: {}",
            if self.packed {
                "pack-quantized"
            } else {
                "int-quantized"
            },
            parts.join("; ")
        )
    }

    /// int8 weights with int8 activations in every group.
    pub(super) fn is_w8a8(&self) -> bool {
        self.groups
            .iter()
            .all(|g| g.bits == 8 && g.activations.is_some())
    }

    pub(super) fn linear(
        &self,
        store: &dyn TensorStore,
        prefix: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<IntLinear>> {
        let ignored = self.ignore.iter().any(|t| t.matches(prefix));
        let group = self
            .groups
            .iter()
            .find(|g| g.targets.iter().any(|t| t.matches(prefix)));
        let stored_name = if self.packed {
            format!("{prefix}.weight_packed")
        } else {
            format!("{prefix}.weight_scale")
        };
        let stored = store.raw(&stored_name)?.is_some();
        let group = match (ignored, group, stored) {
            (true, _, false) | (false, None, false) => return Ok(None),
            (false, Some(g), true) => g,
            (true, _, true) | (false, None, true) => bail!(
                "{prefix}: the checkpoint holds quantized tensors ('{stored_name}'), but the quantization config leaves this layer unquantized (ignore list or no matching target)"
            ),
            (false, Some(_), false) => bail!(
                "{prefix}: the quantization config ({}) quantizes this layer, but '{stored_name}' is missing: the tensors do not match the config",
                self.describe()
            ),
        };
        group
            .linear(store, prefix, rows, cols, self.packed)
            .map(Some)
    }
}

impl ConfigGroup {
    fn from_config(g: &Value, packed: bool) -> Result<ConfigGroup> {
        let targets = g
            .get("targets")
            .and_then(Value::as_array)
            .context("'targets' is missing")?
            .iter()
            .map(|t| {
                t.as_str()
                    .context("'targets' entries must be strings")
                    .and_then(Target::parse)
            })
            .collect::<Result<_>>()?;
        let w = g.get("weights").context("'weights' is missing")?;
        let ty = w.get("type").and_then(Value::as_str).unwrap_or("int");
        if ty != "int" {
            bail!("weights of type '{ty}' (e.g. fp8) are not supported; Pagoda loads int weights");
        }
        let bits = int_field(w, &["num_bits"])?.context("weights.num_bits is missing")?;
        match (packed, bits) {
            (false, 8) | (true, 4) | (true, 8) => {}
            (false, b) => {
                bail!("int-quantized weights with num_bits = {b} are not supported (8 is)")
            }
            (true, b) => {
                bail!("pack-quantized weights with num_bits = {b} are not supported (4 and 8 are)")
            }
        }
        let strategy = match w.get("strategy").and_then(Value::as_str) {
            Some("tensor") => Strategy::Tensor,
            Some("channel") => Strategy::Channel,
            Some("group") => match int_field(w, &["group_size"])? {
                Some(n) if n > 0 => Strategy::Group(n as usize),
                _ => bail!("weights.strategy 'group' needs a positive group_size"),
            },
            other => {
                bail!("weights.strategy {other:?} is not supported (tensor, channel and group are)")
            }
        };
        match w.get("actorder") {
            None | Some(Value::Null) => {}
            Some(a) => bail!("weights.actorder {a} is not supported yet (checkpoints quantized without activation order are)"),
        }
        let activations = match g.get("input_activations") {
            None | Some(Value::Null) => None,
            Some(a) => {
                let bits = int_field(a, &["num_bits"])?;
                if bits != Some(8)
                    || a.get("type").and_then(Value::as_str).unwrap_or("int") != "int"
                {
                    bail!("input_activations must be 8-bit int (got {a})");
                }
                if !bool_field(a, "symmetric", true)? {
                    bail!("asymmetric input activations are not supported");
                }
                let dynamic = bool_field(a, "dynamic", false)?;
                match (dynamic, a.get("strategy").and_then(Value::as_str)) {
                    (true, _) => Some(false),
                    (false, Some("tensor") | None) => Some(true),
                    (false, Some(s)) => {
                        bail!("static input activations with strategy '{s}' are not supported (tensor is)")
                    }
                }
            }
        };
        Ok(ConfigGroup {
            targets,
            bits: bits as u32,
            symmetric: bool_field(w, "symmetric", true)?,
            strategy,
            activations,
        })
    }

    fn linear(
        &self,
        store: &dyn TensorStore,
        prefix: &str,
        rows: usize,
        cols: usize,
        packed: bool,
    ) -> Result<IntLinear> {
        let b = self.bits;
        let half = 1i32 << (b - 1);
        // Unsigned codes [rows, cols], and the zero point they carry.
        let codes: Vec<u8> = if packed {
            let shape = store.require(&format!("{prefix}.weight_shape"))?;
            let s = match shape.dtype {
                safetensors::Dtype::I64 => shape
                    .data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect::<Vec<_>>(),
                _ => shape.i32s()?.into_iter().map(i64::from).collect(),
            };
            if s != [rows as i64, cols as i64] {
                bail!("tensor '{prefix}.weight_shape' is {s:?}, but the layer is [{rows}, {cols}]");
            }
            let per = (32 / b) as usize;
            if cols % per != 0 {
                bail!("{prefix}: {cols} input features do not pack {per} to an int32");
            }
            let t = store.require(&format!("{prefix}.weight_packed"))?;
            t.expect_shape(&[rows, cols / per])?;
            super::unpack_words(&t.i32s()?, b).collect()
        } else {
            let t = store.require(&format!("{prefix}.weight"))?;
            t.expect_shape(&[rows, cols])?;
            t.i8s()?.iter().map(|&q| (q as i32 + 128) as u8).collect()
        };
        let code_zero = if packed { half } else { 128 };
        let lanes = cols / LANE;
        let group = match self.strategy {
            Strategy::Group(g) => g,
            _ => cols,
        };
        IntLinear::check_group(prefix, cols, group)?;
        let scale_shape: Vec<usize> = match self.strategy {
            Strategy::Tensor => vec![1],
            Strategy::Channel => vec![rows, 1],
            Strategy::Group(g) => vec![rows, cols / g],
        };
        let read = |t: RawTensor<'_>| -> Result<Vec<f32>> {
            // Per-tensor values also come as shape [] in some checkpoints.
            if !(self.strategy == Strategy::Tensor && t.shape.is_empty()) {
                t.expect_shape(&scale_shape)?;
            }
            t.f32s()
        };
        let scales = read(store.require(&format!("{prefix}.weight_scale"))?)?;
        let zero_points = match store.raw(&format!("{prefix}.weight_zero_point"))? {
            Some(t) => read(t)?,
            None if self.symmetric => vec![0.0; scales.len()],
            None => bail!("tensor '{prefix}.weight_zero_point' is missing, and the config says the weights are asymmetric"),
        };
        if let Some(z) = zero_points.iter().find(|z| z.fract() != 0.0) {
            bail!("tensor '{prefix}.weight_zero_point' holds {z}, not an integer");
        }
        // Per-tensor and per-channel scales stay f32, outside the blocks.
        let (mut lane_scales, mut lane_zeros) =
            (vec![1f32; rows * lanes], vec![0i32; rows * lanes]);
        let per_row = |n: usize| match self.strategy {
            Strategy::Tensor => 0,
            _ => n,
        };
        let mut out_scale = None;
        match self.strategy {
            Strategy::Group(g) => {
                for n in 0..rows {
                    for l in 0..lanes {
                        let at = n * (cols / g) + l * LANE / g;
                        lane_scales[n * lanes + l] = scales[at];
                        lane_zeros[n * lanes + l] = code_zero + zero_points[at] as i32;
                    }
                }
            }
            _ => {
                for n in 0..rows {
                    for l in 0..lanes {
                        lane_zeros[n * lanes + l] = code_zero + zero_points[per_row(n)] as i32;
                    }
                }
                out_scale = Some((0..rows).map(|n| scales[per_row(n)]).collect());
            }
        }
        let act_quant = match self.activations {
            Some(true) => Some(StaticActQuant {
                scale: store.require(&format!("{prefix}.input_scale"))?.scalar()?,
                offset: match store.raw(&format!("{prefix}.input_zero_point"))? {
                    Some(t) => t.scalar()?,
                    None => 0.0,
                },
            }),
            _ => None,
        };
        Ok(IntLinear {
            rows,
            cols,
            bits: b,
            codes,
            scales: lane_scales,
            zeros: lane_zeros,
            affine: Affine {
                act_quant,
                out_scale,
                ..Affine::default()
            },
        })
    }
}
