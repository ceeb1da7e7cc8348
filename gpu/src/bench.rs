//! The model benchmark behind `pdserve bench model` and `benches/model.rs`: prefill tokens/s
//! at 128 and 512 prompt tokens and of long prompts in 512-token chunks, decode tokens/s at
//! batch 1 and 8 and at batch 1 over a long context, driven straight through a
//! [`StepGroup`] (the CPU `TpGroup` or a GPU group) so only the model is measured.
//!
//! [`run_contention_bench`] (`pdserve bench model --busy N`) measures how decode holds up when
//! the cores are shared: per-token decode time with the machine otherwise idle, and with `N`
//! busy-loop child processes ([`BusyLoops`], `nice 19` by default) competing for the CPUs.

use crate::batch::{Batch, SeqChunk};
use crate::engine::StepGroup;
use crate::Result;
use serde::Serialize;
use std::time::{Duration, Instant};

/// One run's figures (the JSON `pdserve bench model --json` prints).
#[derive(Clone, Debug, Serialize)]
pub struct ModelBenchResult {
    /// Model name.
    pub model: String,
    /// Compute threads.
    pub threads: usize,
    /// Prefill tokens/s, 128-token prompt.
    pub prefill_tps_128: f64,
    /// Prefill tokens/s, 512-token prompt.
    pub prefill_tps_512: f64,
    /// Decode tokens/s, one sequence.
    pub decode_tps_b1: f64,
    /// Decode tokens/s summed over 8 sequences.
    pub decode_tps_b8: f64,
    /// Decode tokens/s of one sequence over a cache already holding some context: attention
    /// over a long KV, which the short-context figures above hardly show.
    pub decode_b1_at_context: Vec<ContextDecode>,
    /// Prefill tokens/s of long prompts, fed in chunks as the scheduler cuts them: attention
    /// over the chunks before, which the 128- and 512-token figures hardly show.
    pub prefill_long: Vec<LongPrefill>,
}

/// Prefill speed of one long prompt.
#[derive(Clone, Debug, Serialize)]
pub struct LongPrefill {
    /// Prompt tokens (clamped to the model's context).
    pub tokens: usize,
    /// Tokens per step.
    pub chunk: usize,
    /// Prefill tokens/s (all chunks).
    pub tps: f64,
}

/// Batch-1 decode speed at one context length.
#[derive(Clone, Debug, Serialize)]
pub struct ContextDecode {
    /// Tokens in the cache when the timed steps start.
    pub context: usize,
    /// Decode tokens/s.
    pub tps: f64,
}

/// Settings of a run.
#[derive(Clone, Debug)]
pub struct ModelBenchOptions {
    /// Timed repetitions of each prefill (the median is reported).
    pub prefill_reps: usize,
    /// Decode steps timed per batch size.
    pub decode_steps: usize,
    /// Context lengths of the batch-1 decode runs at context (each clamped so that the run
    /// fits the model's context).
    pub contexts: Vec<usize>,
    /// Lengths of the long prompts prefilled in [`LONG_PREFILL_CHUNK`]-token chunks.
    pub long_prompts: Vec<usize>,
}

/// Tokens per step of the long-prompt prefills: the scheduler's default step budget
/// (`scheduler.max_num_batched_tokens`).
pub const LONG_PREFILL_CHUNK: usize = 512;

impl Default for ModelBenchOptions {
    fn default() -> Self {
        Self {
            prefill_reps: 3,
            decode_steps: 64,
            contexts: vec![512, 2048, 8192],
            long_prompts: vec![2048],
        }
    }
}

fn prompt(len: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as u32)
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Prefill tokens/s of one `len`-token prompt on `group` (blocks from 0; the median of
/// `reps` timed runs after a warm-up).
///
/// # Errors
/// Forward-pass failures.
pub fn prefill_tps(group: &impl StepGroup, len: usize, reps: usize) -> Result<f64> {
    let bs = group.block_size();
    let vocab = group.config().vocab_size;
    let blocks: Vec<u32> = (0..len.div_ceil(bs) as u32).collect();
    let batch = Batch {
        seqs: vec![SeqChunk {
            tokens: prompt(len, vocab, 0),
            start_pos: 0,
            block_table: blocks,
            want_logits: true,
            all_logits: false,
            embeds: Vec::new(),
        }],
    };
    group.step(batch.clone())?; // warm-up (also packs weights on first use)
    let mut times = Vec::new();
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        group.step(batch.clone())?;
        times.push(t.elapsed());
    }
    Ok(len as f64 / median(times).as_secs_f64())
}

/// Prefill tokens/s of one `len`-token prompt fed `chunk` tokens per step (blocks from 0; the
/// median of `reps` timed runs, each the whole prompt).
///
/// # Errors
/// Forward-pass failures.
pub fn chunked_prefill_tps(
    group: &impl StepGroup,
    len: usize,
    chunk: usize,
    reps: usize,
) -> Result<f64> {
    let bs = group.block_size();
    let vocab = group.config().vocab_size;
    let table: Vec<u32> = (0..len.div_ceil(bs) as u32).collect();
    let tokens = prompt(len, vocab, 3);
    let mut times = Vec::new();
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        prefill_in_chunks(group, &tokens, std::slice::from_ref(&table), chunk, true)?;
        times.push(t.elapsed());
    }
    Ok(len as f64 / median(times).as_secs_f64())
}

