//! The driver shared by the fuzz targets of every crate (`runtime/tests/fuzz.rs`,
//! `transport/tests/fuzz.rs`, `actors/tests/fuzz.rs` include it with `#[path]`).
//!
//! A target is a decoder of remote bytes and a check of what it returns. [`Target::run`]:
//!
//! 1. replays the target's corpus, `fuzz/corpus/<target>/` (every file one input);
//! 2. then, until its time budget or case cap is spent, alternates between mutating an entry of
//!    the corpus (or an input a mutation made that the decoder accepted) — bit flips, bytes
//!    inserted, deleted, duplicated, truncation, splicing two entries, "interesting" integers
//!    (0, -1, `u32::MAX`, `u64::MAX`, ...) written over 1–8 bytes, dictionary tokens — and
//!    generating a structured input with the target's proptest strategies;
//! 3. runs each input under `catch_unwind`, with every allocation of the decoding thread
//!    watched: a panic, an `Err` of the check, an allocation larger than
//!    [`ALLOC_FACTOR`] × the input plus [`ALLOC_SLACK`] (an allocation sized by a length
//!    field instead of by the bytes that arrived), or an input that takes longer than
//!    [`LIVENESS_BOUND`] (a pathological blowup; several hundred times what any input takes)
//!    fails the test, with the input written to `target/fuzz-failures/` and printed in hex.
//!
//! Knobs (environment): `PDSERVE_FUZZ_SECS` (budget per target, default
//! [`DEFAULT_SECS`]; `0` replays the corpus only), `PDSERVE_FUZZ_CASES` (cap on inputs per
//! target, default [`DEFAULT_CASES`] unless `PDSERVE_FUZZ_SECS` is set, then none), `PDSERVE_FUZZ_SEED` (a number; default: fixed per
//! target, so a run is reproducible up to how far its budget lets it go; `random` picks one
//! from the clock). Each target prints one line, `FUZZ <target>: ...`, with the inputs it ran
//! (`--nocapture` shows it).

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use proptest::prelude::Rng;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// Default time budget per target, in seconds.
pub const DEFAULT_SECS: u64 = 10;
/// Default cap on the inputs of one target.
pub const DEFAULT_CASES: u64 = 2_000_000;
/// Largest input a mutation makes.
pub const MAX_INPUT: usize = 64 << 10;
/// An input may allocate at most this many times its own size in one allocation...
pub const ALLOC_FACTOR: usize = 64;
/// ...plus this much.
pub const ALLOC_SLACK: usize = 1 << 20;
/// No input may take longer than this to decode: a liveness bound against pathological
/// blowups (quadratic or exponential work), far above what any input takes on a loaded
/// machine (the slowest is printed in each target's line).
pub const LIVENESS_BOUND: Duration = Duration::from_secs(10);

/// The allocator of every fuzz test binary: the system's, plus a record of the largest single
/// allocation the current thread made while [`watch`] runs.
pub struct Watching;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call is passed to `System` unchanged; the thread-locals touched are `const`
// initialised `Cell`s without destructors, so recording never allocates or unwinds.
unsafe impl GlobalAlloc for Watching {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded as received.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded as received.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded as received.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Watching = Watching;

/// Runs `f`, returning its result and the largest single allocation it made on this thread.
pub fn watch<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    (out, LARGEST.with(Cell::get))
}

/// What the decoder made of an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Decoded into a value that passed every check.
    Accepted,
    /// Refused with a typed error.
    Rejected,
}

/// Counts of one target's run.
#[derive(Debug, Default)]
pub struct Report {
    /// Corpus entries replayed.
    pub corpus: u64,
    /// Mutated inputs.
    pub mutated: u64,
    /// Inputs generated by the strategies.
    pub generated: u64,
    /// Inputs the decoder accepted.
    pub accepted: u64,
    /// Wall time of the whole run.
    pub elapsed: Duration,
    /// The slowest input.
    pub slowest: Duration,
    /// The largest single allocation of any input.
    pub largest_alloc: usize,
}

impl Report {
    /// All inputs run.
    pub fn total(&self) -> u64 {
        self.corpus + self.mutated + self.generated
    }
}

/// The repository's root (every crate of the workspace is one level below it).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("a crate directory has a parent")
        .to_path_buf()
}

