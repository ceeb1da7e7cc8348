//! CPU time of the default weights' Q8_0 matmuls on this crate's kernels (the llama.cpp-exact
//! [`QMatrix`] and the sixteen-row [`PackedQ8`]) against candle's
//! VNNI-packed `QMatMul`, at the default model's shapes (`cargo test --release -p pdserve-gpu
//! --test q8_kernel_speed -- --ignored --nocapture`, with `CANDLE_NUM_THREADS=1
//! RAYON_NUM_THREADS=1` to time one thread). Thread CPU time, not wall time, so a busy
//! machine disturbs it little. Prints; asserts nothing about speed.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use pdserve_gpu::quant::{matmul, PackedQ8, QMatrix, QType};

fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = thread_cpu();
            f();
            thread_cpu() - t
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
#[ignore = "a measurement: run by hand"]
fn q8_0_matmul_cpu_time_ours_vs_candle() {
    for (rows, cols) in [(960, 576), (3072, 576), (576, 1536), (576, 576)] {
        let f: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 7919 + 11) % 1009) as f32 - 504.0) / 2000.0)
            .collect();
        let ft = Tensor::from_vec(f, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&ft, GgmlDType::Q8_0).unwrap();
        let ours = QMatrix::from_gguf(QType::Q8_0, rows, cols, &q.data().unwrap()).unwrap();
        let packed = PackedQ8::from_gguf(rows, cols, &q.data().unwrap());
        // candle's packed path wants input widths of a multiple of 256: pad as model.rs did.
        let k = cols.next_multiple_of(256);
        let fp = Tensor::cat(
            &[
                ft.clone(),
                Tensor::zeros((rows, k - cols), candle_core::DType::F32, &Device::Cpu).unwrap(),
            ],
            1,
        )
        .unwrap();
        let theirs =
            QMatMul::from_qtensor(QTensor::quantize(&fp, GgmlDType::Q8_0).unwrap()).unwrap();
        for tokens in [1usize, 8, 128, 512] {
            let x: Vec<f32> = (0..tokens * cols)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0)
                .collect();
            let mut xp = vec![0f32; tokens * k];
            for (d, s) in xp.chunks_mut(k).zip(x.chunks(cols)) {
                d[..cols].copy_from_slice(s);
            }
            let xt = Tensor::from_vec(xp, (tokens, k), &Device::Cpu).unwrap();
            let reps = if tokens >= 128 { 5 } else { 50 };
            let a = best_of(reps, || {
                std::hint::black_box(matmul(&ours, &x, tokens));
            });
            let b = best_of(reps, || {
                std::hint::black_box(theirs.forward(&xt).unwrap());
            });
            let p = packed.as_ref().map_or(f64::NAN, |p| {
                best_of(reps, || {
                    std::hint::black_box(p.matmul(&x, tokens));
                })
            });
            println!(
                "{rows:5}x{cols:<5} tokens {tokens:4}: exact {:8.1} us  packed {:8.1} us  \
                 candle {:8.1} us  exact/candle {:.2}  packed/candle {:.2}",
                a * 1e6,
                p * 1e6,
                b * 1e6,
                a / b,
                p / b
            );
        }
    }
}
