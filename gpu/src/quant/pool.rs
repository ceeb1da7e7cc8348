//! The compute pool the CPU matmuls and attention run on.
//!
//! One process-wide pool of `threads − 1` workers (threads: [`configured_threads`]); the
//! calling thread works too. Work is a count of items
//! claimed one at a time through a shared cursor, so there is no per-thread share to wait for:
//! a worker the OS has descheduled simply claims nothing, and the caller and the other workers
//! take its items. The caller only waits for items already being run. Idle workers spin for a
//! short while (the gap between two matmuls of one decode step) and then sleep on a condition
//! variable. A second caller that finds the pool busy (another tensor-parallel rank) runs its
//! items itself rather than queueing.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: longer than the gap between two decode
/// steps of `pdserve serve` (~0.5–1 ms), so that a step does not start with a sleeping worker.
/// A sleeping worker is woken onto a core that a neighbour may hold (even at `nice 19` the
/// scheduler lets it finish its slice first), and the step runs on one thread until then: with
/// 300 µs here, one `nice 19` busy loop slowed serving decode by 1.1–1.3× (issue 28).
const SPIN: Duration = Duration::from_millis(2);

struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    items: usize,
    cursor: AtomicUsize,
    panicked: AtomicBool,
}

impl Job<'_> {
    fn work(&self) {
        loop {
            let i = self.cursor.fetch_add(1, SeqCst);
            if i >= self.items {
                return;
            }
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (self.f)(i))).is_err() {
                self.panicked.store(true, SeqCst);
            }
        }
    }
}

struct Shared {
    generation: AtomicU64,
    job: AtomicPtr<Job<'static>>,
    closed: AtomicBool,
    active: AtomicUsize,
    sleepers: AtomicUsize,
    stop: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

/// A pool of compute threads (see the module docs).
pub struct Pool {
    shared: Arc<Shared>,
    busy: Mutex<()>,
    workers: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("workers", &self.workers)
            .finish()
    }
}

impl Pool {
    /// A pool with `workers` threads besides the caller's.
    pub fn new(workers: usize) -> Self {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            closed: AtomicBool::new(true),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 0..workers {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("pdserve-compute-{i}"))
                .spawn(move || worker(&s))
                .expect("spawning a compute thread");
        }
        Self {
            shared,
            busy: Mutex::new(()),
            workers,
        }
    }

    /// Threads that run a job (workers and the caller).
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Runs `f(i)` for every `i < items`, on the caller and the workers; returns when all are
    /// done.
    ///
    /// # Panics
    /// When `f` panicked on any thread.
    pub fn run(&self, items: usize, f: &(dyn Fn(usize) + Sync)) {
        let guard = if self.workers == 0 || items <= 1 {
            None
        } else {
            self.busy.try_lock().ok()
        };
        let Some(guard) = guard else {
            (0..items).for_each(f);
            return;
        };
        let job = Job {
            f,
            items,
            cursor: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        let s = &*self.shared;
        // SAFETY: the pointer is only dereferenced by workers registered in `active` while
        // `closed` is false; this function clears it and waits for `active == 0` before `job`
        // goes out of scope.
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        s.job.store(ptr, SeqCst);
        s.closed.store(false, SeqCst);
        s.generation.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        job.work();
        s.closed.store(true, SeqCst);
        let mut spins = 0u32;
        while s.active.load(SeqCst) != 0 {
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        s.job.store(std::ptr::null_mut(), SeqCst);
        drop(guard);
        assert!(!job.panicked.load(SeqCst), "a compute item panicked");
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.wake.notify_all();
    }
}

fn worker(s: &Shared) {
    let mut seen = s.generation.load(SeqCst);
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        if s.stop.load(SeqCst) {
            return;
        }
        let g = s.generation.load(SeqCst);
        if g == seen {
            // The clock is read once per 64 spins: reading it on every spin cost ~4% of a
            // 2-thread decode step in `clock_gettime`.
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || idle_since.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, SeqCst);
            while s.generation.load(SeqCst) == seen && !s.stop.load(SeqCst) {
                l = s
                    .wake
                    .wait_timeout(l, Duration::from_millis(100))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            s.sleepers.fetch_sub(1, SeqCst);
            continue;
        }
        seen = g;
        s.active.fetch_add(1, SeqCst);
        if s.generation.load(SeqCst) == g && !s.closed.load(SeqCst) {
            let p = s.job.load(SeqCst);
            if !p.is_null() {
                // SAFETY: registered in `active` with the job still open (see `Pool::run`).
                unsafe { (*p).work() };
            }
        }
        s.active.fetch_sub(1, SeqCst);
        idle_since = Instant::now();
    }
}

