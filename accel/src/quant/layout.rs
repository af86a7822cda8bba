//! The in-memory layout of quantized weights, repacked from GGUF at load.
//!
//! Every quantized type is seen as a row of *lanes*: blocks of `L` elements
//! (`L = 32`, or 16 for Q6_K whose scales cover 16 elements) with unsigned
//! codes `u`, a per-lane scale, and either an integer offset (`value =
//! d · (u − o)`: Q4_0 `o = 8`, Q8_0 `o = 128`, Q6_K `o = 32`) or a per-lane
//! min (`value = d · u + m`: Q4_1, Q4_K).
//!
//! Lanes are grouped 16 at a time (the last group of a row may be shorter,
//! `gl` lanes). Inside a group the codes are interleaved 4 elements at a
//! time across lanes: chunk `c` (elements `4c..4c+4` of every lane) is `4·gl`
//! contiguous bytes, lane `j` at bytes `4j..4j+4`. One 64-byte load then
//! feeds `vpdpbusd`, which sums 4 byte products into each 32-bit lane: after
//! `L/4` chunks, 32-bit lane `j` holds lane `j`'s whole integer dot product,
//! so per-lane scales are applied with one FMA per 16 lanes. The activations
//! are quantized into the same order ([`super::act`]).
//!
//! - 8-bit codes (Q8_0, stored as `q + 128`): chunk `c` at `c · 4gl`.
//! - 4-bit codes (Q4_0, Q4_1, Q4_K): byte `s · 4gl + 4j + t` holds element
//!   `8s + t` in its low nibble and `8s + 4 + t` in its high nibble, so a
//!   mask gives chunk `2s` and a shift gives chunk `2s + 1`.
//! - Q6_K: the low nibbles packed as the 4-bit case (`L = 16`), and a
//!   separate 64-byte-per-group array whose byte `4j + t` holds the top two
//!   bits of element `4c + t` at bits `2c..2c+2`.
//!
//! The offsets above are within one row. In memory, rows are further
//! interleaved in *panels* of [`PANEL`] rows: within a group, each `4·gl`-byte
//! unit (one load of one row) of the panel's rows is stored side by side, so
//! the decode kernel, which walks a panel's rows together unit by unit,
//! reads one sequential stream. Walking rows separately meant `PANEL`
//! interleaved short streams, which the hardware prefetchers follow poorly:
//! measured on Zen 4, a 92 MB weight stream with the same arithmetic ran at
//! about 10 GB/s row-interleaved and about 18 GB/s sequential.
//!
//! Scales stay in their file precision (f16 for the 32-element types, the
//! 6-bit or 8-bit sub-block scales plus an f32 super-block scale for
//! K-quants), so the repacked matrix is within ~5% of the GGUF size and
//! dequantizes to exactly the same values. They are interleaved in panels
//! too ([`panel_index`]): within a panel, group `g`'s scales of each of the
//! panel's rows side by side, so that the decode tile, which needs them a
//! group at a time for its 8 rows, reads one sequential stream of scales
//! beside the stream of codes. Row by row, a panel's scales were 8
//! strided streams; on Zen 4 (1 thread, Q4_0 matrices streamed from DRAM)
//! that held 2048 × 8192 matrices to 17 GB/s where the same bytes as
//! 8192 × 2048 streamed 25, and reading every row's scales from one cached
//! place instead (an experiment, wrong results) lifted them to 24: the
//! longer the rows, the further apart those strided streams.

use super::formats::{f16_at, q4k_codes, q6k_codes, scale_min_k4};
use super::GgmlType;

/// Kind codes (const generic parameters of the kernels).
pub(crate) const K_Q4_0: u8 = 0;
pub(crate) const K_Q4_1: u8 = 1;
pub(crate) const K_Q8_0: u8 = 2;
pub(crate) const K_Q4K: u8 = 3;
pub(crate) const K_Q6K: u8 = 4;

/// Elements per lane block.
pub(crate) const fn lane_len(k: u8) -> usize {
    if k == K_Q6K {
        16
    } else {
        32
    }
}

/// Bits per stored code: 8, 4, or 6 (4 + 2 split).
pub(crate) const fn code_bits(k: u8) -> u32 {
    match k {
        K_Q8_0 => 8,
        K_Q6K => 6,
        _ => 4,
    }
}