/// Where a target's corpus lives.
pub fn corpus_dir(target: &str) -> PathBuf {
    repo_root().join("fuzz").join("corpus").join(target)
}

/// Where failing inputs are written.
pub fn failures_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"))
        .join("fuzz-failures")
}

/// Rewrites the generated part of a target's corpus (files named `valid-*` and `hostile-*`;
/// `crash-*` regressions are kept). Called by each file's `#[ignore]`d `regenerate_corpus`.
pub fn write_corpus(target: &str, entries: &[(String, Vec<u8>)]) {
    let dir = corpus_dir(target);
    std::fs::create_dir_all(&dir).expect("create the corpus directory");
    for e in std::fs::read_dir(&dir).expect("read the corpus directory") {
        let path = e.expect("corpus entry").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with("valid-") || name.starts_with("hostile-") {
            std::fs::remove_file(&path).expect("remove an old corpus entry");
        }
    }
    for (name, bytes) in entries {
        assert!(
            name.starts_with("valid-") || name.starts_with("hostile-"),
            "generated entries are valid-* or hostile-*: {name}"
        );
        std::fs::write(dir.join(name), bytes).expect("write a corpus entry");
    }
    eprintln!("wrote {} entries to {}", entries.len(), dir.display());
}

fn load_corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("the corpus of {target} ({}): {e}", dir.display()))
        .map(|e| {
            let path = e.expect("corpus entry").path();
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let bytes = std::fs::read(&path).expect("read a corpus entry");
            (name, bytes)
        })
        .collect();
    out.sort();
    assert!(
        out.iter().any(|(n, _)| n.starts_with("valid-")),
        "the corpus of {target} ({}) has no valid-* entry: regenerate it with \
         `cargo test --release -p <crate> --test fuzz -- --ignored regenerate_corpus`",
        dir.display()
    );
    out
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn seed_for(target: &str) -> u64 {
    match std::env::var("PDSERVE_FUZZ_SEED") {
        Ok(v) if v.trim() == "random" => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PDSERVE_FUZZ_SEED={v:?} is neither a number nor `random`")),
        // FNV-1a of the target's name: fixed per target.
        Err(_) => target.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        }),
    }
}

/// A draw of `strategy`.
pub fn draw<S: Strategy>(runner: &mut TestRunner, strategy: S) -> S::Value {
    strategy
        .new_tree(runner)
        .expect("the fuzz strategies never reject")
        .current()
}

/// A value below `n` (`n` > 0).
pub fn below(rng: &mut TestRng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// One fuzz target.
pub struct Target<'a> {
    name: &'a str,
    dict: &'a [&'a [u8]],
    seed: Cell<u64>,
}

impl<'a> Target<'a> {
    /// The target `name` (its corpus is `fuzz/corpus/<name>/`).
    pub fn new(name: &'a str) -> Self {
        Self {
            name,
            dict: &[],
            seed: Cell::new(0),
        }
    }

