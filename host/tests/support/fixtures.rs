//! Where scripts/make-fixtures.py's checkpoints are: `target/generated-fixtures`
//! (or `$PAGODA_GENERATED_FIXTURES`), made on first use when missing.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The families the script writes, one folder each.
pub const FAMILIES: [&str; 12] = [
    "llama3",
    "mistral",
    "qwen3",
    "mixtral",
    "qwen2moe",
    "qwen3moe",
    "deepseek-v2-lite",
    "deepseek-v3",
    "qwen3-next",
    "qwen3_5",
    "qwen3_5_moe",
    "gpt_oss",
];

/// The fixtures' folder, made by the script if it is not there yet.
pub fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = std::env::var_os("PAGODA_GENERATED_FIXTURES")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target/generated-fixtures"));
        let complete = FAMILIES
            .iter()
            .all(|f| dir.join(f).join("reference.json").exists());
        if !complete {
            let status = std::process::Command::new("python3")
                .arg(root.join("scripts/make-fixtures.py"))
                .arg(&dir)
                .status()
                .expect("running python3 scripts/make-fixtures.py (needs python3 with numpy)");
            assert!(
                status.success(),
                "scripts/make-fixtures.py failed; install numpy (and gguf for the GGUF files)"
            );
        }
        dir
    })
}
