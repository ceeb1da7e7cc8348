//! The checks and measurements a machine with a GPU runs to verify the CUDA backend
//! (`pdserve cuda verify`, driven by `benches/device_check.sh`):
//!
//! 1. greedy tokens of the GPU against the CPU backend on the same weights, for several
//!    prompts; at the first divergence, both sides' logit margins (top-1 minus top-2) with the
//!    common prefix fed to each, so a near-tie is told apart from a bug;
//! 2. P/D hand-offs at the KV-byte level: prefill on the GPU, the request's KV bytes read from
//!    the GPU rank's host mirror (what the transfer engine would send), written into a CPU
//!    rank's cache, decode on the CPU; and the same into a second GPU group (mirror → device);
//!    each against the colocated tokens of the decoding side;
//! 3. prefill and decode tokens/s on the GPU at batch 1 and 32;
//! 4. KV transfer GB/s device → host mirror → device beside plain `cuMemcpy` of the same bytes;
//! 5. the attention kernel's two launches (whole and split into parts, `launch::attention`)
//!    on the same random inputs, which must agree to the bit.
//!
//! The pieces that need no GPU (greedy loops, span-by-span KV copy) live in `handoff.rs` and
//! are unit-tested on CPU groups.

use super::context::{rt, GemmDtype, GpuContext};
use super::executor::{CudaOptions, CudaTpGroup};
use super::handoff::{
    copy_kv, decode_greedy, greedy, prefill_logits, read_host_span, top2, write_host_span,
};
use super::kv::{DeviceKvCache, MirrorMode};
use super::layout::{block_runs, run_spans};
use super::nvrtc::KernelCache;
use crate::device::probe_cuda;
use crate::kv::{KvLayout, KvSpan};
use crate::loader::LoadedModel;
use crate::tp::{TpGroup, TpOptions};
use crate::weights::WeightFormat;
use crate::Result;
use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// What to verify.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// Prompts (plain text, tokenized with the model's tokenizer).
    pub prompts: Vec<String>,
    /// Greedy tokens per prompt.
    pub tokens: usize,
    /// GPU settings (first GPU, matmul type).
    pub cuda: CudaOptions,
    /// The CPU backend's weight format for the comparison.
    pub cpu_format: WeightFormat,
    /// Element type of both sides' KV caches (f32 or f16).
    pub kv_dtype: crate::kv::KvDtype,
    /// Also measure speed and KV transfer throughput.
    pub bench: bool,
    /// Decode steps timed per batch size.
    pub decode_steps: usize,
}

/// The first step where the GPU's greedy choice differs from the CPU's.
#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    /// Index of the generated token.
    pub step: usize,
    /// The CPU's token.
    pub cpu_token: u32,
    /// The GPU's token.
    pub gpu_token: u32,
    /// CPU top-1 minus top-2 logit at that step (common prefix fed).
    pub cpu_margin: f32,
    /// GPU top-1 minus top-2 logit at that step.
    pub gpu_margin: f32,
    /// Largest absolute difference between the two sides' logits at that step.
    pub max_logit_diff: f32,
}

/// One prompt's greedy comparison.
#[derive(Clone, Debug, Serialize)]
pub struct GreedyCase {
    /// The prompt.
    pub prompt: String,
    /// Its token ids (so another implementation can be fed the same input).
    pub prompt_ids: Vec<u32>,
    /// CPU tokens.
    pub cpu: Vec<u32>,
    /// GPU tokens.
    pub gpu: Vec<u32>,
    /// Length of the common prefix.
    pub matched: usize,
    /// The first divergence, if any.
    pub divergence: Option<Divergence>,
}

/// One P/D hand-off check.
#[derive(Clone, Debug, Serialize)]
pub struct HandoffCase {
    /// `gpu-prefill/cpu-decode` or `gpu-prefill/gpu-decode`.
    pub name: String,
    /// Colocated tokens of the decoding side.
    pub colocated: Vec<u32>,
    /// Tokens decoded from the handed-off KV.
    pub handed_off: Vec<u32>,
    /// Whether they are identical.
    pub identical: bool,
}

/// GPU speed.
#[derive(Clone, Debug, Serialize)]
pub struct GpuSpeed {
    /// Prefill tokens/s, one 128-token prompt.
    pub prefill_tps_128: f64,
    /// Prefill tokens/s, one 512-token prompt.
    pub prefill_tps_512: f64,
    /// Prefill tokens/s, one 2048-token prompt.
    pub prefill_tps_2048: f64,
    /// Decode tokens/s, one sequence.
    pub decode_tps_b1: f64,
    /// Decode tokens/s, 32 sequences.
    pub decode_tps_b32: f64,
}