/// `log2` of the integer code offset, or 0 when the type has a min instead.
pub(crate) const fn off_shift(k: u8) -> u32 {
    match k {
        K_Q4_0 => 3,
        K_Q8_0 => 7,
        K_Q6K => 5,
        _ => 0,
    }
}

/// Whether values carry a per-lane min term.
pub(crate) const fn has_min(k: u8) -> bool {
    k == K_Q4_1 || k == K_Q4K
}

/// Bytes per lane in the `d` array: f16 scales, Q4_K's u8 sub-block scale
/// and min (see [`q4k_scale_at`]), or Q6_K's i8 sub-block scale.
pub(crate) const fn d_bytes(k: u8) -> usize {
    if k == K_Q6K {
        1
    } else {
        2
    }
}

/// Bytes of super-block scales per super-block: Q4_K's scale and min
/// scale, Q6_K's scale (f32 each); none for the other kinds.
pub(crate) const fn sd_bytes(k: u8) -> usize {
    match k {
        K_Q4K => 8,
        K_Q6K => 4,
        _ => 0,
    }
}

/// Rows interleaved unit by unit in the `qs` array (see the module docs).
/// The decode kernel's row tile is this many rows.
pub(crate) const PANEL: usize = 8;

/// Bytes of packed codes per lane (the low-nibble part for Q6_K).
pub(crate) const fn qs_lane_bytes(k: u8) -> usize {
    if code_bits(k) == 8 {
        lane_len(k)
    } else {
        lane_len(k) / 2
    }
}

/// One 64-byte-aligned line of storage.
#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Line([u8; 64]);

/// A 64-byte-aligned byte buffer with one line of zero padding past its end,
/// so kernels may over-read a few bytes (e.g. a second super-block scale that
/// a masked lane then ignores) without leaving the allocation.
///
/// Buffers of [`HUGE_MIN`] bytes or more (the weights) are mapped on their
/// own, 2 MiB aligned, and marked for transparent huge pages before anything
/// touches them (Linux). A decode step streams every weight once: on 4 KiB
/// pages that is a TLB miss per 4 KiB, and under a hypervisor each miss is a
/// two-level page walk whose cost depends on how the host backs the guest's
/// pages, which made two-thread decode bimodal from one process to the next
/// on the EPYC VM (issue 47). Marking a range after a `Vec` had zeroed it got
/// almost no huge pages; marking it first, the page faults of the first
/// write allocate them.
pub(crate) struct ABuf {
    store: Store,
    len: usize,
}

enum Store {
    Heap(Vec<Line>),
    #[cfg(target_os = "linux")]
    Mapped {
        /// The mapping as `mmap` returned it, and its length.
        base: *mut u8,
        map_len: usize,
        /// The 2 MiB-aligned start inside it.
        ptr: *mut u8,
    },
}

// SAFETY: a mapped store is owned memory like a `Vec`'s, freed only by drop.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

/// Smallest buffer that gets its own huge-page mapping.
pub(crate) const HUGE_MIN: usize = 1 << 20;

#[cfg(target_os = "linux")]
const HUGE_PAGE: usize = 2 << 20;

impl Drop for Store {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Store::Mapped { base, map_len, .. } = *self {
            // SAFETY: the mapping this store made and nothing else uses.
            unsafe {
                libc::munmap(base.cast(), map_len);
            }
        }
    }
}

impl ABuf {
    /// A zeroed buffer of `len` bytes.
    pub(crate) fn zeroed(len: usize) -> ABuf {
        let lines = len.div_ceil(64) + 1;
        #[cfg(target_os = "linux")]
        if lines * 64 >= HUGE_MIN {
            if let Some(store) = map_huge(lines * 64) {
                return ABuf { store, len };
            }
        }
        ABuf {
            store: Store::Heap(vec![Line([0; 64]); lines]),
            len,
        }
    }

    /// Whether the buffer has its own huge-page mapping (see the type).
    #[cfg(test)]
    pub(crate) fn mapped(&self) -> bool {
        !matches!(self.store, Store::Heap(_))
    }

    /// Logical length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// All lines, the padding included.
    fn all(&self) -> &[u8] {
        match &self.store {
            Store::Heap(v) => bytemuck::cast_slice::<Line, u8>(v),
            #[cfg(target_os = "linux")]
            // SAFETY: `(len / 64 + 1) * 64` bytes from `ptr` are mapped and
            // zero-initialised, owned by this buffer.
            Store::Mapped { ptr, .. } => unsafe {
                std::slice::from_raw_parts(*ptr, (self.len.div_ceil(64) + 1) * 64)
            },
        }
    }