    /// Tokens the mutator inserts or writes over (JSON punctuation, field names, ...).
    pub fn dictionary(mut self, dict: &'a [&'a [u8]]) -> Self {
        self.dict = dict;
        self
    }

    /// Runs the target: `check` decodes one input and checks what came out; `generate` makes
    /// a structured input from the strategies.
    ///
    /// # Panics
    /// On the first failing input (see the module docs), after saving and printing it.
    pub fn run(
        self,
        check: impl Fn(&[u8]) -> Result<Verdict, String>,
        mut generate: impl FnMut(&mut TestRunner) -> Vec<u8>,
    ) -> Report {
        let start = Instant::now();
        let budget = Duration::from_secs(env_u64("PDSERVE_FUZZ_SECS", DEFAULT_SECS));
        // A budget asked for explicitly is spent in full unless a cap is asked for too.
        let default_cap = match std::env::var_os("PDSERVE_FUZZ_SECS") {
            Some(_) => u64::MAX,
            None => DEFAULT_CASES,
        };
        let cap = env_u64("PDSERVE_FUZZ_CASES", default_cap);
        let seed = seed_for(self.name);
        self.seed.set(seed);
        let mut seed_bytes = [0u8; 32];
        seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
        let mut runner = TestRunner::new_with_rng(
            Config::default(),
            TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
        );
        let mut report = Report::default();
        let corpus = load_corpus(self.name);
        let mut pool: Vec<Vec<u8>> = Vec::new();
        for (name, bytes) in &corpus {
            let verdict = self.one(&check, bytes, &mut report, &format!("corpus entry {name}"));
            report.corpus += 1;
            if name.starts_with("valid-") && verdict != Verdict::Accepted {
                self.fail(
                    bytes,
                    &format!(
                        "corpus entry {name}, made by the encoder, is refused now: the format \
                         changed; regenerate the corpus with `cargo test --release -p <crate> \
                         --test fuzz -- --ignored regenerate_corpus`"
                    ),
                );
            }
            if bytes.len() <= MAX_INPUT {
                pool.push(bytes.clone());
            }
        }
        let seeds = pool.len();
        while start.elapsed() < budget && report.total() < cap {
            let (input, what) = if below(runner.rng(), 3) == 0 {
                report.generated += 1;
                (generate(&mut runner), "generated input")
            } else {
                report.mutated += 1;
                let rng = runner.rng();
                let mut input = pool[below(rng, pool.len())].clone();
                let other = pool[below(rng, pool.len())].clone();
                mutate(rng, &mut input, &other, self.dict);
                (input, "mutated input")
            };
            if self.one(&check, &input, &mut report, what) == Verdict::Accepted {
                // Accepted mutants are kept as seeds (a crude stand-in for coverage feedback),
                // in a bounded pool that never drops the corpus itself.
                if pool.len() < seeds + 512 {
                    pool.push(input);
                } else {
                    let at = seeds + below(runner.rng(), 512);
                    pool[at] = input;
                }
            }
        }
        report.elapsed = start.elapsed();
        eprintln!(
            "FUZZ {}: {} inputs in {:.1} s ({} corpus, {} mutated, {} generated; {} accepted), \
             seed {seed}, slowest input {:.1} ms, largest allocation {} bytes",
            self.name,
            report.total(),
            report.elapsed.as_secs_f64(),
            report.corpus,
            report.mutated,
            report.generated,
            report.accepted,
            report.slowest.as_secs_f64() * 1e3,
            report.largest_alloc,
        );
        report
    }

    fn one(
        &self,
        check: &impl Fn(&[u8]) -> Result<Verdict, String>,
        input: &[u8],
        report: &mut Report,
        what: &str,
    ) -> Verdict {
        let t = Instant::now();
        let (outcome, largest) = watch(|| catch_unwind(AssertUnwindSafe(|| check(input))));
        let took = t.elapsed();
        report.slowest = report.slowest.max(took);
        report.largest_alloc = report.largest_alloc.max(largest);
        let verdict = match outcome {
            Ok(Ok(v)) => v,
            Ok(Err(msg)) => self.fail(input, &format!("{what}: {msg}")),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                self.fail(input, &format!("{what}: the decoder panicked: {msg}"))
            }
        };
        let allowed = input.len().saturating_mul(ALLOC_FACTOR) + ALLOC_SLACK;
        if largest > allowed {
            self.fail(
                input,
                &format!(
                    "{what}: one allocation of {largest} bytes for an input of {} bytes \
                     (allowed: {allowed})",
                    input.len()
                ),
            );
        }
        if took > LIVENESS_BOUND {
            self.fail(
                input,
                &format!("{what}: took {took:?} (bound {LIVENESS_BOUND:?})"),
            );
        }
        if verdict == Verdict::Accepted {
            report.accepted += 1;
        }
        verdict
    }

    fn fail(&self, input: &[u8], why: &str) -> ! {
        let dir = failures_dir();
        let hash = input.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        let path = dir.join(format!("{}-{hash:016x}.bin", self.name));
        let saved = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&path, input))
            .map_or_else(
                |e| format!("(not saved: {e})"),
                |()| path.display().to_string(),
            );
        let shown = &input[..input.len().min(4096)];
        let hex: String = shown.iter().map(|b| format!("{b:02x}")).collect();
        panic!(
            "fuzz target {} failed (PDSERVE_FUZZ_SEED={}): {why}\ninput ({} bytes) saved to \
             {saved}; keep it as a regression: copy it to fuzz/corpus/{}/crash-<what>.bin\n\
             hex{}: {hex}",
            self.name,
            self.seed.get(),
            input.len(),
            self.name,
            if shown.len() < input.len() {
                " (first 4096 bytes)"
            } else {
                ""
            },
        );
    }
}

