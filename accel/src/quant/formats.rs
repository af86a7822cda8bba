//! The GGUF block formats: decoding blocks into quant codes, and ggml's
//! round-to-nearest reference quantizers for the 32-element types.
//!
//! Layouts (little-endian; `f16` is an IEEE half):
//! - Q4_0 (18 B / 32): `d: f16, qs[16]`; element `j < 16` is the low nibble
//!   of `qs[j]`, element `j + 16` its high nibble; value `(q - 8) · d`.
//! - Q4_1 (20 B / 32): `d: f16, m: f16, qs[16]` as Q4_0; value `q · d + m`.
//! - Q8_0 (34 B / 32): `d: f16, qs: i8[32]`; value `q · d`.
//! - Q4_K (144 B / 256): `d: f16, dmin: f16, scales[12], qs[128]`; eight
//!   sub-blocks of 32 with 6-bit scale `sc` and min `mn` ([`scale_min_k4`]);
//!   byte `qs[32c + l]` holds element `64c + l` (low nibble) and
//!   `64c + 32 + l` (high nibble); value `d · sc · q − dmin · mn`.
//! - Q6_K (210 B / 256): `ql[128], qh[64], scales: i8[16], d: f16`; see
//!   [`q6k_codes`]; value `d · scales[e / 16] · (q − 32)`.

use super::{GgmlType, WeightError};

/// Reads the little-endian f16 at byte `i` as f32.
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16_at(b, i)).to_f32()
}

/// Reads the little-endian u16 at byte `i`.
pub(crate) fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// The 6-bit scale and min of sub-block `j` (0..8) from a Q4_K block's 12
/// packed scale bytes. Sub-blocks 0..4 keep theirs in the low 6 bits of bytes
/// `j` (scale) and `j + 4` (min); sub-blocks 4..8 split theirs into a low
/// nibble in byte `j + 4` (scale low, min high nibble) and two high bits in
/// the top bits of bytes `j - 4` (scale) and `j` (min).
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        let sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        let mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (sc, mn)
    }
}

/// The 4-bit codes of one 144-byte Q4_K block, in element order.
pub(crate) fn q4k_codes(block: &[u8]) -> [u8; 256] {
    let qs = &block[16..144];
    let mut codes = [0u8; 256];
    for c in 0..4 {
        for l in 0..32 {
            let byte = qs[32 * c + l];
            codes[64 * c + l] = byte & 0x0f;
            codes[64 * c + 32 + l] = byte >> 4;
        }
    }
    codes
}

/// The 6-bit codes (0..64) of one 210-byte Q6_K block, in element order.
///
/// Each half `h` of 128 elements uses `ql[64h..64h+64]` and `qh[32h..32h+32]`;
/// its quarter `q` (32 elements, index `l`) takes the low (`q < 2`) or high
/// nibble of `ql[64h + 32(q % 2) + l]` and bits `2q..2q+2` of `qh[32h + l]`
/// as bits 4..6.
pub(crate) fn q6k_codes(block: &[u8]) -> [u8; 256] {
    let ql = &block[0..128];
    let qh = &block[128..192];
    let mut codes = [0u8; 256];
    for h in 0..2 {
        for q in 0..4 {
            for l in 0..32 {
                let low = ql[64 * h + 32 * (q % 2) + l];
                let low = if q < 2 { low & 0x0f } else { low >> 4 };
                let high = (qh[32 * h + l] >> (2 * q)) & 3;
                codes[128 * h + 32 * q + l] = low | (high << 4);
            }
        }
    }
    codes
}

/// Quantizes `rows` rows of `cols` row-major f32 values into the GGUF
/// bytes of `ty` (Q8_0, Q4_0 or Q4_1), one [`quantize_row`] per row.
/// `values` holds `rows * cols` elements (the callers check it).
pub(crate) fn quantize_rows(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    values: &[f32],
) -> Result<Vec<u8>, WeightError> {
    let row_bytes = ty.row_bytes(cols)?;
    let len = rows
        .checked_mul(row_bytes)
        .ok_or(WeightError::TooLarge { rows, cols })?;
    let mut bytes = vec![0u8; len];
    if cols > 0 {
        for (src, dst) in values
            .chunks_exact(cols)
            .zip(bytes.chunks_exact_mut(row_bytes))
        {
            quantize_row(ty, src, dst);
        }
    }
    Ok(bytes)
}

/// Quantizes one row of f32 (a whole number of 32-element blocks) into the
/// GGUF bytes of `ty` (Q8_0, Q4_0 or Q4_1), following ggml's reference
/// (round-to-nearest) quantizers.
pub(crate) fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    let bb = ty.block_bytes();
    for (x, out) in src.chunks_exact(32).zip(dst.chunks_exact_mut(bb)) {
        match ty {
            GgmlType::Q8_0 => {
                let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
                for (o, &v) in out[2..].iter_mut().zip(x) {
                    *o = ((v * id).round() as i8) as u8;
                }
            }
            GgmlType::Q4_0 => {
                // The scale maps the largest-magnitude element to -8, so the
                // asymmetric 4-bit range [-8, 7] is used in full on that side.
                let mut amax = 0.0f32;
                let mut max = 0.0f32;
                for &v in x {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..16 {
                    out[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
                }
            }
            GgmlType::Q4_1 => {
                let min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
                out[2..4].copy_from_slice(&half::f16::from_f32(min).to_bits().to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for j in 0..16 {
                    out[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
                }
            }
            _ => unreachable!("quantize_row is only called for Q8_0, Q4_0 and Q4_1"),
        }
    }
}
