//! Hugging Face folders: `config.json` plus one or more memory-mapped
//! `*.safetensors` files (sharded through `model.safetensors.index.json`).

use super::hf_quant::{QuantizationArg, RawTensor, Scheme, TensorStore};
use super::{DType, WeightSource};
use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use pagoda_accel::{GgmlType, HostMatrix};
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The safetensors shards of an HF folder, memory-mapped.
pub struct SafetensorsSource {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    /// tensor name → index into `shards`
    /// Each tensor's shard and its name there, under the name the model
    /// definitions read it by.
    index: HashMap<String, (usize, String)>,
    dtype: DType,
    /// The checkpoint's quantization scheme, if it has one.
    scheme: Option<Scheme>,
    /// `--quantization int8`: the layers' float linears become Q8_0.
    online_int8: bool,
    /// The tensors read so far, to report those nothing used.
    read: Mutex<HashSet<String>>,
}

/// A shard named by the index: a plain file name in the model folder. A
/// path (`../x`, `/etc/passwd`, `sub/x`) could read any file the server can,
/// so it is refused.
fn shard_name(f: &str) -> Result<&Path> {
    let p = Path::new(f);
    let mut parts = p.components();
    match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(_)), None) => Ok(p),
        _ => bail!("a shard must be a file name in the model folder, not a path"),
    }
}

