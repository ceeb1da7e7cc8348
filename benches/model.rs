//! Criterion benchmark of the forward pass on the default model: one prefill step of 128 and
//! 512 tokens, one decode step at batch 1 and 8. `pdserve bench model` reports the same
//! quantities as tokens/s; this gives criterion's statistics for regressions.
//! Threads: set `RAYON_NUM_THREADS`/`CANDLE_NUM_THREADS` (default: all cores).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pdserve_gpu::engine::{Engine, EngineOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use pdserve_gpu::model::{Batch, SeqChunk};

fn batch(seqs: usize, len: usize, start: usize, blocks_per_seq: usize) -> Batch {
    Batch {
        seqs: (0..seqs)
            .map(|s| SeqChunk {
                tokens: (0..len)
                    .map(|i| ((i * 7919 + s * 131 + 13) % 49_152) as u32)
                    .collect(),
                start_pos: start,
                block_table: ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32)
                    .collect(),
                want_logits: true,
                all_logits: false,
                embeds: Vec::new(),
            })
            .collect(),
    }
}

fn model(c: &mut Criterion) {
    let model = load_model(&ModelSource::Default).expect("default model (pdserve model pull)");
    let engine = Engine::new(
        model,
        EngineOptions {
            num_blocks: Some(8 * 40),
            ..Default::default()
        },
    )
    .unwrap();
    let group = engine.group();
    let mut g = c.benchmark_group("model");
    g.sample_size(10);
    for len in [128usize, 512] {
        g.throughput(Throughput::Elements(len as u64));
        let b = batch(1, len, 0, 40);
        g.bench_function(format!("prefill_{len}"), |bench| {
            bench.iter(|| group.step(b.clone()).unwrap())
        });
    }
    for seqs in [1usize, 8] {
        // Fill 128 positions of context first, then time single-token steps at position 128.
        group.step(batch(seqs, 128, 0, 40)).unwrap();
        g.throughput(Throughput::Elements(seqs as u64));
        let b = batch(seqs, 1, 128, 40);
        g.bench_function(format!("decode_b{seqs}"), |bench| {
            bench.iter(|| group.step(b.clone()).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, model);
criterion_main!(benches);
