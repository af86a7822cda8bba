//! A fork-join thread pool whose workers park instead of spinning.
//!
//! A decode step runs a few hundred short parallel regions (one per matmul),
//! each tens of microseconds long, so spawning threads per region is too slow
//! and a general work-stealing pool is more than we need. Workers spin for a
//! few microseconds after a region (the next one usually follows at once) and
//! then sleep on a condition variable, so an idle server, or a VM whose vCPUs
//! are shared, does not burn a core. Measured on this project's 2-core VM,
//! pools that spin indefinitely collapse when the hypervisor deschedules one
//! of the spinners.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// How many times a worker polls for new work before it parks. At roughly
/// 5-10 ns a poll this is a few microseconds: long enough to catch the next
/// matmul of the same layer, short enough not to steal a shared vCPU.
const SPIN_POLLS: u32 = 2_000;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per parallel region; workers run the job when it changes.
    generation: AtomicU64,
    /// The current region's closure. Written only by the caller of
    /// [`ThreadPool::run`] before `generation` is bumped (Release), read by
    /// workers after they observe the bump (Acquire).
    job: UnsafeCell<Option<Job>>,
    n_tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// Workers that have not yet finished the current region.
    active: AtomicUsize,
    shutdown: AtomicBool,
    /// Whether the current region is a [`ThreadPool::broadcast`]: each
    /// worker then calls the job once with its own index instead of
    /// draining tasks. Written with `job`, under the same protocol.
    broadcast: AtomicBool,
    /// Workers blocked (or about to block) on `wake`. Notifying a condvar
    /// is a futex syscall even when nobody waits; at two regions per layer
    /// op that was ~600 syscalls per decoded token, so `run` notifies only
    /// when this is non-zero. SeqCst on both sides: a worker that registers
    /// after `run` read zero re-checks the generation and sees the bump.
    sleepers: AtomicUsize,
    /// Whether `run`'s caller is blocked (or about to block) on `done`;
    /// the last worker notifies only then, for the same reason.
    caller_sleeping: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    done_lock: Mutex<()>,
    done: Condvar,
    /// The side tasks of [`ThreadPool::run_with_side`], written only while
    /// none is claimable (see `side_claim`).
    side_job: UnsafeCell<Option<Job>>,
    /// `epoch << 40 | n << 20 | next`: side task `next` of `n` is the next
    /// to claim. Claimed by compare-exchange, so a thread that read an
    /// older word (another epoch, or one already claimed) claims nothing.
    side_claim: AtomicU64,
    /// Side tasks of the current epoch that have returned.
    side_done: AtomicUsize,
}

// SAFETY: `job` is only written while no worker can read it (all workers have
// finished the previous region, see `ThreadPool::run`), and published through
// the Release/Acquire pair on `generation`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A pool of `threads - 1` workers; the calling thread is the last worker.
pub struct ThreadPool {
    shared: Arc<Shared>,
    /// See [`ThreadPool::id`].
    id: u64,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    /// Serializes callers: one parallel region at a time per pool.
    region: Mutex<()>,
    /// One [`ThreadPool::run_with_side`] at a time per pool.
    side: Mutex<()>,
}

