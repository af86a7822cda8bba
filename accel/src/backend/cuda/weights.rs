//! How weights are laid out on the GPU: the pure host-side repacking, tested
//! without a device.
//!
//! Quantized types are split into two regions so that the kernels' loads
//! are aligned: first every block's quants (16 bytes for Q4_0/Q4_1, 32 for
//! Q8_0, in GGUF's byte order), row after row; then, from
//! [`Packed::scale_off`] (16-byte aligned), the blocks' f16 scales in the
//! same order (Q4_1: `d, m` pairs). GGUF's 18- and 34-byte blocks would
//! leave the quants only 2-byte aligned. Float types are kept as they are.

use crate::quant::GgmlType;

/// The weight codes of kernels.cu (`PG_W_*`).
pub fn kind_code(ty: GgmlType) -> Option<i32> {
    Some(match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q4_0 => 3,
        GgmlType::Q4_1 => 4,
        GgmlType::Q8_0 => 5,
        GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::MXFP4 => return None,
    })
}

/// A matrix's bytes in the device layout.
#[derive(Debug, PartialEq, Eq)]
pub struct Packed {
    /// The bytes to copy to the device.
    pub bytes: Vec<u8>,
    /// Where the scales start (0 for the float types, which have none).
    pub scale_off: usize,
}

/// Bytes of quants per 32-element block of `ty` (quantized types only).
fn quant_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 32,
        _ => 16,
    }
}

/// Bytes of scales per block: Q4_1 stores `d` and `m`.
fn scale_bytes(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_1 => 4,
        _ => 2,
    }
}

/// Repacks `data` (GGUF's layout of `rows × cols` elements of `ty`, length
/// already checked by [`crate::HostMatrix::new`]) for the kernels. `None`
/// for types the CUDA kernels do not read.
pub fn pack(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Packed> {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Some(Packed {
            bytes: data.to_vec(),
            scale_off: 0,
        }),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
            let blocks = rows * (cols / 32);
            let (qb, sb, bb) = (quant_bytes(ty), scale_bytes(ty), ty.block_bytes());
            let scale_off = (blocks * qb).next_multiple_of(16);
            let mut bytes = vec![0u8; scale_off + blocks * sb];
            let (quants, scales) = bytes.split_at_mut(scale_off);
            for (i, block) in data.chunks_exact(bb).enumerate() {
                // GGUF puts the scale(s) first, the quants after them.
                scales[i * sb..(i + 1) * sb].copy_from_slice(&block[..sb]);
                quants[i * qb..(i + 1) * qb].copy_from_slice(&block[sb..]);
            }
            Some(Packed { bytes, scale_off })
        }
        GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::MXFP4 => None,
    }
}

/// The inverse of [`pack`] for the quantized types (the tests' check that
/// nothing is lost or moved).
#[cfg(test)]
fn unpack(ty: GgmlType, p: &Packed) -> Vec<u8> {
    let (qb, sb) = (quant_bytes(ty), scale_bytes(ty));
    let blocks = (p.bytes.len() - p.scale_off) / sb;
    let mut out = Vec::new();
    for i in 0..blocks {
        out.extend_from_slice(&p.bytes[p.scale_off + i * sb..p.scale_off + (i + 1) * sb]);
        out.extend_from_slice(&p.bytes[i * qb..(i + 1) * qb]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_repacking_is_lossless_and_aligned() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols) = (3, 96);
            let len = rows * ty.row_bytes(cols).expect("block multiple");
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let p = pack(ty, rows, cols, &data).expect("packable");
            assert_eq!(p.scale_off % 16, 0);
            assert_eq!(p.scale_off, (9 * quant_bytes(ty)).next_multiple_of(16));
            assert_eq!(unpack(ty, &p), data, "{ty:?}");
        }
    }

    #[test]
    fn q4_0_block_lands_where_the_kernel_reads_it() {
        // One block: d = 1.0 (f16 0x3c00), quants 0x10, 0x32, …
        let mut block = vec![0x00, 0x3c];
        block.extend((0..16u8).map(|j| j * 0x11));
        let p = pack(GgmlType::Q4_0, 1, 32, &block).expect("packable");
        assert_eq!(&p.bytes[..16], &block[2..]);
        assert_eq!(&p.bytes[p.scale_off..], &[0x00, 0x3c]);
    }

    #[test]
    fn floats_are_kept_and_k_quants_refused() {
        let data = vec![1u8, 2, 3, 4];
        let p = pack(GgmlType::F16, 1, 2, &data).expect("float");
        assert_eq!((p.bytes, p.scale_off), (data, 0));
        assert!(pack(GgmlType::Q4_K, 1, 256, &[0; 144]).is_none());
        assert!(kind_code(GgmlType::Q6_K).is_none());
        assert!(kind_code(GgmlType::MXFP4).is_none());
        assert!(pack(GgmlType::MXFP4, 1, 32, &[0; 17]).is_none());
        assert_eq!(kind_code(GgmlType::Q8_0), Some(5));
    }
}
