//! Criterion benchmark of the CPU paged attention (`pdserve_gpu::attention`) at the default
//! model's shape (9 query heads, 3 KV heads of 64, blocks of 16): a 512-token prefill chunk
//! after 1536 and after 3584 tokens of context (the last chunk of a 2048- and a 4096-token
//! prompt, as the scheduler cuts it), and one decode token at 2048 tokens of context, with an
//! f32 and an f16 cache. Time one thread with `CANDLE_NUM_THREADS=1 cargo bench --bench
//! attention`; the figures per (query row, position) are in docs/benchmarks.md.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pdserve_gpu::attention::attention;
use pdserve_gpu::batch::{Batch, SeqChunk};
use pdserve_gpu::kv::{KvCache, KvDtype, KvKind, KvLayout};
use pdserve_runtime::memory::AnonAllocator;

const NH: usize = 9;
const NKV: usize = 3;
const HD: usize = 64;
const BS: usize = 16;

/// Pseudo-random values in [-1, 1).
fn value(i: usize) -> f32 {
    ((i.wrapping_mul(2_654_435_761) >> 7) % 2001) as f32 / 1000.0 - 1.0
}

fn cache(dtype: KvDtype, ctx: usize) -> KvCache {
    let layout = KvLayout {
        num_layers: 1,
        num_blocks: ctx.div_ceil(BS),
        block_size: BS,
        num_kv_heads: NKV,
        head_dim: HD,
        dtype,
    };
    let mut kv = KvCache::new(layout, &AnonAllocator).unwrap();
    let mut row = vec![0f32; HD];
    for p in 0..ctx {
        for g in 0..NKV {
            for (kind, salt) in [(KvKind::Key, 1), (KvKind::Value, 2)] {
                row.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = value(((p * NKV + g) * 3 + salt) * HD + i));
                kv.write_slot(0, kind, p / BS, g, p % BS, &row);
            }
        }
    }
    kv
}

fn attention_bench(c: &mut Criterion) {
    let qkv_w = (NH + 2 * NKV) * HD;
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut g = c.benchmark_group(format!("attention {dtype:?} KV"));
        g.sample_size(10)
            .warm_up_time(std::time::Duration::from_millis(300))
            .measurement_time(std::time::Duration::from_secs(3));
        for (name, tokens, start) in [
            ("prefill 512 after", 512, 1536),
            ("prefill 512 after", 512, 3584),
            ("decode 1 after", 1, 2048),
        ] {
            let ctx = start + tokens;
            let kv = cache(dtype, ctx);
            let qkv: Vec<f32> = (0..tokens * qkv_w).map(|i| 2.0 * value(i + 7)).collect();
            let batch = Batch {
                seqs: vec![SeqChunk {
                    tokens: vec![0; tokens],
                    start_pos: start,
                    block_table: (0..ctx.div_ceil(BS) as u32).collect(),
                    want_logits: false,
                    all_logits: false,
                    embeds: Vec::new(),
                }],
            };
            // (query row, position) pairs a causal attention computes.
            let pairs = NH * (tokens * start + tokens * (tokens + 1) / 2);
            g.throughput(Throughput::Elements(pairs as u64));
            g.bench_function(BenchmarkId::new(name, start), |b| {
                b.iter(|| attention(0, &batch, &[0], &qkv, qkv_w, NH, NKV, HD, &kv))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, attention_bench);
criterion_main!(benches);
