//! MXFP4 (OCP microscaling, 4-bit e2m1 values with one e8m0 scale per 32),
//! as gpt-oss's checkpoints store their experts (`quant_method` `mxfp4`):
//! `{name}_blocks` `[..., rows, cols / 32, 16]` bytes, two values a byte
//! (low nibble first), and `{name}_scales` `[..., rows, cols / 32]`, the
//! power of two `2^(s − 127)` of each block. Only the experts' stacked
//! tensors are quantized. Fused expert stacks (gpt-oss's `SparseMoe`) stay
//! MXFP4 in memory: the loader re-packs them into ggml's blocks
//! (`WeightSource::mxfp4_stack`, `pagoda_accel::quant::mxfp4`). A stack
//! read any other way (`WeightSource::stacked`) is dequantized here
//! (exactly: an e2m1 value times a power of two is a bfloat16 and an f32).

use anyhow::{bail, Result};

/// The e2m1 values of the 16 codes.
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The checkpoint's `quantization_config` for MXFP4.
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp4;

impl Mxfp4 {
    pub fn describe(&self) -> String {
        "mxfp4 experts (e2m1 with an e8m0 scale per 32, kept 4-bit in memory)".into()
    }
}

/// Dequantizes `blocks` (`rows · groups · 16` bytes) and `scales` (`rows ·
/// groups`) into `[rows, groups · 32]` values.
pub fn dequantize(blocks: &[u8], scales: &[u8], rows: usize, groups: usize) -> Result<Vec<f32>> {
    if blocks.len() != rows * groups * 16 || scales.len() != rows * groups {
        bail!(
            "mxfp4: {} block bytes and {} scales for {rows} rows of {groups} blocks",
            blocks.len(),
            scales.len()
        );
    }
    let mut out = Vec::with_capacity(rows * groups * 32);
    for (block, &s) in blocks.chunks_exact(16).zip(scales) {
        let scale = 2f64.powi(s as i32 - 127);
        for &b in block {
            for code in [b & 0x0f, b >> 4] {
                out.push((E2M1[code as usize] as f64 * scale) as f32);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_scales_decode_to_e2m1_times_a_power_of_two() {
        // One row of one block: codes 0..16 twice (low nibble first), scale 2^1.
        let blocks: Vec<u8> = (0..16u8).map(|i| (i << 4) | (15 - i)).collect();
        let v = dequantize(&blocks, &[128], 1, 1).expect("dequantize");
        for i in 0..16 {
            assert_eq!(v[2 * i], 2.0 * E2M1[15 - i]);
            assert_eq!(v[2 * i + 1], 2.0 * E2M1[i]);
        }
        // The extreme scales stay exact (2^-127 · 0.5) or overflow as
        // ldexp does (2^128 · 6).
        let v = dequantize(&[0x71; 16], &[0], 1, 1).expect("dequantize");
        assert_eq!(v[0], (0.5f64 * 2f64.powi(-127)) as f32);
        assert_eq!(v[1], (6.0f64 * 2f64.powi(-127)) as f32);
        let v = dequantize(&[0x71; 16], &[255], 1, 1).expect("dequantize");
        assert_eq!(v[0], 0.5 * 2f32.powi(127) * 2.0);
        assert!(v[1].is_infinite());
        assert!(dequantize(&[0; 15], &[0], 1, 1).is_err());
    }
}
