//! `pagoda models`: which architectures this build can load.

use crate::engine::models::registry::architectures;

/// Prints the supported architectures and formats.
pub fn run() {
    println!("{:<22} {:<8} models", "architecture", "gguf");
    for e in architectures() {
        let gguf = e.gguf.first().copied().unwrap_or("-");
        println!("{:<22} {gguf:<8} {}", e.hf[0], e.models);
    }
    println!();
    println!(
        "formats: Hugging Face folders (config.json as transformers 4 or 5 writes it, safetensors)"
    );
    println!("           float32, bfloat16, float16");
    println!("           --quantization gptq: GPTQ int4/int8 (group size incl. -1, desc_act, sym or not)");
    println!("           --quantization awq: AWQ int4");
    println!("           --quantization compressed-tensors: W8A8 int8 (dynamic or static activations), W4A16");
    println!("           --quantization ascend: Ascend ModelSlim W8A8 / W8A8_DYNAMIC");
    println!("           --quantization w8a8: whichever W8A8 format the folder holds");
    println!("           --quantization int8: a float checkpoint quantized to int8 at load");
    println!("         GGUF files (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)");
    println!("         quantized weights stay quantized in memory");
}