impl SafetensorsSource {
    /// Maps every shard of the folder. With `model.safetensors.index.json`
    /// the shards are the ones it names; otherwise every `*.safetensors`.
    /// The folder's quantization scheme (if any) is read from its config
    /// files and checked against `quantization` (`--quantization`).
    pub fn open(
        dir: &Path,
        dtype: DType,
        quantization: Option<QuantizationArg>,
    ) -> Result<SafetensorsSource> {
        let scheme = Scheme::detect(dir)?;
        if let Some(q) = quantization {
            q.check_folder(dir, scheme.as_ref())?;
        }
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("{}: cannot read", index_path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{}: no 'weight_map' object", index_path.display()))?;
            let mut names = Vec::new();
            for f in map.values() {
                let f = f.as_str().with_context(|| {
                    format!(
                        "{}: a weight_map entry is not a file name: {f}",
                        index_path.display()
                    )
                })?;
                names.push(
                    dir.join(
                        shard_name(f)
                            .with_context(|| format!("{}: shard {f:?}", index_path.display()))?,
                    ),
                );
            }
            names.sort();
            names.dedup();
            names
        } else {
            let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("{}: cannot list the model folder", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            names.sort();
            names
        };
        if files.is_empty() {
            bail!(
                "{}: no *.safetensors files in the model folder",
                dir.display()
            );
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = std::fs::File::open(&path)
                .with_context(|| format!("{}: cannot open", path.display()))?;
            // SAFETY: the file is mapped read-only; like every mmap-based
            // loader we assume nobody truncates the model while we serve it.
            let mmap = unsafe { Mmap::map(&file) }
                .with_context(|| format!("{}: cannot memory-map", path.display()))?;
            let names = SafeTensors::read_metadata(&mmap)
                .map_err(|e| {
                    anyhow::anyhow!("{}: not a valid safetensors file: {e}", path.display())
                })?
                .1
                .tensors()
                .into_keys()
                .collect::<Vec<_>>();
            // Checks every tensor's offsets against the file length.
            SafeTensors::deserialize(&mmap).map_err(|e| {
                anyhow::anyhow!("{}: not a valid safetensors file: {e}", path.display())
            })?;
            for n in names {
                index.insert(n.clone(), (i, n));
            }
            shards.push((path, mmap));
        }
        // A decoder saved from its headless `*Model` class (as
        // sentence-transformers saves Qwen3-Embedding) names its tensors
        // without the `model.` prefix the `*ForCausalLM` layout has: serve
        // them under the prefixed names the model definitions read.
        if index.contains_key("embed_tokens.weight")
            && !index.contains_key("model.embed_tokens.weight")
        {
            index = index
                .into_iter()
                .map(|(k, v)| (format!("model.{k}"), v))
                .collect();
        }
        Ok(SafetensorsSource {
            dir: dir.to_path_buf(),
            shards,
            index,
            read: Mutex::new(HashSet::new()),
            dtype,
            scheme,
            online_int8: quantization == Some(QuantizationArg::Int8),
        })
    }

    /// The checkpoint's quantization scheme, if it has one.
    pub fn scheme(&self) -> Option<&Scheme> {
        self.scheme.as_ref()
    }

    /// Whether `name` is the weight of a decoder layer's linear projection
    /// (what `--quantization int8` quantizes; embeddings and the LM head
    /// stay as they are, as in vLLM's online quantization).
    fn is_layer_linear(name: &str) -> bool {
        name.starts_with("model.layers.") && name.ends_with("_proj.weight")
    }

    /// The checkpoint's tensors that nothing has read, sorted: after a
    /// model has loaded, weights its definition does not use (a key the
    /// config reader missed would show here).
    pub fn unused(&self) -> Vec<String> {
        let read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let mut unused: Vec<String> = self
            .index
            .keys()
            .filter(|k| !read.contains(*k))
            .cloned()
            .collect();
        unused.sort();
        unused
    }

    /// The stack `name` of `shape` `[n, rows, cols]` from MXFP4
    /// `{name}_blocks` `[n, cols, rows / 32, 16]` and `{name}_scales` `[n,
    /// cols, rows / 32]`: transformers' experts are applied as `x @ W`, and
    /// the quantized form stores each `W` transposed, blocked along `rows`.
    /// Kept as bfloat16 (f32 under `--dtype float32`; both exact).
    fn mxfp4_stacked(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, GgmlType)> {
        let &[n, rows, cols] = shape else {
            bail!(
                "{}: tensor '{name}': an mxfp4 stack must have three dimensions, not {shape:?}",
                self.dir.display()
            );
        };
        if rows % 32 != 0 {
            bail!(
                "{}: tensor '{name}': {rows} rows are not whole mxfp4 blocks of 32",
                self.dir.display()
            );
        }
        let g = rows / 32;
        let (path, blocks, scales) = self.mxfp4_parts(name, n, cols, g)?;
        let v = super::hf_quant::mxfp4::dequantize(blocks, scales, n * cols, g)
            .with_context(|| format!("{}: tensor '{name}'", path.display()))?;
        // `[n, cols, rows]` → `[n, rows, cols]`.
        let mut out = vec![0f32; n * rows * cols];
        for e in 0..n {
            let (src, dst) = (&v[e * rows * cols..], &mut out[e * rows * cols..]);
            for c in 0..cols {
                for r in 0..rows {
                    dst[r * cols + c] = src[c * rows + r];
                }
            }
        }
        let ty = match self.dtype {
            DType::Float32 => GgmlType::F32,
            DType::Float16 => GgmlType::F16,
            DType::Auto | DType::BFloat16 => GgmlType::BF16,
        };
        Ok((out, ty))
    }

    /// The U8 tensors `{name}_blocks` `[n, rows, groups, 16]` and
    /// `{name}_scales` `[n, rows, groups]` of an MXFP4 stack, checked.
    fn mxfp4_parts(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        groups: usize,
    ) -> Result<(&Path, &[u8], &[u8])> {
        let (bn, sn) = (format!("{name}_blocks"), format!("{name}_scales"));
        let (path, blocks) = self.tensor(&bn)?;
        check_shape(path, &bn, blocks.shape(), &[n, rows, groups, 16])?;
        let (path, scales) = self.tensor(&sn)?;
        check_shape(path, &sn, scales.shape(), &[n, rows, groups])?;
        for (t, tn) in [(&blocks, &bn), (&scales, &sn)] {
            if t.dtype() != StDtype::U8 {
                bail!(
                    "{}: tensor '{tn}' has dtype {:?}; mxfp4 blocks and scales are U8",
                    path.display(),
                    t.dtype()
                );
            }
        }
        Ok((path, blocks.data(), scales.data()))
    }

    fn tensor(&self, name: &str) -> Result<(&Path, safetensors::tensor::TensorView<'_>)> {
        let (i, stored) = self
            .index
            .get(name)
            .with_context(|| format!("{}: tensor '{name}' is missing", self.dir.display()))?;
        self.read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string());
        let (path, mmap) = &self.shards[*i];
        let st = SafeTensors::deserialize(mmap)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let view = st
            .tensor(stored)
            .map_err(|e| anyhow::anyhow!("{}: tensor '{name}': {e}", path.display()))?;
        Ok((path.as_path(), view))
    }
}

fn check_shape(path: &Path, name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        bail!(
            "{}: tensor '{name}' has shape {got:?}, but the config implies {want:?}",
            path.display()
        );
    }
    Ok(())
}

fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Converts raw little-endian tensor bytes of a float dtype to f32.
fn to_f32(path: &Path, name: &str, dtype: StDtype, bytes: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        StDtype::F32 => f32s(bytes),
        StDtype::F16 => u16s(bytes)
            .into_iter()
            .map(|b| half::f16::from_bits(b).to_f32())
            .collect(),
        StDtype::BF16 => u16s(bytes)
            .into_iter()
            .map(|b| half::bf16::from_bits(b).to_f32())
            .collect(),
        other => bail!(
            "{}: tensor '{name}' has dtype {other:?}; only F32, F16 and BF16 are supported",
            path.display()
        ),
    })
}

impl TensorStore for SafetensorsSource {
    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        if !self.index.contains_key(name) {
            return Ok(None);
        }
        let (_, t) = self.tensor(name)?;
        Ok(Some(RawTensor {
            name: name.to_string(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            data: t.data(),
        }))
    }
}

