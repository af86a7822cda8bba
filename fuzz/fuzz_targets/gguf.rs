//! A GGUF file as `pagoda serve --model x.gguf` reads it: the header,
//! metadata and tensor infos, the model config and the tokenizer built
//! from its metadata.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pagoda::engine::config::ModelConfig;
use pagoda::engine::loader::gguf::GgufFile;
use pagoda::tokenizer::Tokenizer;
use std::io::Write;

fuzz_target!(|data: &[u8]| {
    // The reader maps a file, so the input becomes one (in memory).
    let path = std::env::temp_dir().join(format!("pagoda-fuzz-{}.gguf", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    if let Ok(g) = GgufFile::open(&path) {
        if let Ok(c) = ModelConfig::from_gguf(&g) {
            let _ = c.validate();
        }
        let _ = Tokenizer::from_gguf(&g);
    }
});