    fn all_mut(&mut self) -> &mut [u8] {
        let n = (self.len.div_ceil(64) + 1) * 64;
        match &mut self.store {
            Store::Heap(v) => bytemuck::cast_slice_mut::<Line, u8>(v),
            #[cfg(target_os = "linux")]
            // SAFETY: as in `all`, and `&mut self` makes it exclusive.
            Store::Mapped { ptr, .. } => unsafe { std::slice::from_raw_parts_mut(*ptr, n) },
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.all()[..self.len]
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.len;
        &mut self.all_mut()[..n]
    }

    /// The buffer as f32s (the buffer is 64-byte aligned, so this cannot fail
    /// for lengths that are multiples of 4).
    pub(crate) fn f32s(&self) -> &[f32] {
        bytemuck::cast_slice(&self.all()[..self.len / 4 * 4])
    }

    pub(crate) fn ptr(&self) -> *const u8 {
        self.all().as_ptr()
    }
}

/// An anonymous mapping of `bytes` (zero-filled, untouched) at a 2 MiB
/// boundary, marked `MADV_HUGEPAGE`; `None` if the kernel refuses the
/// mapping (the caller then uses the heap). A refused `madvise` (THP off) is
/// no error: the pages are then ordinary ones.
#[cfg(target_os = "linux")]
fn map_huge(bytes: usize) -> Option<Store> {
    let len = bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let map_len = len + HUGE_PAGE;
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base.cast::<u8>();
        let ptr = base.add(base.align_offset(HUGE_PAGE));
        libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE);
        Some(Store::Mapped { base, map_len, ptr })
    }
}

/// A quantized matrix in the repacked layout (see the module docs): every
/// array is interleaved in panels of [`PANEL`] rows, the last panel padded
/// with zero rows.
pub(crate) struct QMat {
    pub(crate) kind: u8,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Lane blocks per row.
    pub(crate) lanes: usize,
    /// Super-blocks per row (K-quants; 0 otherwise).
    pub(crate) nsb: usize,
    /// Interleaved codes, `qs_row` bytes per row, in panels of [`PANEL`]
    /// rows (the last panel padded with zero rows).
    pub(crate) qs: ABuf,
    pub(crate) qs_row: usize,
    /// Q6_K high code bits; 64 bytes per row and group, `qh_row` bytes per
    /// row, in panels as `qs` is: a panel's rows' 64 bytes of group `g` lie
    /// side by side, so that the decode tile reads one stream of high bits
    /// for its 8 rows instead of 8 (which measured 2× slower on Zen 4 with
    /// the hardware prefetchers alone; see [`QMat::qh_index`]).
    pub(crate) qh: ABuf,
    pub(crate) qh_row: usize,
    /// Per-lane scales, at [`lane_at`]: f16 bits; Q4_K's u8 sub-block
    /// scales and mins, per row and group the group's scales then its mins
    /// (one stream for both; see [`q4k_scale_at`]); or Q6_K's i8 sub-block
    /// scales.
    pub(crate) d: ABuf,
    /// Per-lane mins: f16 bits (Q4_1 only), at [`lane_at`].
    pub(crate) m: ABuf,
    /// K-quant super-block scales (f32) per super-block, at [`sb_at`]:
    /// Q6_K's scale, or Q4_K's scale and min scale side by side (one stream
    /// and one load for both; see [`QMat::super_block`]).
    pub(crate) sd: ABuf,
}

/// Lanes in group `g` of a row of `lanes` lanes.
pub(crate) fn group_lanes(lanes: usize, g: usize) -> usize {
    (lanes - 16 * g).min(16)
}

/// Where item `i` of row `r`'s `per_row` per-row items (per-lane scales,
/// or super-block scales) lies in the panel layout, `per_group` of them
/// belonging to one 16-lane group: the panel's start, then for group `g`
/// the panel's rows' items of that group side by side (the last group may
/// hold fewer), so that a tile walking a panel group by group reads them
/// as one stream (see the module docs).
pub(crate) fn panel_index(r: usize, i: usize, per_row: usize, per_group: usize) -> usize {
    let g = i / per_group;
    let in_group = (per_row - g * per_group).min(per_group);
    r / PANEL * PANEL * per_row + PANEL * g * per_group + r % PANEL * in_group + i % per_group
}