/// Prefills `tokens` from position 0 into each of `tables` (one sequence per table, stepped
/// together), `chunk` tokens per step as the scheduler feeds long prompts; with `last_logits`,
/// the final chunk asks for its last token's logits.
fn prefill_in_chunks(
    group: &impl StepGroup,
    tokens: &[u32],
    tables: &[Vec<u32>],
    chunk: usize,
    last_logits: bool,
) -> Result<()> {
    let chunk = chunk.max(1);
    for (k, c) in tokens.chunks(chunk).enumerate() {
        let last = (k + 1) * chunk >= tokens.len();
        group.step(Batch {
            seqs: tables
                .iter()
                .map(|table| SeqChunk {
                    tokens: c.to_vec(),
                    start_pos: k * chunk,
                    block_table: table.clone(),
                    want_logits: last_logits && last,
                    all_logits: false,
                    embeds: Vec::new(),
                })
                .collect(),
        })?;
    }
    Ok(())
}

/// Decode tokens/s summed over `n` sequences stepped together for `steps` greedy steps from
/// one token each (needs `n * blocks_for(steps + 2)` blocks, used from 0).
///
/// # Errors
/// Forward-pass failures.
pub fn decode_tps(group: &impl StepGroup, n: usize, steps: usize) -> Result<f64> {
    let times = decode_step_times(group, n, steps)?;
    let total: Duration = times.iter().sum();
    Ok((n * times.len()) as f64 / total.as_secs_f64())
}

/// The time of each of `steps` greedy decode steps of `n` sequences stepped together (after
/// one untimed step), as [`decode_tps`] runs them.
///
/// # Errors
/// Forward-pass failures.
pub fn decode_step_times(group: &impl StepGroup, n: usize, steps: usize) -> Result<Vec<Duration>> {
    decode_step_times_at(group, n, steps, 0)
}

/// As [`decode_step_times`], with each sequence's cache first holding `context` tokens
/// (prefilled in untimed chunks of [`LONG_PREFILL_CHUNK`]; needs `n * blocks_for(context + steps + 2)` blocks).
///
/// # Errors
/// Forward-pass failures.
pub fn decode_step_times_at(
    group: &impl StepGroup,
    n: usize,
    steps: usize,
    context: usize,
) -> Result<Vec<Duration>> {
    let bs = group.block_size();
    let vocab = group.config().vocab_size;
    let steps = steps.max(1);
    let per_seq = (context + 1 + steps + 1).div_ceil(bs);
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let mut last: Vec<u32> = (0..n).map(|s| prompt(1, vocab, s + 1)[0]).collect();
    let run_step = |pos: usize, last: &mut Vec<u32>| -> Result<()> {
        let batch = Batch {
            seqs: (0..n)
                .map(|s| SeqChunk {
                    tokens: vec![last[s]],
                    start_pos: pos,
                    block_table: tables[s].clone(),
                    want_logits: true,
                    all_logits: false,
                    embeds: Vec::new(),
                })
                .collect(),
        };
        let logits = group.step(batch)?;
        for (s, l) in logits.iter().enumerate() {
            last[s] = crate::sampling::argmax(l);
        }
        Ok(())
    };
    let context_of = prompt(context, vocab, 7);
    prefill_in_chunks(group, &context_of, &tables, LONG_PREFILL_CHUNK, false)?;
    run_step(context, &mut last)?;
    let mut times = Vec::with_capacity(steps);
    for pos in context + 1..=context + steps {
        let t = Instant::now();
        run_step(pos, &mut last)?;
        times.push(t.elapsed());
    }
    Ok(times)
}

/// Measures `group` (which needs at least `8 * blocks_for(1 + decode_steps) + blocks_for(512)`
/// free blocks; block ids are used directly, so run it on an idle group).
///
/// # Errors
/// Forward-pass failures.
pub fn run_model_bench(
    group: &impl StepGroup,
    model: &str,
    threads: usize,
    opts: &ModelBenchOptions,
) -> Result<ModelBenchResult> {
    Ok(ModelBenchResult {
        model: model.to_string(),
        threads,
        prefill_tps_128: prefill_tps(group, 128, opts.prefill_reps)?,
        prefill_tps_512: prefill_tps(group, 512, opts.prefill_reps)?,
        decode_tps_b1: decode_tps(group, 1, opts.decode_steps)?,
        decode_tps_b8: decode_tps(group, 8, opts.decode_steps)?,
        decode_b1_at_context: opts
            .contexts
            .iter()
            .map(|&c| {
                let steps = opts.decode_steps.max(1);
                let context = c.min(group.config().context_length.saturating_sub(steps + 2));
                let times = decode_step_times_at(group, 1, steps, context)?;
                let total: Duration = times.iter().sum();
                Ok(ContextDecode {
                    context,
                    tps: times.len() as f64 / total.as_secs_f64(),
                })
            })
            .collect::<Result<_>>()?,
        prefill_long: opts
            .long_prompts
            .iter()
            .map(|&n| {
                let tokens = n.min(group.config().context_length);
                Ok(LongPrefill {
                    tokens,
                    chunk: LONG_PREFILL_CHUNK,
                    tps: chunked_prefill_tps(group, tokens, LONG_PREFILL_CHUNK, opts.prefill_reps)?,
                })
            })
            .collect::<Result<_>>()?,
    })
}

