//! Decode's weight stream without the rest of the model: the GEMVs of one decode step of the
//! default model's geometry (30 layers of Q4_1 Q, K, V, O, gate, up, down and the Q8_0 output
//! layer; random weights, 96 MB), timed per step, with the bytes streamed per second. For
//! tuning the single-token kernel and its prefetching apart from attention and scheduling.
//! Threads: `RAYON_NUM_THREADS`. `LAYERS` (default 30) shrinks the set, e.g. to fit in cache;
//! `TOKENS` (default 1) runs every matmul on that many token rows (prefill-shaped; the GB/s
//! figure then counts the weights once per step).
//!
//! `cargo run --release -p pdserve-gpu --example gemv_stream -- [steps]`

use pdserve_gpu::quant::{matmul, QMatrix, QType};
use std::time::Instant;

/// A `rows × cols` matrix in GGUF's block layout with xorshift bytes and small scales.
fn random_matrix(qt: QType, rows: usize, cols: usize, state: &mut u32) -> QMatrix {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 17;
        *state ^= *state << 5;
        *state
    };
    let mut bytes = Vec::with_capacity(rows * cols / qt.block_elems() * qt.block_bytes());
    if qt == QType::Q4K {
        // Random bytes but for the super-block's f16 scale and minimum scale.
        for _ in 0..rows * cols / 256 {
            let at = bytes.len();
            bytes.extend((0..qt.block_bytes()).map(|_| next() as u8));
            let d = half::f16::from_f32((next() % 1000) as f32 / 500_000.0 + 1e-5);
            let dmin = half::f16::from_f32((next() % 1000) as f32 / 1_000_000.0);
            bytes[at..at + 2].copy_from_slice(&d.to_le_bytes());
            bytes[at + 2..at + 4].copy_from_slice(&dmin.to_le_bytes());
        }
        return QMatrix::from_gguf(qt, rows, cols, &bytes).expect("whole super-blocks");
    }
    for _ in 0..rows * cols / 32 {
        let d = half::f16::from_f32((next() % 1000) as f32 / 50_000.0 + 1e-4);
        bytes.extend_from_slice(&d.to_le_bytes());
        if qt == QType::Q4_1 {
            let m = half::f16::from_f32(-((next() % 1000) as f32) / 20_000.0);
            bytes.extend_from_slice(&m.to_le_bytes());
        }
        bytes.extend((0..qt.quant_bytes()).map(|_| next() as u8));
    }
    QMatrix::from_gguf(qt, rows, cols, &bytes).expect("whole blocks")
}

/// CPU time of the whole process (every compute thread), seconds.
fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("steps"))
        .unwrap_or(100);
    let layers: usize = std::env::var("LAYERS")
        .map(|v| v.parse().expect("LAYERS"))
        .unwrap_or(30);
    // `QTYPE=q4k`: TinyLlama-1.1B's geometry (hidden 2048, 4 KV heads of 64, FFN 5632) in
    // Q4_K, no output layer — the default model's 576 columns are no whole super-blocks.
    let k_quant = std::env::var("QTYPE").is_ok_and(|v| v == "q4k");
    // SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, FFN 1536, vocabulary 49152.
    let shapes = if k_quant {
        vec![
            (2048, 2048),
            (256, 2048),
            (256, 2048),
            (2048, 2048),
            (5632, 2048),
            (5632, 2048),
            (2048, 5632),
        ]
    } else {
        vec![
            (576, 576),
            (192, 576),
            (192, 576),
            (576, 576),
            (1536, 576),
            (1536, 576),
            (576, 1536),
        ]
    };
    let mut state = 12345u32;
    let qt = if k_quant { QType::Q4K } else { QType::Q4_1 };
    let mut weights: Vec<QMatrix> = (0..layers)
        .flat_map(|_| shapes.iter().copied())
        .map(|(r, c)| random_matrix(qt, r, c, &mut state))
        .collect();
    if !k_quant {
        weights.push(random_matrix(QType::Q8_0, 49152, 576, &mut state));
    }
    let bytes: usize = weights.iter().map(|w| w.bytes()).sum();
    let input = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 30.0)
            .collect()
    };
    let tokens: usize = std::env::var("TOKENS")
        .map(|v| v.parse().expect("TOKENS"))
        .unwrap_or(1);
    let inputs: std::collections::HashMap<usize, Vec<f32>> = weights
        .iter()
        .map(|w| (w.cols(), input(w.cols() * tokens)))
        .collect();
    let step = || {
        let mut sum = 0f32;
        for w in &weights {
            let x = &inputs[&w.cols()];
            sum += matmul(w, x, tokens)[0];
        }
        sum
    };
    let first = step();
    println!(
        "{} matrices, {:.1} MB of weights",
        weights.len(),
        bytes as f64 / 1e6
    );
    for round in 1..=3 {
        let (cpu0, wall0) = (process_cpu_seconds(), Instant::now());
        for _ in 0..steps {
            // The same inputs give the same bits every step.
            assert_eq!(step().to_bits(), first.to_bits());
        }
        let wall = wall0.elapsed().as_secs_f64() / steps as f64;
        let cpu = (process_cpu_seconds() - cpu0) / steps as f64;
        println!(
            "round {round}: {:.3} ms/step wall ({:.1} GB/s), {:.3} ms/step CPU",
            wall * 1e3,
            bytes as f64 / wall / 1e9,
            cpu * 1e3
        );
    }
}