impl ThreadPool {
    /// Creates a pool that runs regions on `threads` threads (the caller
    /// included). `threads == 0` is taken as 1.
    pub fn new(threads: usize) -> ThreadPool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            broadcast: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            caller_sleeping: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
            side_job: UnsafeCell::new(None),
            side_claim: AtomicU64::new(0),
            side_done: AtomicUsize::new(0),
        });
        let workers = (1..threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("pagoda-cpu-{i}"))
                    .spawn(move || worker_loop(&shared, i))
                    .expect("spawning a CPU worker thread")
            })
            .collect();
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        ThreadPool {
            shared,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            workers,
            threads,
            region: Mutex::new(()),
            side: Mutex::new(()),
        }
    }

    /// The number of threads a region runs on, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// An identity no other pool of this process has (never 0). Lets a
    /// caller remember what it prepared on a pool's threads.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks`, spread over the pool, and
    /// returns when all calls have returned. Tasks are handed out one at a
    /// time from a shared counter, so uneven tasks balance themselves.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        // A single task is run here, unless side tasks wait for a thread.
        if self.threads == 1 || (n_tasks == 1 && !side_pending(&self.shared)) {
            (0..n_tasks).for_each(f);
            return;
        }
        self.region(n_tasks, false, f);
    }

    /// Runs `body` and `side(i)` for every `i` in `0..n_side`, returning
    /// when all have returned. The side tasks are handed out, before their
    /// own tasks, by the regions `body` runs on this pool, so work that
    /// depends on neither (a LoRA delta beside its projection's matmul)
    /// fills the threads that would otherwise wait at the region's end,
    /// without a region of its own; whatever no region took runs here after
    /// `body`. Which thread runs a side task is up to timing.
    ///
    /// `side` must not use this pool.
    pub fn run_with_side(&self, n_side: usize, side: &(dyn Fn(usize) + Sync), body: impl FnOnce()) {
        const MAX: usize = (1 << 20) - 1;
        if self.threads == 1 || n_side == 0 || n_side > MAX {
            body();
            (0..n_side).for_each(side);
            return;
        }
        let _side = self.side.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: nothing is claimable (the previous epoch ended with
        // `n = 0`), so no thread reads `side_job`; the lifetime erased here
        // outlives every claim, as this function waits for all of them.
        unsafe {
            let erased: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(side);
            *s.side_job.get() = Some(erased);
        }
        s.side_done.store(0, Ordering::Relaxed);
        let epoch = ((s.side_claim.load(Ordering::Relaxed) >> 40) + 1) & 0xFF_FFFF;
        s.side_claim
            .store(epoch << 40 | (n_side as u64) << 20, Ordering::Release);
        body();
        drain_side(s);
        // Claimed tasks ran inside regions that have ended, or above; this
        // waits only if another caller's region of this pool took one.
        while s.side_done.load(Ordering::Acquire) < n_side {
            std::hint::spin_loop();
        }
        s.side_claim.store(epoch << 40, Ordering::Release);
        unsafe {
            *s.side_job.get() = None;
        }
    }

    /// Runs `f(t)` exactly once on every thread of the pool, `t` being the
    /// thread's index (`0` is the caller). Which thread runs a task of
    /// [`ThreadPool::run`] is up to timing; this is how per-thread state
    /// (kernel scratch buffers) is prepared on all of them deterministically.
    pub fn broadcast(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            f(0);
            return;
        }
        self.region(1, true, f);
    }

    fn region(&self, n_tasks: usize, broadcast: bool, f: &(dyn Fn(usize) + Sync)) {
        let _region = self.region.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: the previous region ended with `active == 0`, so no worker
        // reads `job` now. We erase the lifetime of `f`; it stays valid
        // because this function does not return before `active` is 0 again.
        unsafe {
            let erased: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f);
            *s.job.get() = Some(erased);
        }
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next_task.store(0, Ordering::Relaxed);
        s.broadcast.store(broadcast, Ordering::Relaxed);
        s.active.store(self.threads - 1, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        if broadcast {
            f(0);
        } else {
            drain_tasks(s, f);
        }
        // Wait for the workers to leave the region before `f` goes away.
        let mut polls = 0;
        while s.active.load(Ordering::Acquire) != 0 {
            if polls < SPIN_POLLS {
                polls += 1;
                std::hint::spin_loop();
            } else {
                let g = s.done_lock.lock().unwrap_or_else(|e| e.into_inner());
                s.caller_sleeping.store(true, Ordering::SeqCst);
                if s.active.load(Ordering::SeqCst) != 0 {
                    let _g = s
                        .done
                        .wait_timeout(g, std::time::Duration::from_millis(1))
                        .unwrap_or_else(|e| e.into_inner());
                }
                s.caller_sleeping.store(false, Ordering::SeqCst);
            }
        }
        unsafe {
            *s.job.get() = None;
        }
    }

    /// Splits `0..len` into about `4 × threads` contiguous chunks whose
    /// starts are multiples of `align`, and runs `f(start, end)` on each.
    pub fn run_ranges(&self, len: usize, align: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let align = align.max(1);
        let units = len.div_ceil(align);
        let chunks = (self.threads * 4).min(units).max(1);
        let per = units.div_ceil(chunks);
        let n = units.div_ceil(per.max(1));
        self.run(n, &|i| {
            let start = i * per * align;
            let end = ((i + 1) * per * align).min(len);
            if start < end {
                f(start, end);
            }
        });
    }
}

/// Whether a side task is waiting to be claimed.
fn side_pending(s: &Shared) -> bool {
    let v = s.side_claim.load(Ordering::Acquire);
    (v & 0xF_FFFF) < ((v >> 20) & 0xF_FFFF)
}

/// Claims the next side task, if one is left.
fn claim_side(s: &Shared) -> Option<usize> {
    let mut v = s.side_claim.load(Ordering::Acquire);
    loop {
        let (n, next) = ((v >> 20) & 0xF_FFFF, v & 0xF_FFFF);
        if next >= n {
            return None;
        }
        match s
            .side_claim
            .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(next as usize),
            Err(now) => v = now,
        }
    }
}

/// Runs side tasks until none is left to claim.
fn drain_side(s: &Shared) {
    while let Some(i) = claim_side(s) {
        // SAFETY: published before the claim word we claimed from (Release
        // / AcqRel), and kept alive by `run_with_side` until this task
        // counts itself done.
        let job = unsafe { (*s.side_job.get()).expect("side tasks come with their job") };
        let f: &(dyn Fn(usize) + Sync) = unsafe { &*job };
        f(i);
        s.side_done.fetch_add(1, Ordering::Release);
    }
}

fn drain_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    drain_side(s);
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next_task.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