/// Busy-loop child processes (`sh -c 'while :; do :; done'`) at a given niceness, the
/// neighbours of [`run_contention_bench`]. They are killed when this is dropped (every return
/// and unwinding path), and the kernel kills them if this process dies first
/// (`PR_SET_PDEATHSIG`), so none outlives the benchmark.
#[derive(Debug)]
pub struct BusyLoops {
    children: Vec<std::process::Child>,
}

impl BusyLoops {
    /// Starts `n` busy loops at niceness `nice` (19: the lowest priority).
    ///
    /// # Errors
    /// When a child cannot be started (those already started are killed).
    pub fn start(n: usize, nice: i32) -> std::io::Result<Self> {
        use std::os::unix::process::CommandExt;
        let mut loops = Self {
            children: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let mut cmd = std::process::Command::new("sh");
            cmd.args(["-c", "while :; do :; done"])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                        || libc::setpriority(libc::PRIO_PROCESS, 0, nice) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            loops.children.push(cmd.spawn()?);
        }
        Ok(loops)
    }

    /// The children's process ids.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(std::process::Child::id).collect()
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Decode per-token times with the CPUs to ourselves and with busy neighbours (the JSON
/// `pdserve bench model --busy N --json` adds as `contention`).
#[derive(Clone, Debug, Serialize)]
pub struct ContentionResult {
    /// Busy-loop processes running during the busy rounds.
    pub busy: usize,
    /// Their niceness.
    pub nice: i32,
    /// Sequences decoded together.
    pub batch: usize,
    /// Timed steps per condition (over all rounds).
    pub steps: usize,
    /// Per-step time, median, no busy loops (ms).
    pub idle_ms_p50: f64,
    /// Per-step time, 90th percentile, no busy loops (ms).
    pub idle_ms_p90: f64,
    /// Per-step time, median, with the busy loops (ms).
    pub busy_ms_p50: f64,
    /// Per-step time, 90th percentile, with the busy loops (ms).
    pub busy_ms_p90: f64,
    /// `busy_ms_p50 / idle_ms_p50`.
    pub slowdown_p50: f64,
}

fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// Alternates `rounds` rounds of `steps` decode steps of `batch` sequences without and with
/// `busy` [`BusyLoops`] at niceness `nice` (started before and killed after each busy round,
/// with a 100 ms settle), and reports each condition's per-step time over all its rounds.
/// Alternating keeps slow drifts of a shared machine out of the ratio.
///
/// # Errors
/// Forward-pass failures; a busy loop that cannot be started.
pub fn run_contention_bench(
    group: &impl StepGroup,
    batch: usize,
    steps: usize,
    rounds: usize,
    busy: usize,
    nice: i32,
) -> Result<ContentionResult> {
    let (mut idle, mut loaded) = (Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        idle.extend(decode_step_times(group, batch, steps)?);
        let loops = BusyLoops::start(busy, nice)?;
        std::thread::sleep(Duration::from_millis(100));
        let r = decode_step_times(group, batch, steps);
        drop(loops);
        loaded.extend(r?);
    }
    idle.sort();
    loaded.sort();
    let (idle_ms_p50, busy_ms_p50) = (percentile_ms(&idle, 0.5), percentile_ms(&loaded, 0.5));
    Ok(ContentionResult {
        busy,
        nice,
        batch,
        steps: idle.len(),
        idle_ms_p50,
        idle_ms_p90: percentile_ms(&idle, 0.9),
        busy_ms_p50,
        busy_ms_p90: percentile_ms(&loaded, 0.9),
        slowdown_p50: busy_ms_p50 / idle_ms_p50,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(pid: u32) -> bool {
        // A killed and reaped child's id no longer names a process (or names a reused one,
        // which is not a busy `sh` of ours: good enough within a test's lifetime).
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
    }

    #[test]
    fn busy_loops_run_niced_and_die_with_their_guard() {
        let pids = {
            let loops = BusyLoops::start(2, 19).unwrap();
            let pids = loops.pids();
            for &p in &pids {
                assert!(alive(p));
                let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap();
                // Field 19 is the nice value (counted after the `(comm)` field).
                let after = stat.rsplit_once(") ").unwrap().1;
                let nice: i32 = after.split(' ').nth(16).unwrap().parse().unwrap();
                assert_eq!(nice, 19);
            }
            pids
        };
        for p in pids {
            assert!(!alive(p), "busy loop {p} outlived its guard");
        }
        // Also on unwinding.
        let mut seen = Vec::new();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let loops = BusyLoops::start(1, 19).unwrap();
            seen = loops.pids();
            panic!("bench failed");
        }));
        assert!(r.is_err());
        assert!(seen.iter().all(|&p| !alive(p)));
    }
}