/// The process-wide pool, sized by [`configured_threads`] on first use.
pub fn global() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(configured_threads().saturating_sub(1)))
}

/// Environment variables that set the compute threads, first match wins (candle's order; both
/// are also read by candle for the few operations still on its pools).
pub const THREAD_ENV: [&str; 2] = ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"];

/// Compute threads: the first of [`THREAD_ENV`] set to a positive integer, else
/// [`default_threads`].
pub fn configured_threads() -> usize {
    THREAD_ENV
        .iter()
        .find_map(|v| {
            std::env::var(v)
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .filter(|&n| n > 0)
        })
        .unwrap_or_else(default_threads)
}

/// The CPUs this process may use: the smaller of its affinity mask (`sched_getaffinity`) and
/// its cgroup v2 CPU quota (`cpu.max`, the tightest along its cgroup path, rounded down), at
/// least 1. More compute threads than that only take turns on the same CPUs, and a quota
/// overrun throttles the whole process for the rest of the period.
pub fn default_threads() -> usize {
    let cpus = affinity_cpus().unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let quota = cgroup_cpu_quota().unwrap_or(usize::MAX);
    cpus.min(quota).max(1)
}

/// CPUs in this thread's affinity mask.
#[cfg(target_os = "linux")]
fn affinity_cpus() -> Option<usize> {
    // SAFETY: `set` is a plain bitmask the call fills in; its size is passed with it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        usize::try_from(libc::CPU_COUNT(&set))
            .ok()
            .filter(|&n| n > 0)
    }
}

#[cfg(not(target_os = "linux"))]
fn affinity_cpus() -> Option<usize> {
    None
}

/// Whole CPUs of the tightest cgroup v2 `cpu.max` quota from this process's cgroup up to the
/// root (`None`: no cgroup v2, or no quota anywhere).
fn cgroup_cpu_quota() -> Option<usize> {
    let root = std::path::Path::new("/sys/fs/cgroup");
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut dir = root.join(path.trim().trim_start_matches('/'));
    let mut best: Option<usize> = None;
    loop {
        if let Some(q) = std::fs::read_to_string(dir.join("cpu.max"))
            .ok()
            .and_then(|s| parse_cpu_max(&s))
        {
            best = Some(best.map_or(q, |b| b.min(q)));
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            return best;
        }
    }
}

/// Whole CPUs of a cgroup v2 `cpu.max` line, `"$MAX $PERIOD"`: `None` for `"max …"` (no
/// quota) or a malformed line; otherwise `MAX / PERIOD` rounded down, at least 1
/// (`"200000 100000"` is 2, `"150000 100000"` is 1).
pub fn parse_cpu_max(line: &str) -> Option<usize> {
    let mut it = line.split_whitespace();
    let max = it.next()?;
    let period: u64 = it.next().map_or(Some(100_000), |p| p.parse().ok())?;
    if max == "max" || period == 0 || it.next().is_some() {
        return None;
    }
    let max: u64 = max.parse().ok()?;
    Some(usize::try_from(max / period).unwrap_or(usize::MAX).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_once_and_concurrent_callers_finish() {
        let pool = Arc::new(Pool::new(2));
        let mut handles = Vec::new();
        for c in 0..3 {
            let pool = pool.clone();
            handles.push(std::thread::spawn(move || {
                for round in 0..50 {
                    let n = 17 + c + round;
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    pool.run(n, &|i| {
                        hits[i].fetch_add(1, SeqCst);
                    });
                    assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
                }
            }));
        }
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn cpu_max_quota_is_whole_cpus_rounded_down() {
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("max"), None);
        assert_eq!(parse_cpu_max("200000 100000\n"), Some(2));
        assert_eq!(parse_cpu_max("150000 100000"), Some(1));
        assert_eq!(parse_cpu_max("50000 100000"), Some(1));
        assert_eq!(parse_cpu_max("400000 50000"), Some(8));
        // The period defaults to 100 ms when the line has only the quota.
        assert_eq!(parse_cpu_max("300000"), Some(3));
        for bad in ["", "x 100000", "100000 0", "100000 y", "1 2 3"] {
            assert_eq!(parse_cpu_max(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_default_thread_count_is_within_the_cpus_of_this_process() {
        let n = default_threads();
        assert!(n >= 1);
        if let Some(cpus) = affinity_cpus() {
            assert!(n <= cpus);
        }
    }

    #[test]
    fn a_panicking_item_is_reported_to_the_caller() {
        let pool = Pool::new(1);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "item five"));
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let sum = AtomicUsize::new(0);
        pool.run(8, &|i| {
            sum.fetch_add(i, SeqCst);
        });
        assert_eq!(sum.load(SeqCst), 28);
    }
}