/// Where lane `b` of row `r` (of `lanes` lanes) keeps its per-lane items
/// (`d`, `m`), in items: a row's group of lanes is contiguous.
pub(crate) fn lane_at(lanes: usize, r: usize, b: usize) -> usize {
    panel_index(r, b, lanes, 16)
}

/// Super-blocks of a K-quant in one 16-lane group: Q4_K's 32-element lanes
/// make 2, Q6_K's 16-element lanes 1.
pub(crate) const fn sb_per_group(k: u8) -> usize {
    16 * lane_len(k) / 256
}

/// Where super-block `sb` of row `r` (of `nsb`) keeps its scales in `sd`,
/// in super-blocks (Q4_K holds two f32 per super-block, Q6_K one).
pub(crate) fn sb_at(kind: u8, nsb: usize, r: usize, sb: usize) -> usize {
    panel_index(r, sb, nsb, sb_per_group(kind))
}

/// Q4_K: where lane `b` of row `r` keeps its u8 sub-block scale in `d`;
/// its min lies the group's lane count further on. Each row's 16-lane
/// group holds its scales, then its mins.
pub(crate) fn q4k_scale_at(lanes: usize, r: usize, b: usize) -> usize {
    2 * lane_at(lanes, r, b / 16 * 16) + b % 16
}

/// Scatters one row's row-major per-row items (`items` bytes each, `per_row`
/// of them, `per_group` to a group) to their panel places in `dst`.
fn scatter_row(
    dst: &mut [u8],
    r: usize,
    row: &[u8],
    items: usize,
    per_row: usize,
    per_group: usize,
) {
    for g in 0..per_row.div_ceil(per_group) {
        let (i0, i1) = (g * per_group, ((g + 1) * per_group).min(per_row));
        let at = panel_index(r, i0, per_row, per_group) * items;
        dst[at..at + (i1 - i0) * items].copy_from_slice(&row[i0 * items..i1 * items]);
    }
}

/// Packs one row of unsigned codes (`lanes · L` of them) into the interleaved
/// layout: `qs` gets the 8-bit or low 4-bit codes, `qh` (Q6_K) the top bits.
fn pack_codes(kind: u8, codes: &[u8], qs: &mut [u8], qh: &mut [u8]) {
    let l = lane_len(kind);
    let lanes = codes.len() / l;
    let chunks = l / 4;
    for g in 0..lanes.div_ceil(16) {
        let gl = group_lanes(lanes, g);
        let lane_code = |j: usize, e: usize| codes[(16 * g + j) * l + e];
        if code_bits(kind) == 8 {
            let base = 16 * g * l;
            for c in 0..chunks {
                for j in 0..gl {
                    for t in 0..4 {
                        qs[base + c * 4 * gl + 4 * j + t] = lane_code(j, 4 * c + t);
                    }
                }
            }
        } else {
            let base = 16 * g * l / 2;
            for s in 0..chunks / 2 {
                for j in 0..gl {
                    for t in 0..4 {
                        let lo = lane_code(j, 8 * s + t) & 0x0f;
                        let hi = lane_code(j, 8 * s + 4 + t) & 0x0f;
                        qs[base + s * 4 * gl + 4 * j + t] = lo | (hi << 4);
                    }
                }
            }
            if code_bits(kind) == 6 {
                for j in 0..gl {
                    for t in 0..4 {
                        let mut b = 0u8;
                        for c in 0..chunks {
                            b |= (lane_code(j, 4 * c + t) >> 4) << (2 * c);
                        }
                        qh[64 * g + 4 * j + t] = b;
                    }
                }
            }
        }
    }
}

/// The unsigned code of element `e` of lane `b` in a packed row, whose
/// row-major byte `o` is `qs(o)`.
fn unpack_code(
    kind: u8,
    lanes: usize,
    qs: impl Fn(usize) -> u8,
    qh: impl Fn(usize) -> u8,
    b: usize,
    e: usize,
) -> u8 {
    let l = lane_len(kind);
    let (g, j) = (b / 16, b % 16);
    let gl = group_lanes(lanes, g);
    let t = e % 4;
    if code_bits(kind) == 8 {
        return qs(16 * g * l + (e / 4) * 4 * gl + 4 * j + t);
    }
    let byte = qs(16 * g * l / 2 + (e / 8) * 4 * gl + 4 * j + t);
    let low = if e % 8 < 4 { byte & 0x0f } else { byte >> 4 };
    if code_bits(kind) == 6 {
        low | (((qh(64 * g + 4 * j + t) >> (2 * (e / 4))) & 3) << 4)
    } else {
        low
    }
}

