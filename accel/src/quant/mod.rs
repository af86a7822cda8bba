//! Weight matrices in their storage type, and the matmul kernels over them.
//!
//! A [`Weight`] keeps a GGUF tensor the way it came off disk: quantized stays
//! quantized, bf16 stays bf16. Decode is memory-bound (every token streams
//! every weight once), so the bytes read per weight are what sets the speed;
//! converting to f32 at load would quadruple them.
//!
//! Quantized matmuls quantize the activations once per call to 8 bits (one
//! f32 scale per lane block of 32, or 16 for Q6_K) and run integer dot
//! products: AVX-512 VNNI, AVX2, or scalar, picked once per call. At load the
//! quants are repacked ([`layout`]) so that each 32-bit lane of a SIMD register
//! accumulates one block's whole dot product; the per-block scales are then
//! applied with one vector FMA per 16 blocks instead of one per block.
//! Batched calls (from about 12 activation rows) on CPUs with AMX-INT8 run the
//! integer products on the tile unit instead ([`amx`]), with the same float
//! arithmetic, so a row's result is bitwise the same at any batch size.
//!
//! Dense weights (f32/f16/bf16) use register-tiled SIMD dot products that
//! widen f16/bf16 in registers ([`dense`]).
//!
//! [`Weight::matmul_rows`] lets a caller mark rows that need not equal their
//! one-row result (the engine marks the prompt positions of long prompts):
//! on CPUs with AMX-BF16 those run dense bf16 tile products with no
//! per-block epilogue ([`amx_bf16`]), 1.5–2.5× faster for a prompt's many
//! rows.
//!
//! Weights built for [`SimdLevel::AmxBf16`] ([`Weight::from_raw_at`]; the
//! engine does so when it runs more than two sequences at once) take a
//! third path for Q4_0, Q4_1 and Q8_0: a tile layout whose bf16 kernel
//! ([`bf16_tiles`]) serves every row at every batch size, costing about as
//! much for 16 rows as for one.

mod act;
pub mod affine;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_bf16;
#[cfg(target_arch = "x86_64")]
mod bf16;
#[cfg(target_arch = "x86_64")]
mod bf16_tiles;
mod dense;
pub(crate) mod formats;
mod layout;
pub mod mxfp4;
mod prefetch;
pub use prefetch::{decode_prefetch, set_decode_prefetch, DecodePrefetch};
mod qkern;
#[cfg(test)]
mod tests;

use crate::cpu::pool::ThreadPool;
use crate::cpu::SimdLevel;
pub use affine::{Affine, StaticActQuant};
use layout::{ABuf, QMat};

/// The GGML tensor types Pagoda can load and multiply.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// IEEE f32.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16 (the top half of an f32).
    BF16,
    /// 32-element blocks: f16 scale, 4-bit quants, value `(q - 8) * d`.
    Q4_0,
    /// 32-element blocks: f16 scale and min, 4-bit quants, value `q * d + m`.
    Q4_1,
    /// 32-element blocks: f16 scale, 8-bit signed quants, value `q * d`.
    Q8_0,
    /// 256-element super-blocks of eight 32-element sub-blocks with 6-bit
    /// scales and mins, 4-bit quants.
    Q4_K,
    /// 256-element super-blocks of sixteen 16-element sub-blocks with 8-bit
    /// scales, 6-bit quants.
    Q6_K,
    /// 32-element blocks: an e8m0 exponent `e` and 4-bit e2m1 codes
    /// (OCP microscaling FP4), value `e2m1(q) · 2^(e − 127)`; see [`mxfp4`].
    MXFP4,
}