/// KV transfer throughput through the host mirror, beside plain copies of the same bytes.
#[derive(Clone, Debug, Serialize)]
pub struct TransferSpeed {
    /// Bytes moved (all layers, K and V, of the blocks).
    pub bytes: usize,
    /// Blocks moved.
    pub blocks: usize,
    /// Device → pinned host mirror (per-block-run copies), GB/s.
    pub d2h_gbps: f64,
    /// Host mirror → host mirror (the hop a transport makes), GB/s.
    pub host_gbps: f64,
    /// Host mirror → device, GB/s.
    pub h2d_gbps: f64,
    /// The whole device → host → host → device path, GB/s.
    pub end_to_end_gbps: f64,
    /// One `cuMemcpyDtoH` of the same bytes into pinned memory, GB/s.
    pub plain_d2h_gbps: f64,
    /// One `cuMemcpyHtoD` of the same bytes from pinned memory, GB/s.
    pub plain_h2d_gbps: f64,
    /// One `cuMemcpyDtoD` of the same bytes, GB/s.
    pub plain_d2d_gbps: f64,
}

/// Everything `pdserve cuda verify` reports.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    /// Model name.
    pub model: String,
    /// The driver's CUDA version (e.g. 13000).
    pub driver_version: i32,
    /// GPUs the driver sees.
    pub devices: usize,
    /// Matmul type on the GPU.
    pub dtype: GemmDtype,
    /// KV cache element type on both sides.
    pub kv_dtype: &'static str,
    /// CPU weight format.
    pub cpu_format: WeightFormat,
    /// Greedy comparisons.
    pub greedy: Vec<GreedyCase>,
    /// Hand-offs.
    pub handoff: Vec<HandoffCase>,
    /// Speed, when asked.
    pub speed: Option<GpuSpeed>,
    /// KV transfer throughput, when asked.
    pub transfer: Option<TransferSpeed>,
    /// The attention kernel's whole and split launches compared.
    pub attention_launches: AttentionLaunchCheck,
}

/// The attention kernel run both ways on the same inputs: one block per (token, head) walking
/// its parts, and one block per part folded by `attention_combine_f32`.
#[derive(Clone, Debug, Serialize)]
pub struct AttentionLaunchCheck {
    /// The positions of the query tokens (one sequence).
    pub positions: Vec<usize>,
    /// Parts of the longest context.
    pub parts: usize,
    /// Whether every output element is the same bits both ways.
    pub identical: bool,
    /// Largest absolute difference (0 when identical).
    pub max_abs_diff: f32,
}

impl VerifyReport {
    /// Whether every greedy case matched in full and every hand-off was identical.
    pub fn all_identical(&self) -> bool {
        self.greedy.iter().all(|g| g.divergence.is_none())
            && self.handoff.iter().all(|h| h.identical)
            && self.attention_launches.identical
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Runs the checks (and, with `opts.bench`, the measurements) on `model`.
///
/// # Errors
/// No driver or GPU (typed, from the probe), compile and device errors, model errors.
pub fn run(model: &LoadedModel, opts: &VerifyOptions) -> Result<VerifyReport> {
    let probe = probe_cuda(opts.cuda.first_gpu + 1)?;
    let cfg = &model.config;
    let encoded: Vec<Vec<u32>> = opts
        .prompts
        .iter()
        .map(|p| model.tokenizer.encode(p, true))
        .collect::<Result<_>>()?;
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0) + opts.tokens + 1;
    let bs = crate::kv::DEFAULT_BLOCK_SIZE;
    let per_seq = longest.div_ceil(bs);
    let bench_blocks = 32 * (opts.decode_steps + 2).div_ceil(bs) + 2048usize.div_ceil(bs);
    let tp_opts = TpOptions {
        tp: 1,
        num_blocks: (2 * per_seq).max(bench_blocks),
        block_size: bs,
        format: opts.cpu_format,
        kv_dtype: opts.kv_dtype,
    };
    let table: Vec<u32> = (0..per_seq as u32).collect();
    let other: Vec<u32> = (per_seq as u32..2 * per_seq as u32).collect();

    let cpu = TpGroup::new(cfg, &model.store, &tp_opts, &AnonAllocator)?;
    let prefill_opts = CudaOptions {
        mirror: MirrorMode::WriteThrough,
        ..opts.cuda.clone()
    };
    let gpu = CudaTpGroup::new(
        cfg,
        &model.store,
        &tp_opts,
        &prefill_opts,
        Some(&AnonAllocator),
    )?;

    let mut greedy_cases = Vec::new();
    for (text, prompt) in opts.prompts.iter().zip(&encoded) {
        let c = greedy(&cpu, prompt, opts.tokens, &table)?;
        let g = greedy(&gpu, prompt, opts.tokens, &table)?;
        let matched = common_prefix(&c, &g);
        let divergence = if matched < c.len().min(g.len()) {
            let mut prefix = prompt.clone();
            prefix.extend_from_slice(&c[..matched]);
            let lc = prefill_logits(&cpu, &prefix, &table)?;
            let lg = prefill_logits(&gpu, &prefix, &table)?;
            let (tc, c1, c2) = top2(&lc);
            let (tg, g1, g2) = top2(&lg);
            Some(Divergence {
                step: matched,
                cpu_token: tc,
                gpu_token: tg,
                cpu_margin: c1 - c2,
                gpu_margin: g1 - g2,
                max_logit_diff: lc
                    .iter()
                    .zip(&lg)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max),
            })
        } else {
            None
        };
        greedy_cases.push(GreedyCase {
            prompt: text.clone(),
            prompt_ids: prompt.clone(),
            cpu: c,
            gpu: g,
            matched,
            divergence,
        });
    }

