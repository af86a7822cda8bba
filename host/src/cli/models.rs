//! `pagoda models`: which architectures this build can load.

use crate::engine::config::SUPPORTED_ARCHITECTURES;

/// Prints the supported architectures and formats.
pub fn run() {
    println!("{:<22} {:<8} models", "architecture", "gguf");
    for (hf, gguf, examples) in SUPPORTED_ARCHITECTURES {
        println!("{hf:<22} {gguf:<8} {examples}");
    }
    println!();
    println!("formats: Hugging Face folders (config.json + safetensors, float32/bfloat16/float16)");
    println!("         GGUF files (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; quantized weights stay quantized)");
}