impl GgmlType {
    /// Maps a GGUF tensor type id to the type, or `None` for types Pagoda does
    /// not support.
    pub fn from_gguf_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            39 => GgmlType::MXFP4,
            _ => return None,
        })
    }

    /// The GGUF tensor type id.
    pub fn gguf_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
            GgmlType::MXFP4 => 39,
        }
    }

    /// The conventional name, as ggml spells it ("Q4_1", "BF16", ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::MXFP4 => "MXFP4",
        }
    }

    /// Elements per block: 1 for the float types, 32 or 256 (K-quants).
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::MXFP4 => 32,
            GgmlType::Q4_K | GgmlType::Q6_K => 256,
        }
    }

    /// Bytes per block in the GGUF layout.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_K => 144,
            GgmlType::Q6_K => 210,
            GgmlType::MXFP4 => mxfp4::BLOCK_BYTES,
        }
    }

    /// Whether the type is one of the plain float types.
    pub fn is_float(self) -> bool {
        self.block_len() == 1
    }

    /// Bytes of one GGUF row of `cols` elements; an error unless `cols` is a
    /// whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Result<usize, WeightError> {
        let bl = self.block_len();
        if !cols.is_multiple_of(bl) {
            return Err(WeightError::ColsNotBlockMultiple {
                ty: self,
                cols,
                block_len: bl,
            });
        }
        (cols / bl)
            .checked_mul(self.block_bytes())
            .ok_or(WeightError::TooLarge { rows: 1, cols })
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a weight matrix could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The data length does not match `rows × cols` of the type.
    #[error("{ty} weight [{rows} x {cols}]: expected {expected} {unit}, got {got}")]
    WrongLength {
        /// The storage type.
        ty: GgmlType,
        /// Rows (output features).
        rows: usize,
        /// Columns (input features).
        cols: usize,
        /// The length the shape requires.
        expected: usize,
        /// The length given.
        got: usize,
        /// What is counted: "bytes" or "elements".
        unit: &'static str,
    },
    /// Quantized rows must be whole blocks.
    #[error("{ty} weight: {cols} columns is not a multiple of the block length {block_len}")]
    ColsNotBlockMultiple {
        /// The storage type.
        ty: GgmlType,
        /// The column count given.
        cols: usize,
        /// Elements per block of `ty`.
        block_len: usize,
    },
    /// `rows × cols` overflows.
    #[error("weight shape [{rows} x {cols}] is too large")]
    TooLarge {
        /// Rows given.
        rows: usize,
        /// Columns given.
        cols: usize,
    },
    /// [`Weight::quantize`] cannot produce this type.
    #[error("quantizing to {0} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)")]
    QuantizeUnsupported(GgmlType),
    /// [`crate::HostMatrix::concat_rows`] parts disagree.
    #[error("concat_rows: part {index} is {got_ty} with {got_cols} columns, expected {ty} with {cols} columns")]
    ConcatMismatch {
        /// Index of the offending part.
        index: usize,
        /// The first part's type.
        ty: GgmlType,
        /// The first part's column count.
        cols: usize,
        /// The offending part's type.
        got_ty: GgmlType,
        /// The offending part's column count.
        got_cols: usize,
    },
    /// [`crate::HostMatrix::concat_rows`] was given no parts.
    #[error("concat_rows: no parts given")]
    ConcatEmpty,
    /// [`crate::HostMatrix::concat_rows`] parts read their input
    /// differently (another column order or static input scale).
    #[error("concat_rows: part {index} permutes or quantizes its input differently from part 0")]
    ConcatAffineMismatch {
        /// Index of the offending part.
        index: usize,
    },
    /// An [`Affine`] does not fit its matrix.
    #[error("weight [{rows} x {cols}]: {what}")]
    Affine {
        /// Rows of the matrix.
        rows: usize,
        /// Columns of the matrix.
        cols: usize,
        /// What is wrong.
        what: String,
    },
}

/// How a [`Weight`] is held in memory.
enum Repr {
    /// Row-major f32, f16 or bf16 elements (the type says which).
    Dense(ABuf),
    /// Repacked quantized blocks; see [`layout`].
    Quant(Box<QMat>),
    /// Q4_0, Q4_1 or Q8_0 in 16-row tiles for the bf16 tile kernel
    /// ([`bf16_tiles`]), at [`SimdLevel::AmxBf16`].
    #[cfg(target_arch = "x86_64")]
    Tiles(Box<bf16_tiles::TileMat>),
    /// MXFP4 blocks as GGUF stores them, multiplied with f32 activations
    /// ([`mxfp4::matmul`]; Hugging Face checkpoints).
    Mxfp4(ABuf),
    /// MXFP4 blocks re-laid out for the Q8-activation kernel
    /// ([`mxfp4::matmul_q8`]; GGUF files, as llama.cpp).
    Mxfp4Q8(ABuf),
}