    // Hand-offs: GPU prefill of the first prompt; its KV bytes read from the mirror.
    let mut handoff = Vec::new();
    if let Some(prompt) = encoded.first() {
        let n = opts.tokens.saturating_sub(1);
        let t0 = crate::sampling::argmax(&prefill_logits(&gpu, prompt, &table)?);
        let layout = gpu.layouts()[0];
        let mirror = gpu.ranks()[0].mirror_regions().to_vec();
        let read = |s: KvSpan| Ok(read_host_span(&mirror, s));

        // → CPU decode.
        copy_kv(&layout, &table, &other, prompt.len(), read, |s, b| {
            cpu.with_kv(0, {
                let b = b.to_vec();
                move |kv| kv.write_span(s, &b)
            })
        })?;
        let handed = decode_greedy(&cpu, prompt.len(), t0, n, &other)?;
        let colocated = greedy(&cpu, prompt, n + 1, &table)?;
        handoff.push(HandoffCase {
            name: "gpu-prefill/cpu-decode".into(),
            identical: colocated.get(1..) == Some(&handed[..]) && colocated.first() == Some(&t0),
            colocated: colocated.into_iter().skip(1).collect(),
            handed_off: handed,
        });

        // → a second GPU group that receives into its mirror and uploads.
        let recv_opts = CudaOptions {
            mirror: MirrorMode::Receive,
            ..opts.cuda.clone()
        };
        let gpu2 = CudaTpGroup::new(
            cfg,
            &model.store,
            &tp_opts,
            &recv_opts,
            Some(&AnonAllocator),
        )?;
        let mirror2 = gpu2.ranks()[0].mirror_regions().to_vec();
        copy_kv(&layout, &table, &other, prompt.len(), read, |s, b| {
            write_host_span(&mirror2, s, b);
            Ok(())
        })?;
        gpu2.upload_kv(&other[..layout.blocks_for(prompt.len())])?;
        let handed = decode_greedy(&gpu2, prompt.len(), t0, n, &other)?;
        let colocated = greedy(&gpu, prompt, n + 1, &table)?;
        handoff.push(HandoffCase {
            name: "gpu-prefill/gpu-decode".into(),
            identical: colocated.get(1..) == Some(&handed[..]) && colocated.first() == Some(&t0),
            colocated: colocated.into_iter().skip(1).collect(),
            handed_off: handed,
        });
        gpu2.join();
    }

    let (speed, transfer) = if opts.bench {
        let speed = GpuSpeed {
            prefill_tps_128: crate::bench::prefill_tps(&gpu, 128, 3)?,
            prefill_tps_512: crate::bench::prefill_tps(&gpu, 512, 3)?,
            prefill_tps_2048: crate::bench::prefill_tps(&gpu, 2048.min(cfg.context_length), 3)?,
            decode_tps_b1: crate::bench::decode_tps(&gpu, 1, opts.decode_steps)?,
            decode_tps_b32: crate::bench::decode_tps(&gpu, 32, opts.decode_steps)?,
        };
        gpu.join();
        (
            Some(speed),
            Some(transfer_speed(opts.cuda.first_gpu, &tp_opts, cfg)?),
        )
    } else {
        gpu.join();
        (None, None)
    };