const INTERESTING: [u64; 14] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
];

/// Applies 1 to 4 random mutations to `data` (`other`: a second entry to splice with).
pub fn mutate(rng: &mut TestRng, data: &mut Vec<u8>, other: &[u8], dict: &[&[u8]]) {
    let n = 1 + below(rng, 4);
    for _ in 0..n {
        let len = data.len();
        match below(rng, 11) {
            0 if len > 0 => {
                let at = below(rng, len);
                data[at] ^= 1 << below(rng, 8);
            }
            1 if len > 0 => {
                let at = below(rng, len);
                data[at] = rng.next_u64() as u8;
            }
            2 => {
                let at = below(rng, len + 1);
                let k = 1 + below(rng, 16);
                let bytes: Vec<u8> = (0..k).map(|_| rng.next_u64() as u8).collect();
                data.splice(at..at, bytes);
            }
            3 if len > 0 => {
                let at = below(rng, len);
                let k = 1 + below(rng, (len - at).min(64));
                data.drain(at..at + k);
            }
            4 => data.truncate(below(rng, len + 1)),
            5 if len > 0 => {
                // An interesting integer over 1, 2, 4 or 8 bytes, little or big endian.
                let width = [1, 2, 4, 8][below(rng, 4)];
                let v = INTERESTING[below(rng, INTERESTING.len())];
                let bytes = if rng.next_u64() & 1 == 0 {
                    v.to_le_bytes()
                } else {
                    (v << (64 - 8 * width as u32)).to_be_bytes()
                };
                let at = below(rng, len);
                let end = (at + width).min(len);
                data[at..end].copy_from_slice(&bytes[..end - at]);
            }
            6 => {
                let a = below(rng, len + 1);
                let b = below(rng, other.len() + 1);
                data.truncate(a);
                data.extend_from_slice(&other[b..]);
            }
            7 if len > 0 => {
                let from = below(rng, len);
                let k = 1 + below(rng, (len - from).min(256));
                let chunk = data[from..from + k].to_vec();
                let at = below(rng, len + 1);
                data.splice(at..at, chunk);
            }
            8 if !dict.is_empty() => {
                let token = dict[below(rng, dict.len())];
                let at = below(rng, len + 1);
                if rng.next_u64() & 1 == 0 {
                    data.splice(at..at, token.iter().copied());
                } else {
                    let end = (at + token.len()).min(len);
                    data.splice(at..end, token.iter().copied());
                }
            }
            9 if len > 0 => {
                let at = below(rng, len);
                let delta = 1 + below(rng, 35) as u8;
                data[at] = if rng.next_u64() & 1 == 0 {
                    data[at].wrapping_add(delta)
                } else {
                    data[at].wrapping_sub(delta)
                };
            }
            _ => {
                // A byte range swapped with the same range of `other`.
                if len > 0 && !other.is_empty() {
                    let at = below(rng, len.min(other.len()));
                    let k = 1 + below(rng, (len.min(other.len()) - at).min(64));
                    data[at..at + k].copy_from_slice(&other[at..at + k]);
                }
            }
        }
    }
    data.truncate(MAX_INPUT);
}

/// Hex of `bytes`, for messages.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// JSON tokens the mutator splices into JSON inputs: syntax, numbers at the edges of the
/// integer types, bad escapes and bytes, and the OpenAI/P-D field names.
pub const JSON_TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b",",
    b":",
    b"null",
    b"true",
    b"false",
    b"-1",
    b"0",
    b"1e999",
    b"-0.0",
    b"2.5",
    b"18446744073709551615",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"4294967296",
    b"4294967297",
    b"\\u0000",
    b"\\ud800",
    b"\xff\xfe",
    b"\"prompt\":",
    b"\"messages\":",
    b"\"max_tokens\":",
    b"\"top_k\":",
    b"\"stop\":",
    b"\"kv_transfer_params\":",
    b"\"do_remote_prefill\":true",
    b"\"remote_block_ids\":",
    b"\"remote_host\":",
    b"\"remote_port\":",
    b"\"transfer_id\":",
];
