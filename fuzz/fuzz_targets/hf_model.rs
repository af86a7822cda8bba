//! A Hugging Face model folder's files as the loader reads them: the first
//! input byte picks `config.json` (parsed and validated) or a
//! `model.safetensors` file (its header and every tensor's offsets), or a
//! `model.safetensors.index.json` naming the shards.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagoda::engine::config::ModelConfig;
use pagoda::engine::loader::safetensors::SafetensorsSource;
use pagoda::engine::loader::DType;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) {
                if let Ok(c) = ModelConfig::from_hf_json(&v) {
                    let _ = c.validate();
                }
            }
        }
        kind => {
            let dir = std::env::temp_dir().join(format!("pagoda-fuzz-hf-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            if std::fs::create_dir_all(&dir).is_err() {
                return;
            }
            let name = if kind == 1 {
                "model.safetensors"
            } else {
                "model.safetensors.index.json"
            };
            if std::fs::write(dir.join(name), rest).is_err() {
                return;
            }
            let _ = SafetensorsSource::open(&dir, DType::Float32, None);
        }
    }
});