impl WeightSource for SafetensorsSource {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<HostMatrix<'_>> {
        if let (Some(scheme), Some(prefix)) = (&self.scheme, name.strip_suffix(".weight")) {
            if let Some(m) = scheme
                .linear(self, prefix, rows, cols)
                .with_context(|| format!("{}: {}", self.dir.display(), scheme.describe()))?
            {
                return Ok(m);
            }
        }
        if self.online_int8 && SafetensorsSource::is_layer_linear(name) {
            let (path, t) = self.tensor(name)?;
            check_shape(path, name, t.shape(), &[rows, cols])?;
            let values = to_f32(path, name, t.dtype(), t.data())?;
            return HostMatrix::from_f32_as(GgmlType::Q8_0, rows, cols, &values).with_context(
                || format!("{}: tensor '{name}': quantizing to int8", path.display()),
            );
        }
        let (path, t) = self.tensor(name)?;
        // A depthwise conv1d weight (`[channels, 1, kernel]`, the Gated
        // DeltaNet's) is a `[channels, kernel]` matrix: the unit middle
        // dimension changes nothing in the row-major bytes.
        match t.shape() {
            [r, 1, c] if *r == rows && *c == cols => {}
            shape => check_shape(path, name, shape, &[rows, cols])?,
        }
        let ctx = || format!("{}: tensor '{name}'", path.display());
        let stored = t.dtype();
        let m = match (self.dtype, stored) {
            // Kept as stored: borrowed from the mapped file, no copy.
            (DType::Auto | DType::BFloat16, StDtype::BF16) => {
                HostMatrix::new(GgmlType::BF16, rows, cols, t.data())
            }
            (DType::Auto | DType::Float16, StDtype::F16) => {
                HostMatrix::new(GgmlType::F16, rows, cols, t.data())
            }
            (DType::Auto | DType::Float32, StDtype::F32) => {
                HostMatrix::new(GgmlType::F32, rows, cols, t.data())
            }
            (DType::Auto, other) => bail!("{}: dtype {other:?} is not supported", ctx()),
            (want, _) => {
                let ty = match want {
                    DType::Float32 => GgmlType::F32,
                    DType::BFloat16 => GgmlType::BF16,
                    _ => GgmlType::F16,
                };
                HostMatrix::from_f32_as(ty, rows, cols, &to_f32(path, name, stored, t.data())?)
            }
        };
        m.with_context(ctx)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        if let Some(scheme) = &self.scheme {
            if !self.index.contains_key(name) {
                if let Some(zeros) = scheme.folded_bias(self, name, len)? {
                    return Ok(zeros);
                }
            }
        }
        let (path, t) = self.tensor(name)?;
        check_shape(path, name, t.shape(), &[len])?;
        to_f32(path, name, t.dtype(), t.data())
    }

    fn mxfp4_f32_activations(&self) -> bool {
        true
    }

    fn mxfp4_stack(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<u8>>> {
        if !matches!(self.scheme, Some(Scheme::Mxfp4(_))) || self.index.contains_key(name) {
            return Ok(None);
        }
        if !cols.is_multiple_of(32) {
            bail!(
                "{}: tensor '{name}': {cols} input features are not whole mxfp4 blocks of 32",
                self.dir.display()
            );
        }
        let (path, blocks, scales) = self.mxfp4_parts(name, n, rows, cols / 32)?;
        let out =
            pagoda_accel::quant::mxfp4::from_hf_blocks(blocks, scales).with_context(|| {
                format!(
                    "{}: tensor '{name}': mxfp4 blocks and scales disagree",
                    path.display()
                )
            })?;
        Ok(Some(out))
    }

    fn stacked(&self, name: &str, shape: &[usize]) -> Result<(Vec<f32>, GgmlType)> {
        if self.online_int8 {
            bail!("{}: tensor '{name}': --quantization int8 does not quantize stacked experts yet; serve this model without it", self.dir.display());
        }
        if matches!(self.scheme, Some(Scheme::Mxfp4(_))) && !self.index.contains_key(name) {
            return self.mxfp4_stacked(name, shape);
        }
        let (path, t) = self.tensor(name)?;
        check_shape(path, name, t.shape(), shape)?;
        let stored = t.dtype();
        let ty = match (self.dtype, stored) {
            (DType::Auto, StDtype::BF16) | (DType::BFloat16, _) => GgmlType::BF16,
            (DType::Auto, StDtype::F16) | (DType::Float16, _) => GgmlType::F16,
            (DType::Auto, StDtype::F32) | (DType::Float32, _) => GgmlType::F32,
            (DType::Auto, other) => bail!(
                "{}: tensor '{name}' has dtype {other:?}; only F32, F16 and BF16 are supported",
                path.display()
            ),
        };
        Ok((to_f32(path, name, stored, t.data())?, ty))
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn describe(&self) -> String {
        self.dir.display().to_string()
    }
}
