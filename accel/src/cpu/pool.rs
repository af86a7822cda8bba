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
        if self.threads == 1 || n_tasks == 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        self.region(n_tasks, false, f);
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

fn drain_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
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