/// A 2-D weight matrix `[rows = out_features, cols = in_features]`, kept in
/// its storage type in memory (quantized stays quantized; bf16 stays bf16).
pub struct Weight {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    repr: Repr,
    /// The scheme's transforms around the matrix, if any ([`affine`]).
    affine: Option<Box<Affine>>,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weight({} [{} x {}])", self.ty, self.rows, self.cols)
    }
}

fn checked_len(rows: usize, cols: usize) -> Result<usize, WeightError> {
    rows.checked_mul(cols)
        .ok_or(WeightError::TooLarge { rows, cols })
}

fn check_elems(ty: GgmlType, rows: usize, cols: usize, got: usize) -> Result<(), WeightError> {
    let expected = checked_len(rows, cols)?;
    if got != expected {
        return Err(WeightError::WrongLength {
            ty,
            rows,
            cols,
            expected,
            got,
            unit: "elements",
        });
    }
    Ok(())
}

impl Weight {
    /// Builds a weight from GGUF bytes: row-major, each row `cols /
    /// block_len` little-endian blocks. Validates the length, then copies
    /// into aligned storage (quantized types are repacked for the kernels
    /// of [`crate::cpu::simd_level`]).
    pub fn from_raw(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Weight, WeightError> {
        Weight::from_raw_at(crate::cpu::simd_level(), ty, rows, cols, bytes)
    }

    /// [`Weight::from_raw`], laid out for the kernels of `level` (clamped
    /// to what the CPU supports), so tests and benchmarks can compare
    /// levels on one machine. At [`SimdLevel::AmxBf16`] Q4_0, Q4_1 and
    /// Q8_0 get the bf16 tile layout, which only the bf16 tile kernel reads:
    /// [`Weight::matmul_at`] then runs that kernel at any level.
    pub fn from_raw_at(
        level: SimdLevel,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Weight, WeightError> {
        let row_bytes = ty.row_bytes(cols)?;
        let expected = rows
            .checked_mul(row_bytes)
            .ok_or(WeightError::TooLarge { rows, cols })?;
        if bytes.len() != expected {
            return Err(WeightError::WrongLength {
                ty,
                rows,
                cols,
                expected,
                got: bytes.len(),
                unit: "bytes",
            });
        }
        let repr = if ty == GgmlType::MXFP4 {
            Repr::Mxfp4Q8(mxfp4::interleave(bytes, rows, cols))
        } else if ty.is_float() {
            let mut buf = ABuf::zeroed(bytes.len());
            buf.bytes_mut().copy_from_slice(bytes);
            Repr::Dense(buf)
        } else {
            Weight::quant_repr(level.min(max_level()), ty, rows, cols, bytes)
        };
        Ok(Weight {
            ty,
            rows,
            cols,
            repr,
            affine: None,
        })
    }

    /// An MXFP4 weight from GGUF's blocks (`rows × cols`, as
    /// [`Weight::from_raw`] takes them) whose products keep the
    /// activations in f32, exact up to summation order against the
    /// decoded matrix: how Hugging Face checkpoints are served (see
    /// [`mxfp4`]). [`Weight::from_raw`] quantizes the activations to 8 bits
    /// instead, as llama.cpp does for GGUF files.
    pub fn from_mxfp4_f32_act(
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Weight, WeightError> {
        let ty = GgmlType::MXFP4;
        let expected = rows
            .checked_mul(ty.row_bytes(cols)?)
            .ok_or(WeightError::TooLarge { rows, cols })?;
        if bytes.len() != expected {
            return Err(WeightError::WrongLength {
                ty,
                rows,
                cols,
                expected,
                got: bytes.len(),
                unit: "bytes",
            });
        }
        let mut buf = ABuf::zeroed(bytes.len());
        buf.bytes_mut().copy_from_slice(bytes);
        Ok(Weight {
            ty,
            rows,
            cols,
            repr: Repr::Mxfp4(buf),
            affine: None,
        })
    }

    /// Wraps the matrix in `affine` (see [`affine`]), checked against its
    /// shape; an identity transform is dropped.
    pub fn with_affine(mut self, affine: Option<Affine>) -> Result<Weight, WeightError> {
        self.affine = match affine {
            Some(a) if !a.is_identity() => {
                a.check(self.rows, self.cols)?;
                Some(Box::new(a))
            }
            _ => None,
        };
        Ok(self)
    }

    /// The transforms around the matrix, if any.
    pub fn affine(&self) -> Option<&Affine> {
        self.affine.as_deref()
    }

    fn quant_repr(level: SimdLevel, ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Repr {
        #[cfg(target_arch = "x86_64")]
        if level == SimdLevel::AmxBf16 {
            if let Some(kind) = bf16_tiles::kind_of(ty) {
                return Repr::Tiles(Box::new(bf16_tiles::TileMat::from_gguf(
                    kind, rows, cols, bytes,
                )));
            }
        }
        let _ = level;
        Repr::Quant(Box::new(QMat::from_gguf(ty, rows, cols, bytes)))
    }

    /// Builds an F32 weight from row-major data.
    pub fn from_f32(rows: usize, cols: usize, data: &[f32]) -> Result<Weight, WeightError> {
        check_elems(GgmlType::F32, rows, cols, data.len())?;
        Weight::from_raw(GgmlType::F32, rows, cols, bytemuck::cast_slice(data))
    }

    /// Builds an F16 weight from row-major IEEE half bit patterns.
    pub fn from_f16_bits(rows: usize, cols: usize, data: &[u16]) -> Result<Weight, WeightError> {
        check_elems(GgmlType::F16, rows, cols, data.len())?;
        Weight::from_raw(GgmlType::F16, rows, cols, bytemuck::cast_slice(data))
    }

    /// Builds a BF16 weight from row-major bfloat16 bit patterns.
    pub fn from_bf16_bits(rows: usize, cols: usize, data: &[u16]) -> Result<Weight, WeightError> {
        check_elems(GgmlType::BF16, rows, cols, data.len())?;
        Weight::from_raw(GgmlType::BF16, rows, cols, bytemuck::cast_slice(data))
    }

    /// Quantizes row-major f32 data to Q8_0, Q4_0 or Q4_1 with ggml's
    /// round-to-nearest reference quantizers, or converts it to F32, F16 or
    /// BF16 (round to nearest even). K-quants are an error: their quantizers
    /// search for scales, and Pagoda only ever loads them from files.
    pub fn quantize(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<Weight, WeightError> {
        check_elems(ty, rows, cols, data.len())?;
        match ty {
            GgmlType::F32 => Weight::from_f32(rows, cols, data),
            GgmlType::F16 => {
                let bits: Vec<u16> = data
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect();
                Weight::from_f16_bits(rows, cols, &bits)
            }
            GgmlType::BF16 => {
                let bits: Vec<u16> = data
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                Weight::from_bf16_bits(rows, cols, &bits)
            }
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let bytes = formats::quantize_rows(ty, rows, cols, data)?;
                Weight::from_raw(ty, rows, cols, &bytes)
            }
            GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::MXFP4 => {
                Err(WeightError::QuantizeUnsupported(ty))
            }
        }
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

    /// The row-major bytes of a dense (F32, F16 or BF16) matrix without
    /// transforms; `None` for quantized layouts.
    pub fn dense_bytes(&self) -> Option<&[u8]> {
        match (&self.repr, &self.affine) {
            (Repr::Dense(b), None) => Some(b.bytes()),
            _ => None,
        }
    }

    /// Bytes the matrix occupies in memory (what a matmul streams).
    pub fn size_bytes(&self) -> usize {
        let affine = self.affine.as_ref().map_or(0, |a| a.size_bytes());
        affine
            + match &self.repr {
                Repr::Dense(b) => b.len(),
                Repr::Quant(q) => q.size_bytes(),
                #[cfg(target_arch = "x86_64")]
                Repr::Tiles(t) => t.size_bytes(),
                Repr::Mxfp4(b) | Repr::Mxfp4Q8(b) => b.len(),
            }
    }

    /// Dequantizes row `row` into `out[..cols]` (the embedding gather).
    ///
    /// # Panics
    /// If `row >= rows` or `out` is shorter than `cols`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "dequantize_row: row {row} out of range ({} rows)",
            self.rows
        );
        let out = &mut out[..self.cols];
        match &self.repr {
            Repr::Dense(b) => {
                let bytes = &b.bytes()[row * self.cols * elem_bytes(self.ty)..]
                    [..self.cols * elem_bytes(self.ty)];
                dense::row_to_f32(self.ty, bytes, out);
            }
            Repr::Quant(q) => q.dequantize_row(row, out),
            #[cfg(target_arch = "x86_64")]
            Repr::Tiles(t) => t.dequantize_row(row, out),
            Repr::Mxfp4(b) => {
                let rb = self.cols / mxfp4::BLOCK_LEN * mxfp4::BLOCK_BYTES;
                mxfp4::dequantize_row(&b.bytes()[row * rb..(row + 1) * rb], out);
            }
            Repr::Mxfp4Q8(b) => {
                let rb = self.cols / mxfp4::BLOCK_LEN * mxfp4::BLOCK_BYTES;
                mxfp4::dequantize_interleaved_row(&b.bytes()[row * rb..(row + 1) * rb], out);
            }
        }
        if let Some(a) = &self.affine {
            a.finish_row(row, out);
        }
    }

    /// `out[i][n] = Σ_k x[i][k] · W[n][k]` for `x: [m, cols]` and
    /// `out: [m, rows]`, both row-major f32, run on `pool`.
    ///
    /// Allocates nothing once `scratch` has served a call of the same `m` and
    /// `cols` (or larger), so a decode step is allocation-free.
    ///
    /// # Panics
    /// If `x` is shorter than `m × cols` or `out` shorter than `m × rows`.
    pub fn matmul(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
    ) {
        self.matmul_at(crate::cpu::simd_level(), pool, x, m, out, scratch);
    }

    /// `out = x · Wᵀ` as [`Weight::matmul`], for the rows of a whole
    /// prompt that never decode (encoder rows): a dense weight (f32, f16,
    /// bf16, widened to f32 as `matmul` does) goes through the cache-blocked
    /// GEMM ([`dense::gemm`]), whose rows are rounded differently from
    /// `matmul`'s but are still each a function of the row alone; other
    /// types are `matmul`.
    pub fn matmul_gemm(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
    ) {
        self.matmul_gemm_at(crate::cpu::simd_level(), pool, x, m, out, scratch);
    }

    /// [`Weight::matmul_gemm`] at an explicit SIMD level.
    pub fn matmul_gemm_at(
        &self,
        level: SimdLevel,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
    ) {
        let Repr::Dense(b) = &self.repr else {
            return self.matmul_at(level, pool, x, m, out, scratch);
        };
        let level = level.min(max_level());
        self.with_affine_io(x, m, out, scratch, |w, x, out, _| {
            assert!(
                x.len() >= m * w.cols && out.len() >= m * w.rows,
                "matmul_gemm: x or out shorter than {m} rows"
            );
            if m == 0 || w.rows == 0 {
                return;
            }
            if w.cols == 0 {
                out[..m * w.rows].fill(0.0);
                return;
            }
            dense::gemm(w.ty, b, w.rows, w.cols, level, pool, x, m, out)
        });
    }

    /// [`Weight::matmul`] at an explicit SIMD level (clamped to what the CPU
    /// supports), so tests and benchmarks can run every kernel on one machine.
    pub fn matmul_at(
        &self,
        level: SimdLevel,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
    ) {
        self.with_affine_io(x, m, out, scratch, |w, x, out, scratch| {
            w.raw_matmul_at(level, pool, x, m, out, scratch)
        });
    }

    /// Runs `f` (a product over the stored matrix) with the input and
    /// output transforms of [`Weight::affine`] around it. The rewritten
    /// input lives in `scratch`, so a warm call allocates nothing.
    fn with_affine_io(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
        f: impl FnOnce(&Weight, &[f32], &mut [f32], &mut MatmulScratch),
    ) {
        let Some(a) = self.affine.as_deref() else {
            return f(self, x, out, scratch);
        };
        assert!(
            x.len() >= m * self.cols && out.len() >= m * self.rows,
            "matmul: x or out shorter than {m} rows"
        );
        if a.touches_input() {
            let mut ax = std::mem::take(&mut scratch.affine_x);
            grow(&mut ax, m * self.cols);
            a.prepare_input(x, m, self.cols, &mut ax);
            f(self, &ax[..m * self.cols], out, scratch);
            scratch.affine_x = ax;
        } else {
            f(self, x, out, scratch);
        }
        a.finish_output(out, m, self.rows);
    }

    /// [`Weight::matmul_at`] over the stored matrix alone.
    fn raw_matmul_at(
        &self,
        level: SimdLevel,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
    ) {
        let level = level.min(max_level());
        assert!(
            x.len() >= m * self.cols,
            "matmul: x has {} elements, need {m} x {}",
            x.len(),
            self.cols
        );
        assert!(
            out.len() >= m * self.rows,
            "matmul: out has {} elements, need {m} x {}",
            out.len(),
            self.rows
        );
        if m == 0 || self.rows == 0 {
            return;
        }
        let x = &x[..m * self.cols];
        let out = &mut out[..m * self.rows];
        if self.cols == 0 {
            out.fill(0.0);
            return;
        }
        match &self.repr {
            Repr::Dense(b) => {
                dense::matmul(self.ty, b, self.rows, self.cols, level, pool, x, m, out)
            }
            Repr::Quant(q) => qkern::matmul(q, level, pool, x, m, out, scratch),
            Repr::Mxfp4(b) => mxfp4::matmul(b, self.rows, self.cols, level, pool, x, m, out),
            Repr::Mxfp4Q8(b) => {
                mxfp4::matmul_q8(b, self.rows, self.cols, level, pool, x, m, out, scratch)
            }
            #[cfg(target_arch = "x86_64")]
            Repr::Tiles(t) => {
                let (rows, kind) = (self.rows, t.kind);
                // SAFETY: tile weights exist only where the level is
                // AmxBf16 (checked at build), so AMX-BF16 and AVX512-BF16
                // are there; `x` holds `m × cols` (asserted above); tasks own
                // disjoint 16-row column ranges of `out`.
                scratch.reserve_on_threads(pool, ThreadBuffers::Tiles, t.blocks);
                unsafe {
                    scratch.tile_act.build(pool, x, m, self.cols);
                    let act = &scratch.tile_act;
                    let o = OutPtr(out.as_mut_ptr());
                    pool.run_ranges(rows.div_ceil(16), 1, &|t0, t1| match kind {
                        layout::K_Q4_0 => {
                            bf16_tiles::run_tiles::<{ layout::K_Q4_0 }>(t, act, m, t0, t1, o, rows)
                        }
                        layout::K_Q4_1 => {
                            bf16_tiles::run_tiles::<{ layout::K_Q4_1 }>(t, act, m, t0, t1, o, rows)
                        }
                        _ => {
                            bf16_tiles::run_tiles::<{ layout::K_Q8_0 }>(t, act, m, t0, t1, o, rows)
                        }
                    });
                }
            }
        }
    }
}

impl Weight {
    /// [`Weight::matmul`], except that the rows flagged in `wide` (one flag
    /// per row) may run on the dense bf16 tile kernel ([`amx_bf16`]) where
    /// this CPU has AMX-BF16 and the weight suits it ([`Weight::has_wide_kernel`]).
    /// A wide row's result then differs from `matmul`'s by bf16 rounding,
    /// but still depends on nothing but the row and the weight: not on the
    /// other rows, their number or order, or the thread count. Unflagged
    /// rows get exactly `matmul`'s results.
    ///
    /// # Panics
    /// As [`Weight::matmul`], and if `wide` does not hold `m` flags.
    pub fn matmul_rows(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
        wide: &[bool],
    ) {
        assert_eq!(wide.len(), m, "matmul_rows: one flag per row");
        self.with_affine_io(x, m, out, scratch, |w, x, out, scratch| {
            w.raw_matmul_rows(pool, x, m, out, scratch, wide)
        });
    }

    /// [`Weight::matmul_rows`] over the stored matrix alone.
    fn raw_matmul_rows(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        scratch: &mut MatmulScratch,
        wide: &[bool],
    ) {
        let level = crate::cpu::simd_level();
        if !self.has_wide_kernel() || !wide.contains(&true) {
            return self.raw_matmul_at(level, pool, x, m, out, scratch);
        }
        assert!(
            x.len() >= m * self.cols && out.len() >= m * self.rows,
            "matmul_rows: x or out shorter than {m} rows"
        );
        let (cols, rows) = (self.cols, self.rows);
        let mut wide_rows = std::mem::take(&mut scratch.wide_rows);
        let mut exact_rows = std::mem::take(&mut scratch.exact_rows);
        wide_rows.clear();
        exact_rows.clear();
        for (i, &w) in wide.iter().enumerate() {
            if w {
                wide_rows.push(i);
            } else {
                exact_rows.push(i);
            }
        }
        if !exact_rows.is_empty() {
            // The exact rows as a batch of their own, so they get exactly
            // what `matmul` gives them.
            let mut ex = std::mem::take(&mut scratch.exact_x);
            let mut eo = std::mem::take(&mut scratch.exact_out);
            let me = exact_rows.len();
            grow(&mut ex, me * cols);
            grow(&mut eo, me * rows);
            for (k, &r) in exact_rows.iter().enumerate() {
                ex[k * cols..(k + 1) * cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
            }
            self.raw_matmul_at(level, pool, &ex, me, &mut eo, scratch);
            for (k, &r) in exact_rows.iter().enumerate() {
                out[r * rows..(r + 1) * rows].copy_from_slice(&eo[k * rows..(k + 1) * rows]);
            }
            scratch.exact_x = ex;
            scratch.exact_out = eo;
        }
        #[cfg(target_arch = "x86_64")]
        if let Repr::Quant(q) = &self.repr {
            let kind = q.kind;
            scratch.reserve_on_threads(pool, ThreadBuffers::Wide, q.lanes);
            // SAFETY: `has_wide_kernel` checked the level (AMX with BF16,
            // so AVX-512 too) and the kind; every index in `wide_rows` is a
            // row of `x` and `out` (checked above); tasks own disjoint
            // 16-row column ranges of `out`.
            unsafe {
                scratch
                    .wide
                    .build(pool, kind, &x[..m * cols], cols, q.lanes, &wide_rows);
                let act = &scratch.wide;
                let o = OutPtr(out.as_mut_ptr());
                let idx = &wide_rows[..];
                pool.run_ranges(rows, 16, &|r0, r1| match kind {
                    layout::K_Q4_0 => {
                        amx_bf16::run_rows::<{ layout::K_Q4_0 }>(q, act, idx, r0, r1, o, rows)
                    }
                    layout::K_Q4_1 => {
                        amx_bf16::run_rows::<{ layout::K_Q4_1 }>(q, act, idx, r0, r1, o, rows)
                    }
                    _ => amx_bf16::run_rows::<{ layout::K_Q8_0 }>(q, act, idx, r0, r1, o, rows),
                });
            }
        }
        scratch.wide_rows = wide_rows;
        scratch.exact_rows = exact_rows;
    }

    /// Whether [`Weight::matmul_rows`] has a separate kernel for wide rows
    /// on this CPU: Q4_0, Q4_1 or Q8_0 weights with whole 16-row tiles, and
    /// AMX-BF16 at the current SIMD level.
    pub fn has_wide_kernel(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Repr::Quant(q) = &self.repr {
            return crate::cpu::simd_level() == SimdLevel::Amx
                && crate::cpu::amx::has_bf16()
                && amx::supports(q.kind)
                && q.rows.is_multiple_of(16);
        }
        false
    }
}

/// The best level this CPU can run, ignoring `PAGODA_SIMD` (which only lowers
/// the default that [`crate::cpu::simd_level`] reports).
fn max_level() -> SimdLevel {
    crate::cpu::detected_level()
}

fn elem_bytes(ty: GgmlType) -> usize {
    ty.block_bytes()
}

/// Reusable buffers for [`Weight::matmul`]: the quantized activations of
/// the quantized types (dense types need none). Grows on demand, never
/// shrinks, so a warmed-up scratch makes matmul allocation-free.
#[derive(Default)]
pub struct MatmulScratch {
    /// Activation quants, laid out like the weight quants ([`layout`]).
    aq: Vec<i8>,
    /// Activation scale per lane block.
    ad: Vec<f32>,
    /// Sum of the activation quants per lane block.
    asum: Vec<i32>,
    /// `ad × asum` per lane block (for the min terms of Q4_1 / Q4_K).
    ascaled: Vec<f32>,
    /// The activations rearranged for the AMX tile kernel.
    #[cfg(target_arch = "x86_64")]
    tiles: amx::ActTiles,
    /// [`Weight::matmul_rows`]: the wide rows' activations as bf16 tiles,
    /// the wide and the exact rows' indices, and the exact rows gathered
    /// (in and out) when both kinds are present.
    #[cfg(target_arch = "x86_64")]
    wide: amx_bf16::WideAct,
    /// The activations as bf16 B tiles for tile-laid-out weights.
    #[cfg(target_arch = "x86_64")]
    tile_act: bf16_tiles::TileAct,
    wide_rows: Vec<usize>,
    exact_rows: Vec<usize>,
    exact_x: Vec<f32>,
    exact_out: Vec<f32>,
    /// The input as an [`Affine`] rewrites it (gathered, rounded).
    affine_x: Vec<f32>,
    /// How far the tile kernels' per-thread buffers are grown on the
    /// threads of one pool.
    #[cfg(target_arch = "x86_64")]
    reserved: ThreadReserve,
}

/// The sizes every thread of pool `pool` has grown the tile kernels'
/// per-thread buffers to. Which thread runs which task of a region is up to
/// timing, so a thread that sat out the first calls would otherwise grow its
/// buffers in the middle of serving; [`MatmulScratch::reserve_on_threads`]
/// grows them on all threads at once instead.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct ThreadReserve {
    pool: u64,
    amx_lanes: usize,
    wide_lanes: usize,
    tile_blocks: usize,
}

/// Which kernel's per-thread buffers to grow.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum ThreadBuffers {
    /// [`amx::run_rows`], by lane blocks.
    Amx,
    /// [`amx_bf16::run_rows`], by lane blocks.
    Wide,
    /// [`bf16_tiles::run_tiles`], by blocks per row.
    Tiles,
}

#[cfg(target_arch = "x86_64")]
impl MatmulScratch {
    /// Grows `which` kernel's per-thread buffers to `size` on every thread
    /// of `pool`, unless this scratch already did.
    fn reserve_on_threads(&mut self, pool: &ThreadPool, which: ThreadBuffers, size: usize) {
        let r = &mut self.reserved;
        if r.pool != pool.id() {
            *r = ThreadReserve {
                pool: pool.id(),
                ..ThreadReserve::default()
            };
        }
        let have = match which {
            ThreadBuffers::Amx => &mut r.amx_lanes,
            ThreadBuffers::Wide => &mut r.wide_lanes,
            ThreadBuffers::Tiles => &mut r.tile_blocks,
        };
        if *have >= size {
            return;
        }
        pool.broadcast(&|_| match which {
            ThreadBuffers::Amx => amx::reserve_thread_scratch(size),
            ThreadBuffers::Wide => amx_bf16::reserve_thread_scratch(size),
            ThreadBuffers::Tiles => bf16_tiles::reserve_thread_scratch(size),
        });
        *have = size;
    }
}

/// Grows `v` to at least `n` elements; never shrinks (no allocation once warm).
fn grow<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// A raw output pointer that pool tasks write disjoint elements through.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of output elements, and the pool
// joins all tasks before `matmul` returns the borrow.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}
