//! The kernels' source, compiled to PTX by NVRTC at run time and cached on
//! disk per GPU architecture.
//!
//! NVRTC is loaded at run time (cudarc's `dynamic-loading`): a binary built
//! with `--features cuda` needs neither a toolkit to build nor, until a CUDA
//! device is opened, libnvrtc to run. Compiling the source takes seconds, so
//! the PTX is kept in memory for the process and on disk under
//! `$XDG_CACHE_HOME/pagoda/ptx` (or `~/.cache/pagoda/ptx`), named by a hash
//! of the source, the architecture and the compiler options; a cache that
//! cannot be read or written only costs a compile.

use cudarc::nvrtc::{self, CompileError, CompileOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel entry point of [`SOURCE`]; the backend loads each of them,
/// and the NVRTC test checks the PTX defines them all.
pub const KERNELS: &[&str] = &[
    "pg_embed",
    "pg_quantize_x",
    "pg_mmvq_q4_0",
    "pg_mmvq_q4_1",
    "pg_mmvq_q8_0",
    "pg_mmq_q4_0",
    "pg_mmq_q4_1",
    "pg_mmq_q8_0",
    "pg_f32_to_f16",
    "pg_f32_to_bf16",
    "pg_rms_norm",
    "pg_add",
    "pg_add_bias",
    "pg_copy_columns",
    "pg_silu_mul",
    "pg_rope",
    "pg_gather_rows",
    "pg_write_kv_f32",
    "pg_write_kv_f16",
    "pg_write_kv_bf16",
    "pg_attention_f32",
    "pg_attention_f16",
    "pg_attention_bf16",
    "pg_attn_merge",
    "pg_sample_process",
    "pg_sample_pick",
    "pg_sample_logprobs",
    "pg_lora_shrink",
    "pg_lora_expand",
];

/// The virtual architecture NVRTC targets for compute capability
/// `major.minor` (`compute_90` for an H100). The driver JIT-compiles PTX of
/// this architecture for the exact GPU.
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("compute_{major}{minor}")
}

/// The NVRTC options for `arch`. Precise division and square roots (NVRTC's
/// defaults) keep the norms and the softmax close to the CPU backend.
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()]
}

/// 64-bit FNV-1a: a hash that is the same in every build and process (the
/// standard library's is not promised to be), for naming cache files.
fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The cache key of `source` compiled with `options`: any change to either
/// names a different file.
pub fn cache_key(source: &str, options: &[String]) -> u64 {
    let mut h = fnv1a(0xcbf2_9ce4_8422_2325, source.as_bytes());
    for o in options {
        // A separator, so ["ab", "c"] and ["a", "bc"] differ.
        h = fnv1a(h, &[0]);
        h = fnv1a(h, o.as_bytes());
    }
    h
}

/// Where cached PTX lives: `$XDG_CACHE_HOME/pagoda/ptx`, else
/// `$HOME/.cache/pagoda/ptx`; `None` when neither variable is set.
pub fn cache_dir_from(xdg: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    let base = match (
        xdg.filter(|s| !s.is_empty()),
        home.filter(|s| !s.is_empty()),
    ) {
        (Some(x), _) => PathBuf::from(x),
        (None, Some(h)) => Path::new(h).join(".cache"),
        (None, None) => return None,
    };
    Some(base.join("pagoda").join("ptx"))
}

/// The cache file of `arch`'s PTX for `key`.
pub fn cache_file(dir: &Path, arch: &str, key: u64) -> PathBuf {
    dir.join(format!("kernels-{arch}-{key:016x}.ptx"))
}

fn cache_dir() -> Option<PathBuf> {
    let xdg = std::env::var("XDG_CACHE_HOME").ok();
    let home = std::env::var("HOME").ok();
    cache_dir_from(xdg.as_deref(), home.as_deref())
}

/// Whether libnvrtc can be loaded. cudarc panics on its first NVRTC call
/// when it cannot, so every compile asks this first.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { nvrtc::sys::is_culib_present() }
}

/// Compiles [`SOURCE`] for `arch` with NVRTC, returning the PTX text or the
/// compiler's log.
pub fn compile(arch: &str) -> Result<String, String> {
    if !nvrtc_available() {
        return Err(format!(
            "libnvrtc could not be loaded (tried {:?} on the library path); install the CUDA toolkit's NVRTC or `pip install nvidia-cuda-nvrtc-cu12` and add its lib/ directory to LD_LIBRARY_PATH",
            cudarc::get_lib_name_candidates("nvrtc")
        ));
    }
    let opts = CompileOptions {
        options: nvrtc_options(arch),
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    let ptx = nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| match e {
        CompileError::CompileError { nvrtc, log, .. } => format!(
            "NVRTC could not compile the kernels for {arch} ({nvrtc:?}):\n{}",
            log.to_string_lossy()
        ),
        other => format!("NVRTC failed for {arch}: {other:?}"),
    })?;
    let bytes = ptx
        .as_bytes()
        .ok_or_else(|| format!("NVRTC returned no PTX image for {arch}"))?;
    // The image is NUL-terminated text.
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8(bytes[..end].to_vec()).map_err(|e| format!("NVRTC's PTX is not UTF-8: {e}"))
}

/// The PTX for `arch`: from this process's memory, else the disk cache,
/// else compiled now (and then stored in both).
pub fn ptx_for(arch: &str) -> Result<String, String> {
    static MEMO: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    // A poisoned lock only means another thread panicked mid-insert; the map
    // holds complete entries either way.
    if let Some(p) = memo.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(p.clone());
    }
    let ptx = ptx_cached(cache_dir().as_deref(), arch)?;
    memo.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}