    let attention_launches = check_attention_launches(opts.cuda.first_gpu)?;
    Ok(VerifyReport {
        model: model.name.clone(),
        driver_version: probe.driver_version,
        devices: probe.device_count,
        dtype: opts.cuda.dtype,
        cpu_format: opts.cpu_format,
        kv_dtype: opts.kv_dtype.as_str(),
        greedy: greedy_cases,
        handoff,
        speed,
        transfer,
        attention_launches,
    })
}

/// Runs `paged_attention_f32_f32` whole and split on seeded random Q, K and V (9 query heads
/// over 3 KV heads of 64, a shuffled block table) for query tokens at positions around the
/// part edges and far past them, and compares the outputs bit for bit.
fn check_attention_launches(ordinal: usize) -> Result<AttentionLaunchCheck> {
    use super::context::{KArg, TypedBuffer};
    use super::launch;
    use super::model::{attend, AttentionArgs};
    use rand::{seq::SliceRandom, Rng, SeedableRng};

    let g = GpuContext::new(ordinal, &KernelCache::from_env())?;
    let (nh, nkv, hd, bs) = (9usize, 3usize, 64usize, 16usize);
    let positions: Vec<usize> = vec![0, 1, 255, 256, 257, 511, 1000, 3071];
    let n_ctx = positions.iter().max().map_or(1, |p| p + 1);
    let num_blocks = n_ctx.div_ceil(bs) + 3;
    let qkv_w = (nh + 2 * nkv) * hd;
    let t = positions.len();
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    let mut random =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
    let qkv = g.upload(&random(t * qkv_w))?;
    let cache = g.upload(&random(2 * num_blocks * nkv * bs * hd))?;
    let mut table: Vec<i32> = (0..num_blocks as i32).collect();
    table.shuffle(&mut rand::rngs::StdRng::seed_from_u64(32));
    let block_tables = g.upload(&table)?;
    let tok_seq = g.upload(&vec![0i32; t])?;
    let tok_pos = g.upload(&positions.iter().map(|&p| p as i32).collect::<Vec<_>>())?;
    let seq_bt_start = g.upload(&[0i32])?;
    let plan = launch::attention(t, nh, hd, n_ctx)?;
    if plan.combine.is_none() {
        return Err(crate::ModelError::InvalidBatch(
            "the check's launch was expected to split".into(),
        ));
    }
    let partials = g.zeros::<f32>(plan.partial_floats)?;
    let args = AttentionArgs {
        kv_suffix: "f32",
        qkv: &qkv,
        qkv_w,
        q_heads: nh,
        kv_heads: nkv,
        head_dim: hd,
        token_seq: &tok_seq,
        positions: &tok_pos,
        seq_bt_start: &seq_bt_start,
        block_tables: &block_tables,
        block_size: bs,
        num_blocks,
        cache: KArg::F32s(&cache),
        scale: 1.0 / (hd as f32).sqrt(),
        partials: &partials,
    };
    let whole_out = g.typed_zeros(GemmDtype::F32, t * nh * hd)?;
    let split_out = g.typed_zeros(GemmDtype::F32, t * nh * hd)?;
    attend(&g, &plan.whole(), &args, &whole_out)?;
    attend(&g, &plan, &args, &split_out)?;
    let download = |b: &TypedBuffer| -> Result<Vec<f32>> {
        match b {
            TypedBuffer::F32(s) => Ok(g.download(s)?),
            TypedBuffer::Half(..) => unreachable!("allocated as f32"),
        }
    };
    let (a, b) = (download(&whole_out)?, download(&split_out)?);
    let identical = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
    let max_abs_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    Ok(AttentionLaunchCheck {
        positions,
        parts: plan.parts,
        identical,
        max_abs_diff,
    })
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-12) / 1e9
}

