//! A warm decode step of the model makes no heap allocation: every buffer
//! comes from the workspace and the matmul scratch, sized on the first
//! steps. A counting global allocator enforces it.

mod common;
mod counting_alloc;

use pagoda::engine::args::{cpu_backend, load_model};
use pagoda::engine::models::Workspace;
use pagoda::engine::EngineArgs;
use pagoda_accel::ops::KvDtype;
use pagoda_accel::{Backend, CpuBackend, KvSpec, StepBatch};

#[test]
fn a_warm_batched_decode_step_allocates_nothing() {
    warm_decode_allocates_nothing(EngineArgs::new(common::demo_gguf()));
}

/// transformers' tiny checkpoint of `family` (tests/fixtures/hf-families).
fn hf_family(family: &str) -> EngineArgs {
    let root = match std::env::var_os("PAGODA_HF_FAMILIES") {
        Some(p) => std::path::PathBuf::from(p),
        None => {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-families")
        }
    };
    EngineArgs::new(root.join(family))
}

#[test]
fn a_warm_mixture_of_experts_decode_step_allocates_nothing() {
    // Routing, grouping by expert and the grouped matmuls, and Qwen2-MoE's
    // gated shared expert.
    warm_decode_allocates_nothing(hf_family("qwen2moe"));
}

#[test]
fn a_warm_latent_attention_decode_step_allocates_nothing() {
    // DeepSeek-V3: the latent cache, the absorbed per-head matmuls, and
    // sigmoid routing limited to groups.
    warm_decode_allocates_nothing(hf_family("deepseekv3"));
}

#[test]
fn a_warm_hybrid_decode_step_allocates_nothing() {
    // Qwen3-Next: the Gated DeltaNet layers' conv and delta-rule state
    // updates in their slots, the gated attention with partial RoPE, and
    // the experts with the gated shared expert.
    let root = match std::env::var_os("PAGODA_HF_FAMILIES_2026") {
        Some(p) => std::path::PathBuf::from(p),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hf-families-2026"),
    };
    warm_decode_allocates_nothing(EngineArgs::new(root.join("qwen3_next")));
}

#[test]
fn a_warm_gpt_oss_decode_step_allocates_nothing() {
    // gpt-oss: attention sinks, sliding-window and full layers, the biased
    // router and the fused experts with biases and a clamped SwiGLU.
    let root = match std::env::var_os("PAGODA_HF_FAMILIES_2026") {
        Some(p) => std::path::PathBuf::from(p),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hf-families-2026"),
    };
    warm_decode_allocates_nothing(EngineArgs::new(root.join("gpt_oss")));
}

/// Prefills four sequences, then decodes them step by step: every decode
/// step after the first must not touch the heap.
fn warm_decode_allocates_nothing(mut args: EngineArgs) {
    // The allocation counter is global to the process: one test at a time,
    // or another test's loading counts against this one's decode.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _only = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    args.threads = 2;
    let mut b: CpuBackend = cpu_backend(&args).expect("a CPU backend");
    let (model, loaded) = load_model(&b, &args, |_| 512).expect("load the model");
    let c = loaded.config;
    let bs = 16;
    let spec = KvSpec {
        dtype: KvDtype::F16,
        num_blocks: 64,
        block_size: bs,
        layers: model.kv_layers(),
    };
    let mut kv = b.alloc_kv(&spec).expect("a KV pool");
    let mut ws = Workspace::<CpuBackend>::default();
    // A slot per sequence for a hybrid model's linear layers (none
    // otherwise).
    let mut state = model.alloc_state(&mut b, 4).expect("the recurrent state");
    state.slots.extend(0..4u32);
    let mut step = <CpuBackend as Backend>::Step::default();
    // Four sequences, each with its own 8 blocks.
    let tables: Vec<Vec<u32>> = (0..4u32).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|s| (0..10 + 3 * s).map(|i| 100 + 7 * i + s).collect())
        .collect();

    // Prefill all four in one batch.
    let mut batch = StepBatch::default();
    for (s, p) in prompts.iter().enumerate() {
        batch.push_seq(p, 0, &tables[s], bs, usize::MAX, 1);
    }
    b.upload_step(&batch, &mut step).expect("upload");
    model
        .forward(
            &mut b,
            &step,
            batch.num_tokens(),
            4,
            &mut kv,
            &mut state,
            &mut ws,
        )
        .expect("prefill");
    let logits = b
        .to_host(&mut ws.logits, 4 * c.vocab_size)
        .expect("logits")
        .to_vec();

    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
            .0 as u32
    };
    let mut next: Vec<u32> = (0..4)
        .map(|s| argmax(&logits[s * c.vocab_size..(s + 1) * c.vocab_size]))
        .collect();
    let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for step_no in 0..6 {
        batch.clear();
        for s in 0..4 {
            batch.push_seq(&next[s..s + 1], lens[s], &tables[s], bs, 0, 1);
        }
        // The first decode step may size buffers for the new shape; later
        // ones must not allocate (uploading the step's metadata included).
        counting_alloc::arm(step_no > 0);
        b.upload_step(&batch, &mut step).expect("upload");
        model
            .forward(&mut b, &step, 4, 4, &mut kv, &mut state, &mut ws)
            .expect("decode");
        let logits = b.to_host(&mut ws.logits, 4 * c.vocab_size).expect("logits");
        let allocated = counting_alloc::disarm();
        if step_no > 0 {
            assert_eq!(allocated, 0, "decode step {step_no} allocated");
        }
        for s in 0..4 {
            lens[s] += 1;
        }
        next = (0..4)
            .map(|s| argmax(&logits[s * c.vocab_size..(s + 1) * c.vocab_size]))
            .collect();
    }
}