/// The PTX for `arch` from the cache in `dir` (`None`: no cache), else
/// compiled and stored there. A cache file that lacks an entry point (a
/// truncated or foreign file) is compiled over.
fn ptx_cached(dir: Option<&Path>, arch: &str) -> Result<String, String> {
    let key = cache_key(SOURCE, &nvrtc_options(arch));
    let file = dir.map(|d| cache_file(d, arch, key));
    let cached = file
        .as_deref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .filter(|p| KERNELS.iter().all(|k| defines_entry(p, k)));
    if let Some(p) = cached {
        return Ok(p);
    }
    let p = compile(arch)?;
    if let Some(f) = &file {
        store(f, &p);
    }
    Ok(p)
}

/// Writes the cache file through a temporary name, so a reader never sees
/// a partial file. Failures are ignored: the cache is an optimization.
fn store(file: &Path, ptx: &str) {
    let Some(dir) = file.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, ptx).is_ok() && std::fs::rename(&tmp, file).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Whether `ptx` defines the kernel entry point `name`.
pub fn defines_entry(ptx: &str, name: &str) -> bool {
    ptx.lines().any(|l| {
        l.trim_start()
            .strip_prefix(".visible .entry ")
            .and_then(|rest| rest.strip_prefix(name))
            .is_some_and(|rest| rest.starts_with('('))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_source_arch_and_options() {
        let a = cache_key("x", &nvrtc_options("compute_80"));
        assert_eq!(a, cache_key("x", &nvrtc_options("compute_80")));
        assert_ne!(a, cache_key("y", &nvrtc_options("compute_80")));
        assert_ne!(a, cache_key("x", &nvrtc_options("compute_90")));
        assert_ne!(
            cache_key("x", &["ab".into(), "c".into()]),
            cache_key("x", &["a".into(), "bc".into()])
        );
        // Pinned: the file name must not change between builds.
        assert_eq!(cache_key("", &[]), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn cache_dir_prefers_xdg() {
        assert_eq!(
            cache_dir_from(Some("/x"), Some("/h")),
            Some(PathBuf::from("/x/pagoda/ptx"))
        );
        assert_eq!(
            cache_dir_from(Some(""), Some("/h")),
            Some(PathBuf::from("/h/.cache/pagoda/ptx"))
        );
        assert_eq!(cache_dir_from(None, None), None);
        let f = cache_file(Path::new("/c"), "compute_90", 0xab);
        assert_eq!(
            f,
            PathBuf::from("/c/kernels-compute_90-00000000000000ab.ptx")
        );
    }

    #[test]
    fn entry_points_are_matched_whole() {
        let ptx = ".visible .entry pg_add(\n.visible .entry pg_add_bias(\n";
        assert!(defines_entry(ptx, "pg_add"));
        assert!(defines_entry(ptx, "pg_add_bias"));
        assert!(!defines_entry(ptx, "pg_ad"));
        assert!(!defines_entry(ptx, "pg_rope"));
    }

    #[test]
    fn every_listed_kernel_is_in_the_source() {
        for k in KERNELS {
            assert!(SOURCE.contains(k), "{k} not in kernels.cu");
        }
        assert_eq!(arch_for(9, 0), "compute_90");
    }

    /// The disk cache is written, read back, repaired when damaged, and
    /// optional when unwritable.
    #[test]
    fn ptx_cache_round_trip() {
        if !nvrtc_available() {
            eprintln!("skipping ptx_cache_round_trip: libnvrtc not found");
            return;
        }
        let dir = std::env::temp_dir().join(format!("pagoda-ptx-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let arch = "compute_80";
        let file = cache_file(&dir, arch, cache_key(SOURCE, &nvrtc_options(arch)));
        let first = ptx_cached(Some(&dir), arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            std::fs::read_to_string(&file).ok().as_deref(),
            Some(first.as_str())
        );
        std::fs::write(&file, "garbage").unwrap_or_else(|e| panic!("{e}"));
        let again = ptx_cached(Some(&dir), arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again, first);
        assert_eq!(
            std::fs::read_to_string(&file).ok().as_deref(),
            Some(first.as_str())
        );
        // A cache "directory" below a regular file cannot be created.
        let blocked = file.join("sub");
        assert_eq!(
            ptx_cached(Some(&blocked), arch).ok().as_deref(),
            Some(first.as_str())
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Compiles every kernel with NVRTC for compute_80 and compute_90. Needs
    /// only libnvrtc (`eval "$(scripts/nvrtc-env.sh)"`), no GPU or driver.
    /// Skips with a message when NVRTC is missing, unless
    /// `PAGODA_REQUIRE_NVRTC=1`, when it fails.
    #[test]
    fn nvrtc_compiles_every_kernel() {
        if !nvrtc_available() {
            let msg = format!(
                "libnvrtc not found (cudarc tries {:?}); run `eval \"$(scripts/nvrtc-env.sh)\"`",
                cudarc::get_lib_name_candidates("nvrtc")
            );
            if std::env::var("PAGODA_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("PAGODA_REQUIRE_NVRTC=1: {msg}");
            }
            eprintln!("skipping nvrtc_compiles_every_kernel: {msg}");
            return;
        }
        for arch in ["compute_80", "compute_90"] {
            let ptx = match compile(arch) {
                Ok(p) => p,
                Err(e) => panic!("{e}"),
            };
            assert!(!ptx.is_empty(), "{arch}: empty PTX");
            assert!(
                ptx.contains(&format!(".target sm_{}", &arch[8..])),
                "{arch}"
            );
            for k in KERNELS {
                assert!(defines_entry(&ptx, k), "{arch}: PTX lacks entry {k}");
            }
            // The accumulators must stay in registers: local memory in the
            // attention kernel would mean spilling on every tile.
            assert!(!ptx.contains(".local"), "{arch}: kernels use local memory");
        }
    }
}
