//! A warm decode step of the model makes no heap allocation: every buffer
//! comes from the workspace and the matmul scratch, sized on the first
//! steps. A counting global allocator enforces it.

mod common;

use pagoda::engine::args::load_model;
use pagoda::engine::kv_cache::storage::KvCache;
use pagoda::engine::kv_cache::KvCacheDtype;
use pagoda::engine::models::{BatchInput, Workspace};
use pagoda::engine::EngineArgs;
use pagoda_accel::ops::{AttnSeq, KvLayout};
use pagoda_accel::CpuContext;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

struct Counting;
static ARMED: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn a_warm_batched_decode_step_allocates_nothing() {
    let args = EngineArgs::new(common::demo_gguf());
    let (model, loaded) = load_model(&args, |_| 512).expect("load the demo model");
    let c = loaded.config;
    let ctx = CpuContext::new(2);
    let bs = 16;
    let layout = KvLayout {
        num_blocks: 64,
        block_size: bs,
        n_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    let mut kv = KvCache::new(KvCacheDtype::F16, c.num_layers, layout);
    let mut ws = Workspace::default();
    // Four sequences, each with its own 8 blocks.
    let tables: Vec<Vec<u32>> = (0..4u32).map(|s| (s * 8..s * 8 + 8).collect()).collect();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|s| (0..10 + 3 * s).map(|i| 100 + 7 * i + s).collect())
        .collect();
    let slot = |s: usize, p: usize| tables[s][p / bs] * bs as u32 + (p % bs) as u32;

    // Prefill all four in one batch.
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    let mut slots = Vec::new();
    let mut seqs = Vec::new();
    let mut rows = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        seqs.push(AttnSeq {
            q_start: tokens.len(),
            q_len: p.len(),
            ctx_len: p.len(),
            block_table: &tables[s],
        });
        for (i, &t) in p.iter().enumerate() {
            tokens.push(t);
            positions.push(i as u32);
            slots.push(slot(s, i));
        }
        rows.push(tokens.len() - 1);
    }
    let mut logits = vec![0f32; 4 * c.vocab_size];
    let prompt = vec![true; tokens.len()];
    let input = BatchInput {
        tokens: &tokens,
        positions: &positions,
        slot_mapping: &slots,
        seqs: &seqs,
        logit_rows: &rows,
        prompt_rows: &prompt,
    };
    model.forward(&ctx, &input, &mut kv, &mut ws, &mut logits);

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
    let mut dec_pos = vec![0u32; 4];
    let mut dec_slots = vec![0u32; 4];
    let dec_rows = [0usize, 1, 2, 3];
    let generated = [false; 4];
    for step in 0..6 {
        for s in 0..4 {
            dec_pos[s] = lens[s] as u32;
            dec_slots[s] = slot(s, lens[s]);
        }
        let seqs: Vec<AttnSeq<'_>> = (0..4)
            .map(|s| AttnSeq {
                q_start: s,
                q_len: 1,
                ctx_len: lens[s] + 1,
                block_table: &tables[s],
            })
            .collect();
        let input = BatchInput {
            tokens: &next,
            positions: &dec_pos,
            slot_mapping: &dec_slots,
            seqs: &seqs,
            logit_rows: &dec_rows,
            prompt_rows: &generated,
        };
        // The first decode step may size buffers for the new shape; later
        // ones must not allocate.
        ALLOCATIONS.store(0, Ordering::Relaxed);
        ARMED.store(step > 0, Ordering::Relaxed);
        model.forward(&ctx, &input, &mut kv, &mut ws, &mut logits);
        ARMED.store(false, Ordering::Relaxed);
        if step > 0 {
            assert_eq!(
                ALLOCATIONS.load(Ordering::Relaxed),
                0,
                "decode step {step} allocated"
            );
        }
        for s in 0..4 {
            lens[s] += 1;
        }
        next = (0..4)
            .map(|s| argmax(&logits[s * c.vocab_size..(s + 1) * c.vocab_size]))
            .collect();
    }
}
