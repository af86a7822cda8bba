//! A small GGUF (version 3) writer, used by tests and tools to produce tiny
//! models. It writes the layout [`super::gguf`] reads: header, metadata,
//! tensor infos, then the tensor data, each tensor aligned to
//! `general.alignment` (32 unless the metadata sets it).

use super::gguf::{value_type, GgufValue, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_MAX_DIMS};
use anyhow::{anyhow, bail, Context, Result};
use pagoda_accel::GgmlType;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// One tensor to write.
#[derive(Clone, Debug)]
pub struct GgufTensorToWrite {
    /// The tensor's name.
    pub name: String,
    /// Its storage type.
    pub ty: GgmlType,
    /// Its shape in PyTorch order (`[rows, cols]` for a matrix); written as
    /// ggml's `ne`, i.e. reversed.
    pub shape: Vec<usize>,
    /// Its raw bytes in `ty`'s layout; the length must match the shape.
    pub data: Vec<u8>,
}

/// The GGUF type id of `ty`, found through [`GgmlType::from_gguf_id`] so that
/// the two directions can never disagree.
fn gguf_type_id(ty: GgmlType) -> Result<u32> {
    (0u32..256)
        .find(|&id| GgmlType::from_gguf_id(id) == Some(ty))
        .ok_or_else(|| anyhow!("ggml type {} has no GGUF type id", ty.name()))
}

/// The number of bytes tensor data of type `ty` and PyTorch-order `shape`
/// takes, or an error naming the tensor.
fn tensor_bytes(name: &str, ty: GgmlType, shape: &[usize]) -> Result<usize> {
    let cols = shape.last().copied().unwrap_or(1);
    let rows = shape[..shape.len().saturating_sub(1)]
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| anyhow!("tensor '{name}': shape {shape:?} overflows"))?;
    let row = ty
        .row_bytes(cols)
        .map_err(|e| anyhow!("tensor '{name}' ({}): {e}", ty.name()))?;
    row.checked_mul(rows)
        .ok_or_else(|| anyhow!("tensor '{name}': shape {shape:?} overflows"))
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, key: &str, v: &GgufValue) -> Result<()> {
    match v {
        GgufValue::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(items) => {
            // An empty array still needs an element type; u8 is as good as any.
            let elem = items.first().map_or(value_type::U8, GgufValue::type_id);
            if let Some(bad) = items.iter().find(|i| i.type_id() != elem) {
                bail!(
                    "metadata key '{key}': array mixes element types {} and {}",
                    items.first().map_or("?", GgufValue::type_name),
                    bad.type_name()
                );
            }
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, key, item)?;
            }
        }
    }
    Ok(())
}

/// Serializes a GGUF v3 file into memory.
fn encode(metadata: &[(&str, GgufValue)], tensors: &[GgufTensorToWrite]) -> Result<Vec<u8>> {
    let alignment = match metadata.iter().find(|(k, _)| *k == "general.alignment") {
        None => GGUF_DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => bail!("general.alignment = {v} is not a power of two"),
        },
    };
    let alignment = usize::try_from(alignment).context("general.alignment is too large")?;

    let mut out = Vec::new();
    out.extend_from_slice(&GGUF_MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (i, (key, value)) in metadata.iter().enumerate() {
        if metadata[..i].iter().any(|(k, _)| k == key) {
            bail!("metadata key '{key}' is given twice");
        }
        put_str(&mut out, key);
        out.extend_from_slice(&value.type_id().to_le_bytes());
        put_value(&mut out, key, value)?;
    }

    let mut offset = 0usize;
    let mut offsets = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|o| o.name == t.name) {
            bail!("tensor '{}' is given twice", t.name);
        }
        if t.shape.len() > GGUF_MAX_DIMS {
            bail!(
                "tensor '{}' has {} dimensions (at most {GGUF_MAX_DIMS})",
                t.name,
                t.shape.len()
            );
        }
        let want = tensor_bytes(&t.name, t.ty, &t.shape)?;
        if want != t.data.len() {
            bail!(
                "tensor '{}' ({}, shape {:?}) needs {want} bytes of data, got {}",
                t.name,
                t.ty.name(),
                t.shape,
                t.data.len()
            );
        }
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for &d in t.shape.iter().rev() {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        out.extend_from_slice(&gguf_type_id(t.ty)?.to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.data.len()).div_ceil(alignment) * alignment;
    }

    let data_start = out.len().div_ceil(alignment) * alignment;
    out.resize(data_start, 0);
    for (t, off) in tensors.iter().zip(offsets) {
        out.resize(data_start + off, 0);
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

/// Writes a GGUF v3 file at `path` with the given metadata (in order) and
/// tensors (each aligned to 32 bytes, or to `general.alignment` if the
/// metadata sets it). Every tensor's data length is checked against its type
/// and shape; arrays must not mix element types.
pub fn write_gguf(
    path: &Path,
    metadata: &[(&str, GgufValue)],
    tensors: &[GgufTensorToWrite],
) -> Result<()> {
    let shown = path.display();
    let bytes = encode(metadata, tensors).with_context(|| format!("{shown}: cannot write GGUF"))?;
    let file = File::create(path).with_context(|| format!("{shown}: cannot create file"))?;
    let mut w = BufWriter::new(file);
    w.write_all(&bytes)
        .and_then(|()| w.flush())
        .with_context(|| format!("{shown}: write failed"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_wrong_data_length_and_mixed_arrays() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x.gguf");
        let t = GgufTensorToWrite {
            name: "t".into(),
            ty: GgmlType::F32,
            shape: vec![2, 2],
            data: vec![0; 12],
        };
        let err = write_gguf(&path, &[], &[t]).unwrap_err();
        assert!(format!("{err:#}").contains("needs 16 bytes"), "{err:#}");
        let mixed = GgufValue::Array(vec![GgufValue::U8(1), GgufValue::I32(2)]);
        let err = write_gguf(&path, &[("k", mixed)], &[]).unwrap_err();
        assert!(format!("{err:#}").contains("mixes"), "{err:#}");
    }
}