fn worker_loop(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let mut polls = 0;
        let gen = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen || s.shutdown.load(Ordering::Relaxed) {
                break g;
            }
            if polls < SPIN_POLLS {
                polls += 1;
                std::hint::spin_loop();
                continue;
            }
            let guard = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            if s.generation.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                drop(s.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
            } else {
                drop(guard);
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        };
        if s.shutdown.load(Ordering::Relaxed) {
            return;
        }
        seen = gen;
        // SAFETY: published before the generation bump we observed, and kept
        // alive by `run` until we decrement `active`.
        let job = unsafe { (*s.job.get()).expect("a job is published with each generation") };
        let f: &(dyn Fn(usize) + Sync) = unsafe { &*job };
        if s.broadcast.load(Ordering::Relaxed) {
            f(index);
        } else {
            drain_tasks(s, f);
        }
        if s.active.fetch_sub(1, Ordering::SeqCst) == 1 && s.caller_sleeping.load(Ordering::SeqCst)
        {
            let _g = s.done_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.done.notify_all();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _g = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for n in [1usize, 2, 7, 100, 1000] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn ranges_cover_the_whole_length_aligned() {
        let pool = ThreadPool::new(2);
        for (len, align) in [(0usize, 1usize), (1, 1), (17, 4), (1000, 32), (31, 64)] {
            let covered: Vec<AtomicU64> = (0..len).map(|_| AtomicU64::new(0)).collect();
            pool.run_ranges(len, align, &|a, b| {
                assert_eq!(a % align, 0);
                for c in &covered[a..b] {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(covered.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn broadcast_runs_once_on_every_thread() {
        for threads in [1usize, 2, 3] {
            let pool = ThreadPool::new(threads);
            for _ in 0..50 {
                let hits: Vec<AtomicU64> = (0..threads).map(|_| AtomicU64::new(0)).collect();
                let names = Mutex::new(std::collections::HashSet::new());
                pool.broadcast(&|t| {
                    hits[t].fetch_add(1, Ordering::Relaxed);
                    names.lock().unwrap().insert(std::thread::current().id());
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                assert_eq!(names.lock().unwrap().len(), threads);
            }
            // A plain region still works after a broadcast.
            let sum = AtomicU64::new(0);
            pool.run(10, &|i| {
                sum.fetch_add(i as u64, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 45);
        }
    }

    #[test]
    fn side_tasks_run_exactly_once_beside_regions_or_after_them() {
        for threads in [1usize, 2, 3] {
            let pool = ThreadPool::new(threads);
            // Beside a region of many tasks, of one task, and of none.
            for body_tasks in [0usize, 1, 40] {
                for n_side in [0usize, 1, 5, 300] {
                    let side: Vec<AtomicU64> = (0..n_side).map(|_| AtomicU64::new(0)).collect();
                    let main: Vec<AtomicU64> = (0..body_tasks).map(|_| AtomicU64::new(0)).collect();
                    pool.run_with_side(
                        n_side,
                        &|i| {
                            side[i].fetch_add(1, Ordering::Relaxed);
                        },
                        || {
                            pool.run(body_tasks, &|i| {
                                main[i].fetch_add(1, Ordering::Relaxed);
                            })
                        },
                    );
                    let once = |v: &[AtomicU64]| v.iter().all(|h| h.load(Ordering::Relaxed) == 1);
                    assert!(once(&side), "{threads} threads, {body_tasks} + {n_side}");
                    assert!(once(&main), "{threads} threads, {body_tasks} + {n_side}");
                }
            }
            // Regions after it hand out nothing more.
            let sum = AtomicU64::new(0);
            pool.run(10, &|i| {
                sum.fetch_add(i as u64, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 45);
        }
    }

    #[test]
    fn a_side_task_runs_beside_the_region_not_after_it() {
        // The side task and the region's only task each wait for the
        // other's mark: both see it only if they run at the same time.
        let pool = ThreadPool::new(2);
        let (side_mark, task_mark) = (AtomicBool::new(false), AtomicBool::new(false));
        let wait_for = |mark: &AtomicBool| {
            let start = std::time::Instant::now();
            while !mark.load(Ordering::SeqCst) {
                if start.elapsed() > std::time::Duration::from_secs(10) {
                    return false;
                }
                std::thread::yield_now();
            }
            true
        };
        let (side_saw, task_saw) = (AtomicBool::new(false), AtomicBool::new(false));
        pool.run_with_side(
            1,
            &|_| {
                side_mark.store(true, Ordering::SeqCst);
                side_saw.store(wait_for(&task_mark), Ordering::SeqCst);
            },
            || {
                pool.run(1, &|_| {
                    task_mark.store(true, Ordering::SeqCst);
                    task_saw.store(wait_for(&side_mark), Ordering::SeqCst);
                })
            },
        );
        assert!(side_saw.load(Ordering::SeqCst) && task_saw.load(Ordering::SeqCst));
    }

    #[test]
    fn parks_between_regions_and_wakes_again() {
        let pool = ThreadPool::new(2);
        let sum = AtomicU64::new(0);
        pool.run(10, &|i| {
            sum.fetch_add(i as u64, Ordering::Relaxed);
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        pool.run(10, &|i| {
            sum.fetch_add(i as u64, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 90);
    }
}