fn kind_of(ty: GgmlType) -> u8 {
    match ty {
        GgmlType::Q4_0 => K_Q4_0,
        GgmlType::Q4_1 => K_Q4_1,
        GgmlType::Q8_0 => K_Q8_0,
        GgmlType::Q4_K => K_Q4K,
        GgmlType::Q6_K => K_Q6K,
        _ => unreachable!("kind_of is only called for quantized types"),
    }
}

impl QMat {
    fn empty(kind: u8, rows: usize, cols: usize) -> QMat {
        let l = lane_len(kind);
        let lanes = cols / l;
        let nsb = if kind == K_Q4K || kind == K_Q6K {
            cols / 256
        } else {
            0
        };
        let qs_row = lanes * qs_lane_bytes(kind);
        let qh_row = if kind == K_Q6K {
            lanes.div_ceil(16) * 64
        } else {
            0
        };
        let m_bytes = match kind {
            K_Q4_1 => 2,
            _ => 0,
        };
        let padded = rows.div_ceil(PANEL) * PANEL;
        QMat {
            kind,
            rows,
            cols,
            lanes,
            nsb,
            qs: ABuf::zeroed(rows.div_ceil(PANEL) * PANEL * qs_row),
            qs_row,
            qh: ABuf::zeroed(rows.div_ceil(PANEL) * PANEL * qh_row),
            qh_row,
            d: ABuf::zeroed(padded * lanes * d_bytes(kind)),
            m: ABuf::zeroed(padded * lanes * m_bytes),
            sd: ABuf::zeroed(padded * nsb * sd_bytes(kind)),
        }
    }

