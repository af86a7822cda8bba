//! Once a `MatmulScratch` has warmed up, `Weight::matmul` must not touch the
//! heap (decode runs hundreds of matmuls per token). A counting global
//! allocator checks it for every type, decode, batched-decode and prefill
//! sizes, on one and two threads.
//!
//! Only the threads that run the matmul count: the test's own and the
//! pool's. The test harness's main thread allocates its bookkeeping for a
//! test just after starting it, and on a loaded machine (a full suite's
//! run, its processes paused and resumed) those allocations once landed
//! inside a measured call: "F16 m 16 threads 1: 4 allocations", where the
//! test alone never allocates.

use pagoda_accel::{GgmlType, MatmulScratch, ThreadPool, Weight};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread's allocations count (a const initializer and no
    /// destructor, so reading it never allocates).
    static COUNTED: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if COUNTED.with(Cell::get) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn matmul_is_allocation_free_once_warm() {
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        // Every thread of the pool counts, the caller (index 0) included.
        pool.broadcast(&|_| COUNTED.with(|c| c.set(true)));
        for ty in types {
            let (rows, cols) = (130, 768);
            let w = match ty {
                GgmlType::Q4_K | GgmlType::Q6_K => {
                    // Zeroed blocks are valid (all-zero scales).
                    let bytes = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
                    Weight::from_raw(ty, rows, cols, &bytes).unwrap()
                }
                _ => {
                    let data: Vec<f32> = (0..rows * cols)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                        .collect();
                    Weight::quantize(ty, rows, cols, &data).unwrap()
                }
            };
            let mut scratch = MatmulScratch::default();
            let x: Vec<f32> = (0..64 * cols).map(|i| (i % 13) as f32 - 6.0).collect();
            let mut out = vec![0.0f32; 64 * rows];
            // Warm up at the largest size, then decode-like calls.
            w.matmul(&pool, &x, 64, &mut out, &mut scratch);
            for m in [16, 1, 5, 64, 16, 1] {
                let before = ALLOCS.load(Ordering::SeqCst);
                w.matmul(&pool, &x[..m * cols], m, &mut out[..m * rows], &mut scratch);
                let after = ALLOCS.load(Ordering::SeqCst);
                assert_eq!(
                    after,
                    before,
                    "{ty} m {m} threads {threads}: {} allocations",
                    after - before
                );
            }
        }
    }
}
