//! `pdserve cuda probe|compile|verify`, and the `--device cuda` paths of `generate`,
//! `bench model` and `serve`.
//!
//! Every path that would touch the GPU first runs the driver probe, so on a machine without
//! an NVIDIA driver `--device cuda` ends with "no CUDA driver: ..." (and a binary built
//! without `--features cuda` says so) instead of a panic.

use super::ModelArgs;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use pdserve_gpu::bench::{ModelBenchOptions, ModelBenchResult};
use pdserve_gpu::device::{check_device, probe_cuda, Device};
use pdserve_gpu::loader::LoadedModel;
use pdserve_gpu::sampling::SamplingParams;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub(crate) enum CudaCommand {
    /// Report whether a CUDA driver and GPUs are usable here (exit status 1 when not).
    Probe {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Compile every kernel to PTX with NVRTC into the kernel cache (needs no GPU); carry
    /// the directory to a GPU machine that lacks NVRTC and point PDSERVE_CUDA_KERNELS at it.
    Compile {
        /// Target architectures (repeatable; default sm_80 and sm_90).
        #[arg(long = "arch")]
        archs: Vec<String>,
        /// Cache directory (default: $PDSERVE_CUDA_KERNELS, else $PDSERVE_HOME/cuda-kernels).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// On a GPU: greedy tokens against the CPU backend, P/D hand-offs through the KV bytes,
    /// and (with --bench) speed and KV transfer throughput.
    Verify(VerifyArgs),
}

#[derive(Args, Debug)]
pub(crate) struct VerifyArgs {
    /// `synthetic-smollm` (a seeded model of SmolLM2-135M's shape written as a Q4_1 GGUF,
    /// interleaved RoPE), a GGUF file, an HF directory, `default`, or `synthetic:NAME`.
    #[arg(long, default_value = "synthetic-smollm")]
    model: String,
    /// Also write the synthetic model as an HF checkpoint here (for HF transformers).
    #[arg(long)]
    export_hf: Option<PathBuf>,
    /// A prompt (repeatable; default: three short built-in prompts and one long one, whose
    /// decode attends over several attention parts).
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Matmul weight type on the GPU: auto (= f16), f16, bf16, f32.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// The CPU backend's weight format for the comparison.
    #[arg(long, default_value = "f32")]
    cpu_weights: pdserve_gpu::weights::WeightFormat,
    /// Element type of the KV cache on both sides: f32 or f16 (`scheduler.kv_cache_dtype`).
    #[arg(long, default_value = "f32")]
    kv_dtype: pdserve_runtime::config::KvCacheDtype,
    /// Also measure prefill/decode tokens/s and KV transfer GB/s.
    #[arg(long)]
    bench: bool,
    /// Decode steps timed per batch size (with --bench).
    #[arg(long, default_value_t = 64)]
    decode_steps: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

const DEFAULT_PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
];

/// The long default prompt: a paragraph repeated until it spans well over 256 keys (the CUDA
/// attention's part) with any tokenizer, so the greedy comparison covers a decode whose
/// attention is split into parts and folded, and a prefill chunk that walks several parts.
fn long_default_prompt() -> String {
    let paragraph = "The keeper of the lighthouse kept a log of every ship that passed, the \
        weather at dawn and dusk, and the oil burned each night. ";
    paragraph.repeat(24)
}

/// Fails with the device's reason when `device` cannot run `tp` ranks here.
pub(crate) fn check(device: Device, tp: usize) -> Result<()> {
    check_device(device, tp)
        .map(|_| ())
        .with_context(|| format!("--device {device}"))
}

/// `serve` with `model.device` other than cpu: the device must be usable (a binary built
/// with `--features cuda`, a driver, enough GPUs for `model.tp`) before anything is loaded;
/// then the instance's TP workers start CUDA ranks (docs/cuda.md, "Wiring into the actors").
pub(crate) fn check_serving(cfg: &pdserve_runtime::config::ServeConfig) -> Result<()> {
    let device: Device = cfg
        .model
        .device
        .parse()
        .with_context(|| format!("model.device {:?}", cfg.model.device))?;
    if !device.is_cuda() {
        return Ok(());
    }
    check(device, cfg.model.tp)
}

pub(crate) fn run(cmd: CudaCommand) -> Result<()> {
    match cmd {
        CudaCommand::Probe { json } => {
            let r = probe_cuda(1);
            if json {
                let v = match &r {
                    Ok(p) => serde_json::json!({
                        "ok": true,
                        "library": p.library,
                        "driver_version": p.driver_version,
                        "devices": p.device_count,
                        "cuda_feature": cfg!(feature = "cuda"),
                    }),
                    Err(e) => serde_json::json!({
                        "ok": false,
                        "kind": e.kind(),
                        "error": e.to_string(),
                        "cuda_feature": cfg!(feature = "cuda"),
                    }),
                };
                println!("{v}");
            }
            let p = r?;
            if !json {
                println!(
                    "CUDA driver {}.{} ({}), {} device(s); this binary {} the cuda feature",
                    p.driver_version / 1000,
                    p.driver_version % 1000 / 10,
                    p.library,
                    p.device_count,
                    if cfg!(feature = "cuda") {
                        "has"
                    } else {
                        "lacks"
                    }
                );
            }
            Ok(())
        }
        CudaCommand::Compile { archs, out } => {
            use pdserve_gpu::cuda::kernels::{ARCHS, SOURCES};
            use pdserve_gpu::cuda::nvrtc::KernelCache;
            let cache = match out {
                Some(dir) => KernelCache::new(dir),
                None => KernelCache::from_env(),
            };
            let archs: Vec<String> = if archs.is_empty() {
                ARCHS.iter().map(|a| a.to_string()).collect()
            } else {
                archs
            };
            for arch in &archs {
                for src in SOURCES {
                    let (_, hit) = cache.ptx(src, arch)?;
                    println!(
                        "{} {arch}: {}",
                        cache.path_of(src, arch).display(),
                        if hit { "cached" } else { "compiled" }
                    );
                }
            }
            Ok(())
        }
        CudaCommand::Verify(args) => verify(args),
    }
}

fn load_for_verify(args: &VerifyArgs) -> Result<LoadedModel> {
    if args.model != "synthetic-smollm" {
        let source: pdserve_gpu::loader::ModelSource = args.model.parse().expect("infallible");
        return Ok(pdserve_gpu::loader::load_model(&source)?);
    }
    let dir = pdserve_gpu::fetch::pdserve_home().join("cuda-verify");
    let path = pdserve_gpu::cuda::handoff::write_synthetic_smollm(&dir, args.export_hf.as_deref())?;
    if let Some(hf) = &args.export_hf {
        eprintln!(
            "wrote the synthetic model as an HF checkpoint in {}",
            hf.display()
        );
    }
    Ok(pdserve_gpu::loader::load_gguf(&path)?)
}

#[cfg(feature = "cuda")]
fn cuda_options(gpu: usize, dtype: &str) -> Result<pdserve_gpu::cuda::CudaOptions> {
    Ok(pdserve_gpu::cuda::CudaOptions {
        first_gpu: gpu,
        dtype: dtype.parse()?,
        mirror: pdserve_gpu::cuda::MirrorMode::Off,
    })
}

#[cfg(feature = "cuda")]
fn first_gpu(device: Device) -> usize {
    match device {
        Device::Cuda { ordinal } => ordinal,
        Device::Cpu => 0,
    }
}

#[cfg(feature = "cuda")]
fn verify(args: VerifyArgs) -> Result<()> {
    use pdserve_gpu::cuda::verify::{run, VerifyOptions};
    probe_cuda(args.gpu + 1)?;
    let model = load_for_verify(&args)?;
    let prompts = if args.prompts.is_empty() {
        let mut p: Vec<String> = DEFAULT_PROMPTS.iter().map(|p| p.to_string()).collect();
        p.push(long_default_prompt());
        p
    } else {
        args.prompts.clone()
    };
    let opts = VerifyOptions {
        prompts,
        tokens: args.tokens,
        cuda: cuda_options(args.gpu, &args.dtype)?,
        cpu_format: args.cpu_weights,
        kv_dtype: args.kv_dtype.into(),
        bench: args.bench,
        decode_steps: args.decode_steps,
    };
    let report = run(&model, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    if !report.all_identical() {
        eprintln!("tokens differ somewhere: see `divergence` and the hand-off cases");
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn verify(args: VerifyArgs) -> Result<()> {
    let _ = (load_for_verify, &args, DEFAULT_PROMPTS, long_default_prompt);
    Err(pdserve_gpu::device::DeviceError::NotBuilt.into())
}

/// `generate --device cuda`: the prompt through the engine loop on CUDA ranks, streamed.
#[cfg(feature = "cuda")]
pub(crate) fn generate(
    model: LoadedModel,
    args: &ModelArgs,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> Result<()> {
    use pdserve_gpu::cuda::CudaTpGroup;
    use pdserve_gpu::engine::{Engine, EngineOptions, GenRequest};
    use std::io::Write;
    let opts = EngineOptions {
        tp: args.tp,
        num_blocks: Some((prompt.len() + params.max_tokens).div_ceil(16) + 1),
        ..Default::default()
    };
    let cuda = cuda_options(first_gpu(args.device), &args.dtype)?;
    let group = CudaTpGroup::new(
        &model.config,
        &model.store,
        &opts.tp_options(&model.config),
        &cuda,
        None,
    )?;
    let mut engine = Engine::with_group(model, group, opts);
    let mut stdout = std::io::stdout();
    let out = engine.generate(&[GenRequest { prompt, params }], &mut |_, text| {
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    })?;
    println!();
    tracing::info!(
        tokens = out[0].tokens.len(),
        finish = out[0].finish.as_openai(),
        "done"
    );
    // The ranks free their device state before the process exits (not racing the driver's
    // own teardown).
    engine.into_group().join();
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn generate(
    _model: LoadedModel,
    _args: &ModelArgs,
    _prompt: Vec<u32>,
    _params: SamplingParams,
) -> Result<()> {
    Err(pdserve_gpu::device::DeviceError::NotBuilt.into())
}

/// `bench model --device cuda`.
#[cfg(feature = "cuda")]
pub(crate) fn bench_model(
    args: &ModelArgs,
    threads: usize,
    opts: &ModelBenchOptions,
    kv_dtype: pdserve_gpu::kv::KvDtype,
) -> Result<ModelBenchResult> {
    use pdserve_gpu::cuda::CudaTpGroup;
    use pdserve_gpu::engine::EngineOptions;
    let source: pdserve_gpu::loader::ModelSource = args.model.parse().expect("infallible");
    let model = pdserve_gpu::loader::load_model(&source)
        .with_context(|| format!("loading model `{source}`"))?;
    let eopts = EngineOptions {
        tp: args.tp,
        max_seqs: 9,
        kv_dtype,
        ..Default::default()
    };
    let group = CudaTpGroup::new(
        &model.config,
        &model.store,
        &eopts.tp_options(&model.config),
        &cuda_options(first_gpu(args.device), &args.dtype)?,
        None,
    )?;
    let result = pdserve_gpu::bench::run_model_bench(&group, &model.name, threads, opts);
    group.join();
    Ok(result?)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn bench_model(
    _args: &ModelArgs,
    _threads: usize,
    _opts: &ModelBenchOptions,
    _kv_dtype: pdserve_gpu::kv::KvDtype,
) -> Result<ModelBenchResult> {
    Err(pdserve_gpu::device::DeviceError::NotBuilt.into())
}
