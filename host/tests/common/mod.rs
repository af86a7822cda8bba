//! Helpers shared by the integration tests: where the demo model and the
//! reference outputs are.

#![allow(dead_code)]

use std::path::PathBuf;

/// The demo GGUF (SmolLM2-135M-Instruct Q4_1): `$PAGODA_DEMO_GGUF`, or
/// whatever `scripts/fetch-demo-model.sh` prints (it fetches and caches it).
pub fn demo_gguf() -> PathBuf {
    if let Ok(p) = std::env::var("PAGODA_DEMO_GGUF") {
        return PathBuf::from(p);
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/fetch-demo-model.sh"
    );
    let out = std::process::Command::new(script)
        .output()
        .expect("running scripts/fetch-demo-model.sh");
    assert!(
        out.status.success(),
        "fetch-demo-model.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).expect("a UTF-8 path").trim())
}

/// `tests/fixtures/reference` (a copy of `../shared/reference`), or
/// `$PAGODA_REFERENCE_DIR`.
pub fn reference_dir() -> PathBuf {
    if let Ok(p) = std::env::var("PAGODA_REFERENCE_DIR") {
        return PathBuf::from(p);
    }
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/reference"
    ))
}

/// Reads a JSON file of the reference directory.
pub fn reference_json(name: &str) -> serde_json::Value {
    let path = reference_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference JSON")
}
