//! Intel AMX: detecting the tile unit, asking Linux for it, and the per-thread
//! tile configuration.
//!
//! AMX state is 8 KiB per thread, so Linux keeps it off until a process asks
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); a tile
//! instruction without that permission faults. The permission is
//! process-wide and covers threads that already exist. Each thread must still
//! load a tile configuration (`ldtilecfg`) before its first tile instruction,
//! and should release the tiles (`tilerelease`) when done, so context
//! switches stop saving 8 KiB of tile data for it.
//!
//! Rust's AMX intrinsics are not stable, so the instructions are written as
//! inline assembly; the assembler knows them and no Rust code touches the
//! tile registers, so no register constraints are needed.

use std::arch::asm;

/// Whether this CPU has AMX-TILE and AMX-INT8, the OS saves tile state, and
/// the process has been granted the tile data permission (asked here, once).
pub(super) fn enable() -> bool {
    // SAFETY: `cpuid` and `xgetbv` (after checking OSXSAVE) are available on
    // every x86_64 CPU; the syscall only changes this process's permissions.
    #[allow(unused_unsafe)]
    unsafe {
        use std::arch::x86_64::__cpuid_count;
        let leaf7 = __cpuid_count(7, 0);
        let tile = leaf7.edx & (1 << 24) != 0;
        let int8 = leaf7.edx & (1 << 25) != 0;
        let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
        if !(tile && int8 && osxsave) {
            return false;
        }
        let (lo, _hi): (u32, u32);
        asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi, options(nomem, nostack));
        // XTILECFG (bit 17) and XTILEDATA (bit 18) enabled in XCR0.
        if lo & (0b11 << 17) != 0b11 << 17 {
            return false;
        }
        request_permission()
    }
}

/// Whether the tile unit also multiplies bf16 (AMX-BF16) and the vector
/// unit converts to it (AVX512-BF16): the dense prompt-row kernel
/// (`quant::amx_bf16`) needs both. Meaningful only where [`enable`]
/// succeeded.
pub(crate) fn has_bf16() -> bool {
    use std::sync::OnceLock;
    static BF16: OnceLock<bool> = OnceLock::new();
    *BF16.get_or_init(|| {
        // SAFETY: `cpuid` is available on every x86_64 CPU.
        #[allow(unused_unsafe)]
        unsafe {
            use std::arch::x86_64::__cpuid_count;
            let amx_bf16 = __cpuid_count(7, 0).edx & (1 << 22) != 0;
            let avx512_bf16 = __cpuid_count(7, 1).eax & (1 << 5) != 0;
            amx_bf16 && avx512_bf16
        }
    })
}

#[cfg(target_os = "linux")]
fn request_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain syscall with integer arguments; it touches no memory.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> bool {
    false
}

/// A tile configuration (palette 1): the rows and bytes per row of each of
/// the eight tile registers, in the 64-byte format `ldtilecfg` reads.
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// A configuration with each register `i` of `shapes` set to
    /// `(rows, bytes per row)`; rows at most 16, bytes at most 64.
    pub(crate) const fn new(shapes: [(u8, u16); 8]) -> TileConfig {
        let mut colsb = [0u16; 16];
        let mut rows = [0u8; 16];
        let mut i = 0;
        while i < 8 {
            assert!(shapes[i].0 <= 16 && shapes[i].1 <= 64);
            rows[i] = shapes[i].0;
            colsb[i] = shapes[i].1;
            i += 1;
        }
        TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb,
            rows,
        }
    }

    /// Loads this configuration into the calling thread's tile unit.
    ///
    /// # Safety
    /// The CPU level must be [`super::SimdLevel::Amx`] (so the permission
    /// was granted). Pair with [`release_tiles`] on the same thread.
    pub(crate) unsafe fn load(&self) {
        // SAFETY: the caller guarantees AMX is enabled; the pointer is a
        // valid 64-byte configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self as *const TileConfig, options(nostack)) };
    }
}

/// Returns the calling thread's tile registers to the init state.
///
/// # Safety
/// The CPU level must be [`super::SimdLevel::Amx`].
pub(crate) unsafe fn release_tiles() {
    // SAFETY: the caller guarantees AMX is enabled.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}