/// Measures moving 256 blocks of KV (all layers) device → mirror → mirror → device, and plain
/// copies of the same byte count.
fn transfer_speed(
    ordinal: usize,
    tp: &TpOptions,
    cfg: &crate::config::ModelConfig,
) -> Result<TransferSpeed> {
    let gpu = Arc::new(GpuContext::new(ordinal, &KernelCache::from_env())?);
    let layout = KvLayout {
        num_layers: cfg.num_layers,
        num_blocks: 512,
        block_size: tp.block_size,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        dtype: crate::kv::KvDtype::F32,
    };
    let hosts = |n: usize| -> Result<Vec<Arc<dyn HostMemory>>> {
        Ok((0..n)
            .map(|_| AnonAllocator.allocate(layout.region_bytes()))
            .collect::<std::io::Result<_>>()?)
    };
    let src = DeviceKvCache::new(
        gpu.clone(),
        layout,
        Some((MirrorMode::WriteThrough, hosts(layout.num_layers)?)),
    )?;
    let dst = DeviceKvCache::new(
        gpu.clone(),
        layout,
        Some((MirrorMode::Receive, hosts(layout.num_layers)?)),
    )?;
    // Every other block: runs of one, as scattered allocations give.
    let blocks: Vec<u32> = (0..256u32).map(|b| 2 * b).collect();
    let bytes = 2 * blocks.len() * layout.block_bytes() * layout.num_layers;
    let (sm, dm) = (
        src.mirror()
            .map(|m| m.regions().to_vec())
            .unwrap_or_default(),
        dst.mirror()
            .map(|m| m.regions().to_vec())
            .unwrap_or_default(),
    );
    let mut best = [f64::MAX; 3];
    for _ in 0..5 {
        let t = Instant::now();
        for layer in 0..layout.num_layers {
            src.copy_to_mirror(layer, &blocks)?;
        }
        gpu.synchronize()?;
        let d2h = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for layer in 0..layout.num_layers {
            for run in block_runs(&blocks) {
                for span in run_spans(&layout, layer, &run) {
                    write_host_span(&dm, span, &read_host_span(&sm, span));
                }
            }
        }
        let host = t.elapsed().as_secs_f64();
        let t = Instant::now();
        dst.upload_blocks(&blocks)?;
        gpu.synchronize()?;
        let h2d = t.elapsed().as_secs_f64();
        for (b, v) in best.iter_mut().zip([d2h, host, h2d]) {
            *b = b.min(v);
        }
    }
    let (plain_d2h, plain_h2d, plain_d2d) = plain_copies(&gpu, bytes)?;
    Ok(TransferSpeed {
        bytes,
        blocks: blocks.len(),
        d2h_gbps: gbps(bytes, best[0]),
        host_gbps: gbps(bytes, best[1]),
        h2d_gbps: gbps(bytes, best[2]),
        end_to_end_gbps: gbps(bytes, best.iter().sum()),
        plain_d2h_gbps: gbps(bytes, plain_d2h),
        plain_h2d_gbps: gbps(bytes, plain_h2d),
        plain_d2d_gbps: gbps(bytes, plain_d2d),
    })
}

/// Best of 5 single copies of `bytes`: device → pinned host, pinned host → device, device →
/// device (seconds).
fn plain_copies(gpu: &GpuContext, bytes: usize) -> Result<(f64, f64, f64)> {
    use cudarc::driver::sys;
    let a = gpu.zeros::<u8>(bytes)?;
    let mut b = gpu.zeros::<u8>(bytes)?;
    let host = AnonAllocator.allocate(bytes)?;
    gpu.context().bind_to_thread().map_err(rt("bind context"))?;
    // SAFETY: a live mapping of `len` bytes, unregistered below before it is dropped.
    unsafe { sys::cuMemHostRegister_v2(host.as_ptr() as *mut _, host.len(), 0) }
        .result()
        .map_err(rt("pin host buffer"))?;
    let stream = gpu.stream().cu_stream();
    let (pa, pb) = {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (pa, _s1) = a.device_ptr(gpu.stream());
        let (pb, _s2) = b.device_ptr_mut(gpu.stream());
        (pa, pb)
    };
    let mut best = [f64::MAX; 3];
    let result = (|| -> Result<()> {
        for _ in 0..5 {
            for (i, best) in best.iter_mut().enumerate() {
                let t = Instant::now();
                // SAFETY: all three buffers hold `bytes` bytes and outlive the synchronize.
                unsafe {
                    match i {
                        0 => sys::cuMemcpyDtoHAsync_v2(host.as_ptr() as *mut _, pa, bytes, stream),
                        1 => {
                            sys::cuMemcpyHtoDAsync_v2(pb, host.as_ptr() as *const _, bytes, stream)
                        }
                        _ => sys::cuMemcpyDtoDAsync_v2(pb, pa, bytes, stream),
                    }
                }
                .result()
                .map_err(rt("plain copy"))?;
                gpu.synchronize()?;
                *best = best.min(t.elapsed().as_secs_f64());
            }
        }
        Ok(())
    })();
    // SAFETY: registered above.
    unsafe { sys::cuMemHostUnregister(host.as_ptr() as *mut _) };
    result?;
    Ok((best[0], best[1], best[2]))
}
