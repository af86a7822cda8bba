//! A reader for GGUF files (versions 2 and 3) over a memory map.
//!
//! A GGUF file is laid out as
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type: u32, value)
//! tensor_count × (name: string, n_dims: u32, ne: n_dims × u64, type: u32, offset: u64)
//! padding to `general.alignment` (default 32)
//! tensor data (each tensor at `offset` from the start of this section)
//! ```
//!
//! with every integer little-endian and every string a `u64` byte length
//! followed by UTF-8 bytes. [`GgufFile::open`] parses and validates all of the
//! header, metadata and tensor infos up front (every count and length is
//! bounded by the bytes actually left in the file, so a corrupt file can never
//! make the reader allocate more than a small multiple of its own size), and
//! then hands out tensor data as borrowed slices of the map.

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use pagoda_accel::GgmlType;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// The data-section alignment used when `general.alignment` is absent.
pub const GGUF_DEFAULT_ALIGNMENT: u64 = 32;

/// The most dimensions a GGUF tensor may have (ggml's `GGML_MAX_DIMS`).
pub const GGUF_MAX_DIMS: usize = 4;

/// How deeply arrays may nest inside metadata values. Real files use at most
/// one level; the bound keeps a crafted file from overflowing the stack.
const MAX_ARRAY_DEPTH: usize = 8;

/// Value type ids of GGUF metadata values.
pub(crate) mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// One metadata value of a GGUF file.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool` (one byte, 0 or 1).
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array whose elements all have the same type.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The GGUF value type id of this value (`0` = u8 … `12` = f64).
    pub fn type_id(&self) -> u32 {
        use value_type as t;
        match self {
            GgufValue::U8(_) => t::U8,
            GgufValue::I8(_) => t::I8,
            GgufValue::U16(_) => t::U16,
            GgufValue::I16(_) => t::I16,
            GgufValue::U32(_) => t::U32,
            GgufValue::I32(_) => t::I32,
            GgufValue::U64(_) => t::U64,
            GgufValue::I64(_) => t::I64,
            GgufValue::F32(_) => t::F32,
            GgufValue::F64(_) => t::F64,
            GgufValue::Bool(_) => t::BOOL,
            GgufValue::String(_) => t::STRING,
            GgufValue::Array(_) => t::ARRAY,
        }
    }

    /// A short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F32(_) => "f32",
            GgufValue::F64(_) => "f64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }

    /// The value as a signed 128-bit integer, if it is of an integer type.
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a `u64`, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// The value as an `i64`, if it is an integer of any width that fits.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// The value as an `f32`, if it is a float or an integer (converted).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => self.as_i128().map(|v| v as f32),
        }
    }

    /// The value as a `bool`, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for GgufValue {
    /// Scalars print as themselves; strings and arrays are shortened so that
    /// a 50 000-entry vocabulary prints as one short line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::String(s) => {
                let short: String = s.chars().take(60).collect();
                if short.len() < s.len() {
                    write!(f, "{short:?}…")
                } else {
                    write!(f, "{s:?}")
                }
            }
            GgufValue::Array(a) => {
                write!(f, "[")?;
                for (i, v) in a.iter().take(4).enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{v}")?;
                }
                if a.len() > 4 {
                    write!(f, ", … ({} elements)", a.len())?;
                }
                write!(f, "]")
            }
        }
    }
}

/// Where one tensor lives in a GGUF file and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Its storage type.
    pub ty: GgmlType,
    /// Its shape in PyTorch order: `[rows, cols]` for a matrix, i.e. ggml's
    /// `ne` reversed. Empty for a 0-dimensional tensor (one element).
    pub shape: Vec<usize>,
    /// The absolute offset of its data in the file.
    pub offset: u64,
    /// The size of its data in bytes.
    pub size: usize,
}

