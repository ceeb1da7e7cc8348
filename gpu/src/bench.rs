//! The model benchmark behind `pdserve bench model` and `benches/model.rs`: prefill tokens/s
//! at 128 and 512 prompt tokens, decode tokens/s at batch 1 and 8, driven straight through a
//! [`StepGroup`] (the CPU `TpGroup` or a GPU group) so only the model is measured.

use crate::engine::StepGroup;
use crate::model::{Batch, SeqChunk};
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
}

/// Settings of a run.
#[derive(Clone, Debug)]
pub struct ModelBenchOptions {
    /// Timed repetitions of each prefill (the median is reported).
    pub prefill_reps: usize,
    /// Decode steps timed per batch size.
    pub decode_steps: usize,
}

impl Default for ModelBenchOptions {
    fn default() -> Self {
        Self {
            prefill_reps: 3,
            decode_steps: 64,
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

/// Decode tokens/s summed over `n` sequences stepped together for `steps` greedy steps from
/// one token each (needs `n * blocks_for(steps + 2)` blocks, used from 0).
///
/// # Errors
/// Forward-pass failures.
pub fn decode_tps(group: &impl StepGroup, n: usize, steps: usize) -> Result<f64> {
    let bs = group.block_size();
    let vocab = group.config().vocab_size;
    let steps = steps.max(1);
    let per_seq = (1 + steps + 1).div_ceil(bs);
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
                })
                .collect(),
        };
        let logits = group.step(batch)?;
        for (s, l) in logits.iter().enumerate() {
            last[s] = crate::sampling::argmax(l);
        }
        Ok(())
    };
    run_step(0, &mut last)?;
    let t = Instant::now();
    for pos in 1..=steps {
        run_step(pos, &mut last)?;
    }
    Ok((n * steps) as f64 / t.elapsed().as_secs_f64())
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
    })
}