    /// Repacks validated GGUF bytes (`rows` rows of `cols / block_len` blocks).
    pub(crate) fn from_gguf(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> QMat {
        let kind = kind_of(ty);
        let mut q = QMat::empty(kind, rows, cols);
        let l = lane_len(kind);
        let lanes = q.lanes;
        let row_bytes = cols / ty.block_len() * ty.block_bytes();
        let mut codes = vec![0u8; cols];
        let mut row_qs = vec![0u8; q.qs_row];
        let mut row_qh = vec![0u8; q.qh_row];
        // One row's scales (and mins) row-major, then scattered to panels.
        let nsb = q.nsb;
        let mut row_d = vec![0u8; lanes * d_bytes(kind)];
        let mut row_m = vec![0u8; if kind == K_Q4_1 { lanes * 2 } else { 0 }];
        let mut row_sd = vec![0f32; nsb * sd_bytes(kind) / 4];
        for r in 0..rows {
            let src = &bytes[r * row_bytes..(r + 1) * row_bytes];
            let d = &mut row_d[..];
            match kind {
                K_Q4_0 | K_Q4_1 | K_Q8_0 => {
                    let bb = ty.block_bytes();
                    for (b, blk) in src.chunks_exact(bb).enumerate() {
                        d[2 * b..2 * b + 2].copy_from_slice(&blk[0..2]);
                        let code = &mut codes[b * 32..(b + 1) * 32];
                        match kind {
                            K_Q8_0 => {
                                for (c, &v) in code.iter_mut().zip(&blk[2..34]) {
                                    // Stored offset by 128 so VNNI can treat it as unsigned.
                                    *c = (v as i8 as i16 + 128) as u8;
                                }
                            }
                            _ => {
                                let qs = &blk[bb - 16..];
                                for j in 0..16 {
                                    code[j] = qs[j] & 0x0f;
                                    code[j + 16] = qs[j] >> 4;
                                }
                            }
                        }
                    }
                    if kind == K_Q4_1 {
                        for (b, blk) in src.chunks_exact(20).enumerate() {
                            row_m[2 * b..2 * b + 2].copy_from_slice(&blk[2..4]);
                        }
                    }
                }
                K_Q4K => {
                    let sd = &mut row_sd[..];
                    for (sb, blk) in src.chunks_exact(144).enumerate() {
                        sd[2 * sb] = f16_at(blk, 0);
                        sd[2 * sb + 1] = f16_at(blk, 2);
                        for j in 0..8 {
                            let (sc, mn) = scale_min_k4(j, &blk[4..16]);
                            // Row-major: the group's scales, then its mins.
                            let b = 8 * sb + j;
                            let at = 2 * (b / 16 * 16) + b % 16;
                            d[at] = sc;
                            d[at + group_lanes(lanes, (8 * sb + j) / 16)] = mn;
                        }
                        codes[256 * sb..256 * (sb + 1)].copy_from_slice(&q4k_codes(blk));
                    }
                }
                K_Q6K => {
                    let sd = &mut row_sd[..];
                    for (sb, blk) in src.chunks_exact(210).enumerate() {
                        sd[sb] = f16_at(blk, 208);
                        d[16 * sb..16 * (sb + 1)].copy_from_slice(&blk[192..208]);
                        codes[256 * sb..256 * (sb + 1)].copy_from_slice(&q6k_codes(blk));
                    }
                }
                _ => unreachable!(),
            }
            scatter_row(q.d.bytes_mut(), r, &row_d, d_bytes(kind), lanes, 16);
            if kind == K_Q4_1 {
                scatter_row(q.m.bytes_mut(), r, &row_m, 2, lanes, 16);
            }
            if nsb > 0 {
                let sd = bytemuck::cast_slice::<f32, u8>(&row_sd);
                scatter_row(
                    q.sd.bytes_mut(),
                    r,
                    sd,
                    sd_bytes(kind),
                    nsb,
                    sb_per_group(kind),
                );
            }
            pack_codes(kind, &codes[..lanes * l], &mut row_qs, &mut row_qh);
            q.write_qs_row(r, &row_qs);
            for (g, src) in row_qh.chunks_exact(64).enumerate() {
                let at = q.qh_index(r, 64 * g);
                q.qh.bytes_mut()[at..at + 64].copy_from_slice(src);
            }
        }
        q
    }

    /// Calls `f(row_offset, qs_index, len)` for each unit of row `r`: `len`
    /// bytes at `row_offset` in the row's own packed codes live at
    /// `qs_index` in the panel layout.
    fn for_each_unit(&self, r: usize, mut f: impl FnMut(usize, usize, usize)) {
        let gbytes = 16 * qs_lane_bytes(self.kind);
        let panel = r / PANEL * PANEL * self.qs_row;
        let j = r % PANEL;
        for g in 0..self.lanes.div_ceil(16) {
            let stride = 4 * group_lanes(self.lanes, g);
            let units = group_lanes(self.lanes, g) * qs_lane_bytes(self.kind) / stride;
            for k in 0..units {
                let at = panel + PANEL * g * gbytes + (k * PANEL + j) * stride;
                f(g * gbytes + k * stride, at, stride);
            }
        }
    }

    /// Index in `qs` of byte `o` of row `r`'s row-major packed codes (the
    /// scalar kernel's addressing; the SIMD kernels walk units directly).
    pub(crate) fn qs_index(&self, r: usize, o: usize) -> usize {
        let gbytes = 16 * qs_lane_bytes(self.kind);
        let g = o / gbytes;
        let stride = 4 * group_lanes(self.lanes, g);
        let (k, x) = ((o - g * gbytes) / stride, (o - g * gbytes) % stride);
        r / PANEL * PANEL * self.qs_row + PANEL * g * gbytes + (k * PANEL + r % PANEL) * stride + x
    }

    /// Q4_K: row `r`'s super-block `sb`'s scale and min scale.
    pub(crate) fn super_block(&self, r: usize, sb: usize) -> (f32, f32) {
        let at = 2 * sb_at(self.kind, self.nsb, r, sb);
        (self.sd.f32s()[at], self.sd.f32s()[at + 1])
    }

    /// Index in `qh` of byte `o` of row `r`'s row-major high bits (64 bytes
    /// a group): the panel's start, then group `g`'s 64 bytes of each of the
    /// panel's rows.
    pub(crate) fn qh_index(&self, r: usize, o: usize) -> usize {
        // Every group's 64 bytes are whole, so this is the scales' panel
        // index with 64-byte items per group.
        panel_index(r, o, self.qh_row, 64)
    }

    /// Stores row `r`'s packed codes (`qs_row` bytes, row-major order).
    fn write_qs_row(&mut self, r: usize, src: &[u8]) {
        let mut units = Vec::with_capacity(self.lanes);
        self.for_each_unit(r, |o, at, n| units.push((o, at, n)));
        let qs = self.qs.bytes_mut();
        for (o, at, n) in units {
            qs[at..at + n].copy_from_slice(&src[o..o + n]);
        }
    }

    /// Bytes held (what a matmul streams), not counting the zero rows that
    /// pad the last panel.
    pub(crate) fn size_bytes(&self) -> usize {
        let m_bytes = if self.kind == K_Q4_1 { 2 } else { 0 };
        let per_row = self.qs_row
            + self.qh_row
            + self.lanes * (d_bytes(self.kind) + m_bytes)
            + self.nsb * sd_bytes(self.kind);
        self.rows * per_row
    }

    /// The scale and min (value = `scale · u + min`, offsets folded into the
    /// min) of lane `b` of row `r`.
    pub(crate) fn lane_affine(&self, r: usize, b: usize) -> (f32, f32) {
        let db = self.d.bytes();
        match self.kind {
            K_Q4_0 | K_Q8_0 => {
                let d = f16_at(db, 2 * lane_at(self.lanes, r, b));
                let o = (1u32 << off_shift(self.kind)) as f32;
                (d, -o * d)
            }
            K_Q4_1 => (
                f16_at(db, 2 * lane_at(self.lanes, r, b)),
                f16_at(self.m.bytes(), 2 * lane_at(self.lanes, r, b)),
            ),
            K_Q4K => {
                let (sd, smin) = self.super_block(r, b / 8);
                let at = q4k_scale_at(self.lanes, r, b);
                let sc = db[at] as f32;
                let mn = db[at + group_lanes(self.lanes, b / 16)] as f32;
                (sd * sc, -(smin * mn))
            }
            K_Q6K => {
                let sb = sb_at(self.kind, self.nsb, r, b / 16);
                let d = self.sd.f32s()[sb] * (db[lane_at(self.lanes, r, b)] as i8 as f32);
                (d, -32.0 * d)
            }
            _ => unreachable!(),
        }
    }

    /// Dequantizes row `r` into `out[..cols]`.
    pub(crate) fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let l = lane_len(self.kind);
        // Byte by byte through the panel index: this serves embedding
        // lookups during decode, which must not allocate a row buffer.
        let all = self.qs.bytes();
        let qs = |o: usize| all[self.qs_index(r, o)];
        let all_qh = self.qh.bytes();
        let qh = |o: usize| all_qh[self.qh_index(r, o)];
        for b in 0..self.lanes {
            let (d, m) = self.lane_affine(r, b);
            let off = if has_min(self.kind) {
                0
            } else {
                1i32 << off_shift(self.kind)
            };
            for e in 0..l {
                let u = unpack_code(self.kind, self.lanes, qs, qh, b, e) as i32;
                // Written as the formats define them (d·(q−o), d·sc·q − dmin·mn)
                // so dequantization reproduces ggml's values exactly.
                out[b * l + e] = if has_min(self.kind) {
                    d * u as f32 + m
                } else {
                    d * (u - off) as f32
                };
            }
        }
    }
}

#[cfg(test)]
mod abuf_tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_writable_heap_or_mapped() {
        for len in [
            0usize,
            1,
            63,
            64,
            4097,
            HUGE_MIN - 64,
            HUGE_MIN,
            3 * HUGE_MIN + 5,
        ] {
            let mut b = ABuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.ptr() as usize % 64, 0, "len {len}");
            // One line of zero padding past the end stays readable.
            let padded = unsafe { std::slice::from_raw_parts(b.ptr(), len.div_ceil(64) * 64 + 64) };
            assert!(padded.iter().all(|&x| x == 0), "len {len}");
            for (i, x) in b.bytes_mut().iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            assert!(b
                .bytes()
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i % 251) as u8));
            assert_eq!(b.f32s().len(), len / 4);
            #[cfg(target_os = "linux")]
            {
                assert_eq!(
                    b.mapped(),
                    len.div_ceil(64) * 64 + 64 >= HUGE_MIN,
                    "len {len}"
                );
                if b.mapped() {
                    assert_eq!(b.ptr() as usize % (2 << 20), 0, "len {len}");
                }
            }
        }
    }
}