impl GgufTensorInfo {
    /// The number of elements (the product of the shape; 1 for a scalar).
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A tensor's description together with its bytes, borrowed from the map.
#[derive(Clone, Copy, Debug)]
pub struct GgufTensor<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Its storage type.
    pub ty: GgmlType,
    /// Its shape in PyTorch order (see [`GgufTensorInfo::shape`]).
    pub shape: &'a [usize],
    /// Its raw data, exactly [`GgufTensorInfo::size`] bytes.
    pub data: &'a [u8],
}

/// An open, validated GGUF file. The file stays memory-mapped for as long as
/// this value lives; tensor data is handed out as slices of the map.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
    /// Tensors of ggml type 39 (MXFP4), which no [`GgmlType`] stands for:
    /// name to (shape in PyTorch order, absolute offset, size). Only
    /// gpt-oss's experts are read from them. Empty since
    /// [`GgmlType::MXFP4`] reads type 39: such tensors are ordinary ones.
    mxfp4: HashMap<String, (Vec<usize>, u64, usize)>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, then parses and validates the header,
    /// all metadata and every tensor info (types, shapes, sizes, alignment,
    /// data inside the file). Every error is one line naming the file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let shown = path.display();
        let file = File::open(path).with_context(|| format!("{shown}: cannot open GGUF file"))?;
        let len = file
            .metadata()
            .with_context(|| format!("{shown}: cannot read file metadata"))?
            .len();
        if len < 4 {
            bail!("{shown}: truncated GGUF file: {len} bytes is too short for the magic number");
        }
        // SAFETY: the map is read-only; like every mmap-based model loader we
        // rely on the file not being truncated or rewritten while it is open.
        let mmap = unsafe { Mmap::map(&file) }
            .with_context(|| format!("{shown}: cannot memory-map the file"))?;
        let parsed = parse(&mmap, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            by_name: parsed.by_name,
            mxfp4: parsed.mxfp4,
        })
    }

    /// The MXFP4 tensor `name` (ggml type 39): its shape in PyTorch order
    /// and its raw blocks (per 32 values along a row, one e8m0 scale byte
    /// and 16 bytes of e2m1 nibbles). `None` if the file has no MXFP4
    /// tensor of that name.
    pub fn mxfp4_tensor(&self, name: &str) -> Option<(&[usize], &[u8])> {
        let (shape, offset, size) = self.mxfp4.get(name)?;
        let start = usize::try_from(*offset).ok()?;
        let data = self.mmap.get(start..start.checked_add(*size)?)?;
        Some((shape, data))
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data-section alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The absolute offset where the tensor-data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata key/value pairs, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// The metadata value under `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    fn wrong_type(&self, key: &str, want: &str, got: &GgufValue) -> anyhow::Error {
        anyhow!(
            "{}: metadata key '{key}' should be {want}, but it is a {} ({got})",
            self.path.display(),
            got.type_name()
        )
    }

    /// `key` as an unsigned integer. Any integer type is accepted as long as
    /// the value is non-negative; `Ok(None)` when the key is absent.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v)),
        }
    }

    /// `key` as a `u32` (any integer type whose value fits).
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.get_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v).map(Some).map_err(|_| {
                anyhow!(
                    "{}: metadata key '{key}' = {v} does not fit in 32 bits",
                    self.path.display()
                )
            }),
        }
    }

    /// `key` as a signed integer (any integer type whose value fits in i64).
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "an integer", v)),
        }
    }

    /// `key` as an `f32`; f32, f64 and integer values are accepted.
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f32()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a number", v)),
        }
    }

    /// `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a string", v)),
        }
    }

    /// `key` as a bool.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a bool", v)),
        }
    }

    fn get_array<'a, T>(
        &'a self,
        key: &str,
        want: &str,
        conv: impl Fn(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.wrong_type(key, &format!("an array of {want}"), v))?;
        arr.iter()
            .enumerate()
            .map(|(i, e)| {
                conv(e).ok_or_else(|| {
                    anyhow!(
                        "{}: metadata key '{key}' should be an array of {want}, but element {i} is a {} ({e})",
                        self.path.display(),
                        e.type_name()
                    )
                })
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    /// `key` as an array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.get_array(key, "strings", GgufValue::as_str)
    }

    /// `key` as an array of f32 (f32, f64 and integer elements are accepted).
    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.get_array(key, "numbers", GgufValue::as_f32)
    }

    /// `key` as an array of i32 (any integer elements whose values fit).
    pub fn get_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>> {
        self.get_array(key, "32-bit integers", |v| {
            v.as_i64().and_then(|x| i32::try_from(x).ok())
        })
    }

    /// `key` as an array of bools.
    pub fn get_bool_array(&self, key: &str) -> Result<Option<Vec<bool>>> {
        self.get_array(key, "bools", GgufValue::as_bool)
    }

    /// `key` as an array of u64 (any non-negative integer elements).
    pub fn get_u64_array(&self, key: &str) -> Result<Option<Vec<u64>>> {
        self.get_array(key, "non-negative integers", GgufValue::as_u64)
    }

    /// `general.architecture` (`llama`, `qwen2`, …); an error if absent.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")?.ok_or_else(|| {
            anyhow!(
                "{}: metadata key 'general.architecture' is missing",
                self.path.display()
            )
        })
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`, if the file has it.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Tensor `name` with its data; an error naming the file and the tensor
    /// if it is missing.
    pub fn tensor(&self, name: &str) -> Result<GgufTensor<'_>> {
        let info = self.tensor_info(name).ok_or_else(|| {
            anyhow!(
                "{}: no tensor named '{name}' (the file has {} tensors)",
                self.path.display(),
                self.tensors.len()
            )
        })?;
        // Bounds were validated when the file was opened; `get` keeps this
        // panic-free regardless.
        let start = usize::try_from(info.offset).ok();
        let data = start
            .and_then(|s| Some(s..s.checked_add(info.size)?))
            .and_then(|r| self.mmap.get(r))
            .ok_or_else(|| {
                anyhow!(
                    "{}: tensor '{name}' data lies outside the file",
                    self.path.display()
                )
            })?;
        Ok(GgufTensor {
            name: &info.name,
            ty: info.ty,
            shape: &info.shape,
            data,
        })
    }
}

/// Everything parsed from the bytes of a GGUF file.
/// ggml's type id of MXFP4.
const GGML_TYPE_MXFP4: u32 = 39;

struct Parsed {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    by_name: HashMap<String, usize>,
    mxfp4: HashMap<String, (Vec<usize>, u64, usize)>,
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => bail!(
                "{}: truncated GGUF file: {} needs {n} bytes at offset {}, but the file is {} bytes",
                self.path.display(),
                what(),
                self.pos,
                self.buf.len()
            ),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count or length that must be satisfiable by the bytes left in the
    /// file, given that each item takes at least `min_item_bytes`.
    fn count(&mut self, min_item_bytes: usize, what: &dyn Fn() -> String) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let max = self.remaining() / min_item_bytes.max(1);
        match usize::try_from(n) {
            Ok(n) if n <= max => Ok(n),
            _ => bail!(
                "{}: {} = {n} at offset {at} is impossible: only {} bytes are left in the file (truncated or corrupt)",
                self.path.display(),
                what(),
                self.remaining()
            ),
        }
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.count(1, &|| format!("the length of {}", what()))?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => bail!(
                "{}: {} at offset {at} is not valid UTF-8 ({e})",
                self.path.display(),
                what()
            ),
        }
    }

    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<GgufValue> {
        use value_type as t;
        Ok(match ty {
            t::U8 => GgufValue::U8(u8::from_le_bytes(self.array(what)?)),
            t::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            t::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            t::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            t::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            t::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            t::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            t::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            t::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            t::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            t::BOOL => {
                let at = self.pos;
                match self.array::<1>(what)?[0] {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    b => bail!(
                        "{}: {} at offset {at} is a bool with invalid byte {b}",
                        self.path.display(),
                        what()
                    ),
                }
            }
            t::STRING => GgufValue::String(self.string(what)?),
            t::ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    bail!(
                        "{}: {} nests arrays more than {MAX_ARRAY_DEPTH} deep",
                        self.path.display(),
                        what()
                    );
                }
                let at = self.pos;
                let elem_ty = self.u32(&|| format!("the element type of {}", what()))?;
                let min = match elem_ty {
                    t::U8 | t::I8 | t::BOOL => 1,
                    t::U16 | t::I16 => 2,
                    t::U32 | t::I32 | t::F32 => 4,
                    t::U64 | t::I64 | t::F64 | t::STRING => 8,
                    t::ARRAY => 12,
                    other => bail!(
                        "{}: {} at offset {at} is an array of unknown value type {other}",
                        self.path.display(),
                        what()
                    ),
                };
                let n = self.count(min, &|| format!("the length of {}", what()))?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(
                        self.value(elem_ty, depth + 1, &|| format!("element {i} of {}", what()))?,
                    );
                }
                GgufValue::Array(items)
            }
            other => bail!(
                "{}: {} has unknown value type {other}",
                self.path.display(),
                what()
            ),
        })
    }
}

fn parse(buf: &[u8], path: &Path) -> Result<Parsed> {
    let shown = path.display();
    let mut r = Reader { buf, pos: 0, path };
    let magic: [u8; 4] = r.array(&|| "the magic number".into())?;
    if magic != GGUF_MAGIC {
        bail!(
            "{shown}: not a GGUF file (bad magic {:?}, expected \"GGUF\")",
            String::from_utf8_lossy(&magic)
        );
    }
    let version = r.u32(&|| "the version".into())?;
    if !(2..=3).contains(&version) {
        bail!("{shown}: unsupported GGUF version {version} (only versions 2 and 3 are supported)");
    }
    // A tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type)
    // + 8 (offset) bytes; a key/value at least 8 (key length) + 4 (type) + 1.
    let n_tensors = r.count(24, &|| "the tensor count".into())?;
    let n_kv = r.count(13, &|| "the metadata key/value count".into())?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(&|| format!("the key of metadata entry {i}"))?;
        let ty = r.u32(&|| format!("the value type of metadata key '{key}'"))?;
        let value = r.value(ty, 0, &|| format!("the value of metadata key '{key}'"))?;
        if metadata.contains_key(&key) {
            bail!("{shown}: metadata key '{key}' appears more than once");
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => GGUF_DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a,
            _ => bail!("{shown}: general.alignment = {v} is not a power of two"),
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut by_name = HashMap::with_capacity(n_tensors);
    let mut relative_offsets = Vec::with_capacity(n_tensors);
    let mut mxfp4_infos: Vec<(String, Vec<usize>, u64, usize)> = Vec::new();
    for i in 0..n_tensors {
        let name = r.string(&|| format!("the name of tensor {i}"))?;
        let n_dims = r.u32(&|| format!("the dimension count of tensor '{name}'"))? as usize;
        if n_dims > GGUF_MAX_DIMS {
            bail!("{shown}: tensor '{name}' has {n_dims} dimensions (at most {GGUF_MAX_DIMS} are allowed)");
        }
        let mut ne = Vec::with_capacity(n_dims);
        for d in 0..n_dims {
            let v = r.u64(&|| format!("dimension {d} of tensor '{name}'"))?;
            let v = usize::try_from(v)
                .ok()
                .filter(|&v| v <= i64::MAX as usize)
                .ok_or_else(|| {
                    anyhow!("{shown}: tensor '{name}' has absurd dimension {d} = {v}")
                })?;
            ne.push(v);
        }
        let type_id = r.u32(&|| format!("the type of tensor '{name}'"))?;
        // MXFP4 (ggml type 39): 32 values per block of 17 bytes.
        if type_id == GGML_TYPE_MXFP4 && GgmlType::from_gguf_id(type_id).is_none() {
            let offset = r.u64(&|| format!("the data offset of tensor '{name}'"))?;
            let cols = ne.first().copied().unwrap_or(1);
            if !cols.is_multiple_of(32) {
                bail!("{shown}: MXFP4 tensor '{name}' has rows of {cols} values, not a whole number of 32-value blocks");
            }
            let size = ne
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .map(|n| n / 32 * 17)
                .ok_or_else(|| anyhow!("{shown}: tensor '{name}' shape {ne:?} overflows"))?;
            if offset % alignment != 0 {
                bail!("{shown}: tensor '{name}' data offset {offset} is not a multiple of the alignment {alignment}");
            }
            if by_name.contains_key(&name) || mxfp4_infos.iter().any(|m| m.0 == name) {
                bail!("{shown}: tensor '{name}' appears more than once");
            }
            ne.reverse();
            mxfp4_infos.push((name, ne, offset, size));
            continue;
        }
        let ty = GgmlType::from_gguf_id(type_id).ok_or_else(|| {
            anyhow!("{shown}: tensor '{name}' has unknown or unsupported ggml type id {type_id}")
        })?;
        let offset = r.u64(&|| format!("the data offset of tensor '{name}'"))?;

        // ne[0] is the row length; the other dimensions count rows.
        let cols = ne.first().copied().unwrap_or(1);
        let rows = ne[1.min(ne.len())..]
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| anyhow!("{shown}: tensor '{name}' shape {ne:?} overflows"))?;
        ne.iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| anyhow!("{shown}: tensor '{name}' shape {ne:?} overflows"))?;
        let row_bytes = ty
            .row_bytes(cols)
            .map_err(|e| anyhow!("{shown}: tensor '{name}' ({}, ne {ne:?}): {e}", ty.name()))?;
        let size = row_bytes
            .checked_mul(rows)
            .ok_or_else(|| anyhow!("{shown}: tensor '{name}' size overflows"))?;
        if offset % alignment != 0 {
            bail!("{shown}: tensor '{name}' data offset {offset} is not a multiple of the alignment {alignment}");
        }
        ne.reverse();
        if by_name.contains_key(&name) || mxfp4_infos.iter().any(|m| m.0 == name) {
            bail!("{shown}: tensor '{name}' appears more than once");
        }
        if by_name.insert(name.clone(), tensors.len()).is_some() {
            bail!("{shown}: tensor '{name}' appears more than once");
        }
        relative_offsets.push(offset);
        tensors.push(GgufTensorInfo {
            name,
            ty,
            shape: ne,
            offset: 0,
            size,
        });
    }

    let end_of_infos = r.pos as u64;
    let data_offset = end_of_infos.div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    for (t, rel) in tensors.iter_mut().zip(relative_offsets) {
        let end = data_offset
            .checked_add(rel)
            .and_then(|s| s.checked_add(t.size as u64).map(|e| (s, e)));
        match end {
            Some((start, end)) if end <= file_len => t.offset = start,
            _ => bail!(
                "{shown}: truncated GGUF file: tensor '{}' data ({} bytes at data offset {rel}) runs past the end of the file ({file_len} bytes)",
                t.name,
                t.size
            ),
        }
    }

    let mut mxfp4 = HashMap::with_capacity(mxfp4_infos.len());
    for (name, shape, rel, size) in mxfp4_infos {
        match data_offset
            .checked_add(rel)
            .and_then(|s| Some((s, s.checked_add(size as u64)?)))
        {
            Some((start, end)) if end <= file_len => {
                mxfp4.insert(name, (shape, start, size));
            }
            _ => bail!(
                "{shown}: truncated GGUF file: tensor '{name}' data ({size} bytes at data offset {rel}) runs past the end of the file ({file_len} bytes)"
            ),
        }
    }

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
        by_name,
        mxfp4,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::loader::gguf_writer::{write_gguf, GgufTensorToWrite};

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn sample_tensors() -> Vec<GgufTensorToWrite> {
        let mut q8 = Vec::new();
        // Two Q8_0 rows of 32: each block is an f16 scale and 32 int8.
        for r in 0..2u8 {
            q8.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            q8.extend((0..32u8).map(|i| i.wrapping_add(r)));
        }
        vec![
            GgufTensorToWrite {
                name: "a.weight".into(),
                ty: GgmlType::F32,
                shape: vec![2, 3],
                data: f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            },
            GgufTensorToWrite {
                name: "norm.weight".into(),
                ty: GgmlType::F32,
                shape: vec![5],
                data: f32_bytes(&[0.5; 5]),
            },
            GgufTensorToWrite {
                name: "q.weight".into(),
                ty: GgmlType::Q8_0,
                shape: vec![2, 32],
                data: q8,
            },
        ]
    }

    fn sample_metadata() -> Vec<(&'static str, GgufValue)> {
        vec![
            ("general.architecture", GgufValue::String("llama".into())),
            ("llama.block_count", GgufValue::U32(2)),
            ("llama.rope.freq_base", GgufValue::F32(10000.0)),
            ("some.i8", GgufValue::I8(-3)),
            ("some.u64", GgufValue::U64(1 << 40)),
            ("some.f64", GgufValue::F64(0.25)),
            ("some.bool", GgufValue::Bool(true)),
            (
                "tokenizer.ggml.tokens",
                GgufValue::Array(vec![
                    GgufValue::String("a".into()),
                    GgufValue::String("héllo".into()),
                ]),
            ),
            (
                "tokenizer.ggml.scores",
                GgufValue::Array(vec![GgufValue::F32(-1.0), GgufValue::F32(-2.5)]),
            ),
            (
                "tokenizer.ggml.token_type",
                GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(3)]),
            ),
            (
                "nested",
                GgufValue::Array(vec![
                    GgufValue::Array(vec![GgufValue::U8(1)]),
                    GgufValue::Array(vec![GgufValue::U8(2), GgufValue::U8(3)]),
                ]),
            ),
        ]
    }

    fn write_sample(dir: &Path) -> PathBuf {
        let path = dir.join("sample.gguf");
        write_gguf(&path, &sample_metadata(), &sample_tensors()).expect("write sample");
        path
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_sample(dir.path());
        let g = GgufFile::open(&path).expect("open");
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 32);
        assert_eq!(g.architecture().expect("arch"), "llama");
        assert_eq!(g.get_u64("llama.block_count").expect("u64"), Some(2));
        assert_eq!(g.get_u64("some.u64").expect("u64"), Some(1 << 40));
        assert!(g.get_u64("some.i8").is_err(), "negative is not a u64");
        assert_eq!(g.get_i64("some.i8").expect("i64"), Some(-3));
        assert_eq!(
            g.get_f32("llama.rope.freq_base").expect("f32"),
            Some(10000.0)
        );
        assert_eq!(g.get_f32("some.f64").expect("f32"), Some(0.25));
        assert_eq!(g.get_f32("llama.block_count").expect("f32"), Some(2.0));
        assert_eq!(g.get_bool("some.bool").expect("bool"), Some(true));
        assert_eq!(g.get_u64("missing").expect("missing"), None);
        let err = g.get_str("llama.block_count").unwrap_err().to_string();
        assert!(
            err.contains("llama.block_count") && err.contains("sample.gguf"),
            "{err}"
        );
        assert_eq!(
            g.get_str_array("tokenizer.ggml.tokens").expect("strs"),
            Some(vec!["a", "héllo"])
        );
        assert_eq!(
            g.get_f32_array("tokenizer.ggml.scores").expect("f32s"),
            Some(vec![-1.0, -2.5])
        );
        assert_eq!(
            g.get_i32_array("tokenizer.ggml.token_type").expect("i32s"),
            Some(vec![1, 3])
        );
        assert!(g.get_str_array("tokenizer.ggml.scores").is_err());
        assert_eq!(g.get("nested"), sample_metadata().last().map(|(_, v)| v));

        let want = sample_tensors();
        assert_eq!(g.tensors().len(), want.len());
        for w in &want {
            let t = g.tensor(&w.name).expect("tensor");
            assert_eq!(t.name, w.name);
            assert_eq!(t.ty, w.ty);
            assert_eq!(t.shape, &w.shape[..]);
            assert_eq!(t.data, &w.data[..]);
        }
        for t in g.tensors() {
            assert_eq!(t.offset % 32, 0);
            assert!(t.offset >= g.data_offset());
        }
        let err = g.tensor("nope.weight").unwrap_err().to_string();
        assert!(
            err.contains("nope.weight") && err.contains("sample.gguf"),
            "{err}"
        );
    }

    fn expect_err(bytes: &[u8], needle: &str) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bad.gguf");
        std::fs::write(&path, bytes).expect("write");
        let err = GgufFile::open(&path).expect_err("should fail");
        let msg = format!("{err:#}");
        assert!(
            msg.contains("bad.gguf"),
            "error does not name the file: {msg}"
        );
        assert!(msg.contains(needle), "expected '{needle}' in: {msg}");
        assert!(!msg.contains('\n'), "error is not one line: {msg}");
    }

    #[test]
    fn missing_file() {
        let err = GgufFile::open(Path::new("/nonexistent/dir/model.gguf")).unwrap_err();
        assert!(format!("{err:#}").contains("/nonexistent/dir/model.gguf"));
    }

    #[test]
    fn bad_magic_and_version() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = std::fs::read(write_sample(dir.path())).expect("read");
        let mut b = good.clone();
        b[0..4].copy_from_slice(b"GGML");
        expect_err(&b, "bad magic");
        let mut b = good.clone();
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        expect_err(&b, "unsupported GGUF version 1");
        let mut b = good.clone();
        b[4..8].copy_from_slice(&7u32.to_le_bytes());
        expect_err(&b, "unsupported GGUF version 7");
        // Version 2 has the same layout as version 3.
        let mut b = good;
        b[4..8].copy_from_slice(&2u32.to_le_bytes());
        let path = dir.path().join("v2.gguf");
        std::fs::write(&path, &b).expect("write");
        assert_eq!(GgufFile::open(&path).expect("v2").version(), 2);
        expect_err(b"", "truncated");
        expect_err(b"GG", "truncated");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = std::fs::read(write_sample(dir.path())).expect("read");
        let path = dir.path().join("cut.gguf");
        for cut in 0..good.len() {
            std::fs::write(&path, &good[..cut]).expect("write");
            let err = GgufFile::open(&path).expect_err("truncated file must not open");
            let msg = format!("{err:#}");
            assert!(msg.contains("cut.gguf"), "cut at {cut}: {msg}");
            assert!(
                msg.contains("truncated") || msg.contains("impossible"),
                "cut at {cut}: {msg}"
            );
        }
    }

    #[test]
    fn corrupt_bytes_never_panic() {
        // Overwrite every byte of the header area with values likely to be
        // nasty (0xff lengths, odd types) and check that opening never panics.
        let dir = tempfile::tempdir().expect("tempdir");
        let good = std::fs::read(write_sample(dir.path())).expect("read");
        let path = dir.path().join("corrupt.gguf");
        let header_len = GgufFile::open(&write_sample(dir.path()))
            .expect("open")
            .data_offset() as usize;
        for i in 0..header_len {
            for v in [0x00u8, 0x07, 0x80, 0xff] {
                let mut b = good.clone();
                b[i] = v;
                std::fs::write(&path, &b).expect("write");
                let _ = GgufFile::open(&path);
            }
        }
    }

    /// Builds a GGUF byte stream by hand, for cases the writer refuses to make.
    struct Raw(Vec<u8>);
    impl Raw {
        fn new(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
            let mut b = b"GGUF".to_vec();
            b.extend(version.to_le_bytes());
            b.extend(n_tensors.to_le_bytes());
            b.extend(n_kv.to_le_bytes());
            Raw(b)
        }
        fn str(&mut self, s: &str) -> &mut Raw {
            self.0.extend((s.len() as u64).to_le_bytes());
            self.0.extend(s.as_bytes());
            self
        }
        fn u32(&mut self, v: u32) -> &mut Raw {
            self.0.extend(v.to_le_bytes());
            self
        }
        fn u64(&mut self, v: u64) -> &mut Raw {
            self.0.extend(v.to_le_bytes());
            self
        }
        fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Raw {
            self.str(name).u32(ne.len() as u32);
            for &d in ne {
                self.u64(d);
            }
            self.u32(ty).u64(offset)
        }
        fn pad_and_data(&mut self, align: usize, data: usize) -> Vec<u8> {
            while !self.0.len().is_multiple_of(align) {
                self.0.push(0);
            }
            self.0.extend(std::iter::repeat_n(0u8, data));
            self.0.clone()
        }
    }

    #[test]
    fn unknown_type_id_names_tensor_and_id() {
        let b = Raw::new(3, 1, 0)
            .tensor("blk.0.weird", &[32], 99, 0)
            .pad_and_data(32, 128);
        expect_err(&b, "blk.0.weird");
        expect_err(&b, "99");
    }

    #[test]
    fn absurd_counts_are_rejected_without_allocating() {
        expect_err(&Raw::new(3, u64::MAX, 0).0, "impossible");
        expect_err(&Raw::new(3, 0, 1 << 60).0, "impossible");
        // A string claiming to be 2^62 bytes long.
        let b = Raw::new(3, 0, 1).u64(1 << 62).0.clone();
        expect_err(&b, "impossible");
        // An array claiming 2^40 strings.
        let b = Raw::new(3, 0, 1)
            .str("k")
            .u32(value_type::ARRAY)
            .u32(value_type::STRING)
            .u64(1 << 40)
            .0
            .clone();
        expect_err(&b, "impossible");
        // Too many dimensions.
        let b = Raw::new(3, 1, 0)
            .tensor("t", &[1, 1, 1, 1, 1], 0, 0)
            .pad_and_data(32, 4);
        expect_err(&b, "dimensions");
        // Dimensions whose product overflows.
        let b = Raw::new(3, 1, 0)
            .tensor("t", &[1 << 40, 1 << 40], 0, 0)
            .pad_and_data(32, 4);
        expect_err(&b, "overflows");
        // Deeply nested arrays.
        let mut raw = Raw::new(3, 0, 1);
        raw.str("deep").u32(value_type::ARRAY);
        for _ in 0..100 {
            raw.u32(value_type::ARRAY).u64(1);
        }
        raw.u32(value_type::U8).u64(1);
        raw.0.push(0);
        expect_err(&raw.0, "nests arrays");
    }

    #[test]
    fn misaligned_and_out_of_bounds_tensor_data() {
        let b = Raw::new(3, 1, 0)
            .tensor("t", &[4], 0, 8)
            .pad_and_data(32, 64);
        expect_err(&b, "not a multiple of the alignment 32");
        // With general.alignment = 8 the same offset is fine.
        let b = Raw::new(3, 1, 1)
            .str("general.alignment")
            .u32(value_type::U32)
            .u32(8)
            .tensor("t", &[4], 0, 8)
            .pad_and_data(8, 64);
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("align8.gguf");
        std::fs::write(&path, &b).expect("write");
        let g = GgufFile::open(&path).expect("alignment 8");
        assert_eq!(g.alignment(), 8);
        assert_eq!(g.tensor("t").expect("t").data.len(), 16);
        // Bad alignment value.
        let b = Raw::new(3, 0, 1)
            .str("general.alignment")
            .u32(value_type::U32)
            .u32(24)
            .0
            .clone();
        expect_err(&b, "power of two");
        // Data past the end of the file.
        let b = Raw::new(3, 1, 0)
            .tensor("t", &[1024], 0, 0)
            .pad_and_data(32, 100);
        expect_err(&b, "past the end");
        // Row length not a multiple of the block size.
        let b = Raw::new(3, 1, 0)
            .tensor("q", &[33], 8, 0)
            .pad_and_data(32, 100);
        expect_err(&b, "'q'");
        // Duplicate names.
        let b = Raw::new(3, 2, 0)
            .tensor("t", &[4], 0, 0)
            .tensor("t", &[4], 0, 32)
            .pad_and_data(32, 64);
        expect_err(&b, "more than once");
    }

    #[test]
    fn file_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<GgufFile>();
    }
}
