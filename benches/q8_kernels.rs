//! Criterion benchmark of the default weights' Q8_0 matmuls at the default model's shapes:
//! this crate's llama.cpp-exact kernel ([`QMatrix`]), its sixteen-row packed kernel
//! ([`PackedQ8`], AVX-512 VNNI CPUs), and candle's VNNI-packed `QMatMul` (padded to a multiple
//! of 256 columns, as it needs), for 1, 8, 128 and 512 tokens. Time one thread with
//! `CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1 cargo bench --bench q8_kernels`; the ratio of
//! ours to candle's is what issue 28 compared (docs/benchmarks.md).
//!
//! `q4_1 ROWSxCOLS` groups time the default model's own format, Q4_1: the llama.cpp-exact
//! kernel (what `--weights native` runs, and the default on CPUs without AVX-512 VNNI) against
//! the packed kernel with the same weight values (what the default `auto` runs on AVX-512 VNNI
//! CPUs; elsewhere only the exact kernel is timed).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pdserve_gpu::quant::{matmul, PackedQ8, QMatrix, QType};

fn q8_kernels(c: &mut Criterion) {
    for (rows, cols) in [(960, 576), (3072, 576), (576, 1536), (576, 576)] {
        let f: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 7919 + 11) % 1009) as f32 - 504.0) / 2000.0)
            .collect();
        let ft = Tensor::from_vec(f, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&ft, GgmlDType::Q8_0).unwrap();
        let data = q.data().unwrap();
        let exact = QMatrix::from_gguf(QType::Q8_0, rows, cols, &data).unwrap();
        let packed = PackedQ8::from_gguf(QType::Q8_0, rows, cols, &data);
        let k = cols.next_multiple_of(256);
        let padded = Tensor::cat(
            &[
                ft.clone(),
                Tensor::zeros((rows, k - cols), candle_core::DType::F32, &Device::Cpu).unwrap(),
            ],
            1,
        )
        .unwrap();
        let candle =
            QMatMul::from_qtensor(QTensor::quantize(&padded, GgmlDType::Q8_0).unwrap()).unwrap();
        let mut g = c.benchmark_group(format!("q8_0 {rows}x{cols}"));
        g.sample_size(20)
            .warm_up_time(std::time::Duration::from_millis(500))
            .measurement_time(std::time::Duration::from_secs(2));
        for tokens in [1usize, 8, 128, 512] {
            let x: Vec<f32> = (0..tokens * cols)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0)
                .collect();
            let mut xp = vec![0f32; tokens * k];
            for (d, s) in xp.chunks_mut(k).zip(x.chunks(cols)) {
                d[..cols].copy_from_slice(s);
            }
            let xt = Tensor::from_vec(xp, (tokens, k), &Device::Cpu).unwrap();
            g.throughput(Throughput::Elements((rows * tokens) as u64));
            g.bench_with_input(BenchmarkId::new("exact", tokens), &x, |b, x| {
                b.iter(|| matmul(&exact, x, tokens))
            });
            if let Some(p) = &packed {
                g.bench_with_input(BenchmarkId::new("packed", tokens), &x, |b, x| {
                    b.iter(|| p.matmul(x, tokens))
                });
            }
            g.bench_with_input(BenchmarkId::new("candle", tokens), &xt, |b, xt| {
                b.iter(|| candle.forward(xt).unwrap())
            });
        }
        g.finish();
    }
}

fn q4_1_kernels(c: &mut Criterion) {
    for (rows, cols) in [(960, 576), (3072, 576), (576, 1536)] {
        let f: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 7919 + 11) % 1009) as f32 - 504.0) / 2000.0)
            .collect();
        let ft = Tensor::from_vec(f, (rows, cols), &Device::Cpu).unwrap();
        let data = QTensor::quantize(&ft, GgmlDType::Q4_1)
            .unwrap()
            .data()
            .unwrap()
            .into_owned();
        let exact = QMatrix::from_gguf(QType::Q4_1, rows, cols, &data).unwrap();
        // Without AVX-512 VNNI only the exact kernel runs (it is the default there).
        let packed = PackedQ8::from_gguf(QType::Q4_1, rows, cols, &data);
        let mut g = c.benchmark_group(format!("q4_1 {rows}x{cols}"));
        g.sample_size(20)
            .warm_up_time(std::time::Duration::from_millis(500))
            .measurement_time(std::time::Duration::from_secs(2));
        for tokens in [1usize, 8, 512] {
            let x: Vec<f32> = (0..tokens * cols)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0)
                .collect();
            g.throughput(Throughput::Elements((rows * tokens) as u64));
            g.bench_with_input(BenchmarkId::new("exact", tokens), &x, |b, x| {
                b.iter(|| matmul(&exact, x, tokens))
            });
            if let Some(packed) = &packed {
                g.bench_with_input(BenchmarkId::new("packed", tokens), &x, |b, x| {
                    b.iter(|| packed.matmul(x, tokens))
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, q8_kernels, q4_1_kernels);
criterion_main!(benches);
