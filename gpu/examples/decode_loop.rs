//! Decode-only loop for profiling (`perf record`): the default model, `--weights native`,
//! batch-1 decode of 128 steps repeated for N seconds (first argument, default 5), after a
//! measurement of this machine's DRAM read bandwidth with 1 and 2 threads — what a decode step,
//! which streams every weight once, is bounded by. Threads: `RAYON_NUM_THREADS`.
//!
//! With `PREFILL=N` it times N-token prefills instead (one per round, the DRAM figures
//! skipped) and ends with the best and the median round: on a shared VM the best of many
//! rounds is the steadier figure to compare two builds by.
//!
//! `cargo run --release -p pdserve-gpu --example decode_loop -- 10`

use pdserve_gpu::engine::{Engine, EngineOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_gpu::weights::WeightFormat;
use std::time::Instant;

/// GB/s of summing `buf` (well above the L3) split over `threads` threads, best of 5.
fn read_bandwidth(buf: &[u64], threads: usize) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for part in buf.chunks(buf.len().div_ceil(threads)) {
                s.spawn(move || {
                    std::hint::black_box(part.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
                });
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (buf.len() * 8) as f64 / best / 1e9
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("seconds"))
        .unwrap_or(5.0);
    let prefill: Option<usize> = std::env::var("PREFILL")
        .ok()
        .map(|s| s.parse().expect("PREFILL: a token count"));
    if prefill.is_none() {
        let buf: Vec<u64> = (0..(512u64 << 20) / 8).collect();
        for threads in [1, 2] {
            println!(
                "DRAM read, {threads} thread(s): {:.1} GB/s",
                read_bandwidth(&buf, threads)
            );
        }
    }
    let model = load_model(&ModelSource::Default).expect("default model (pdserve model pull)");
    let engine = Engine::new(
        model,
        EngineOptions {
            num_blocks: Some(64),
            format: WeightFormat::Native,
            ..Default::default()
        },
    )
    .expect("engine");
    let t = Instant::now();
    let mut all = Vec::new();
    while t.elapsed().as_secs_f64() < secs {
        let tps = match prefill {
            Some(n) => pdserve_gpu::bench::prefill_tps(engine.group(), n, 1).expect("prefill"),
            None => pdserve_gpu::bench::decode_tps(engine.group(), 1, 128).expect("decode"),
        };
        all.push(tps);
        println!("round {}: {tps:.1} tokens/s", all.len());
    }
    all.sort_by(f64::total_cmp);
    println!(
        "best {:.1}, median {:.1} tokens/s over {} rounds",
        all[all.len() - 1],
        all[all.len() / 2],
        all.len()
    );
}
