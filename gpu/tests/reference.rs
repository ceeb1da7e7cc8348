//! Our forward pass against an independent implementation given the same weights:
//! candle-transformers' `quantized_llama` on the default model's GGUF.

use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use pdserve_gpu::engine::{Engine, EngineOptions, GenRequest};
use pdserve_gpu::fetch::{pull_default_model, Progress};
use pdserve_gpu::kv::KvDtype;
use pdserve_gpu::loader::load_gguf;
use pdserve_gpu::model::{Batch, SeqChunk};
use pdserve_gpu::sampling::SamplingParams;
use pdserve_gpu::weights::WeightFormat;

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhat is 12 times 7? Explain briefly.<|im_end|>\n<|im_start|>assistant\n",
];
const STEPS: usize = 32;
/// Largest |ours − reference| allowed on any last-position logit when both sides run the
/// weights dequantized to f32: what is left is f32 summation order in attention and norms.
const F32_LOGIT_TOLERANCE: f32 = 1e-3;
/// The same bound with the file's Q4_1 weights on both sides. `WeightFormat::Native` runs our
/// llama.cpp-exact kernels (`gpu/src/quant`: activations quantized to Q8_1, llama.cpp's
/// accumulation order; `gpu/tests/llamacpp_tokens.rs` checks those against llama.cpp itself);
/// candle's `quantized_llama` quantizes and sums differently, so last-position logits differ
/// by 0.63–0.90 on the three prompts (measured) and near-ties can flip after some tokens (12/32
/// greedy tokens equal on the second prompt, 32/32 on the others).
const QUANTIZED_LOGIT_TOLERANCE: f32 = 2.0;

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy tokens and the first step's logits from the reference implementation.
fn reference(path: &std::path::Path, prompt: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let mut file = std::fs::File::open(path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let input = Tensor::new(prompt, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model
        .forward(&input, 0)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let first = logits.clone();
    let mut tokens = vec![argmax(&logits)];
    for i in 1..STEPS {
        let input = Tensor::new(&[tokens[i - 1]], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model
            .forward(&input, prompt.len() + i - 1)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        tokens.push(argmax(&logits));
    }
    (tokens, first)
}

#[test]
fn greedy_tokens_and_logits_match_candle_quantized_llama() {
    // Quantized weights first, on this thread (candle reads CANDLE_DEQUANTIZE_ALL once per
    // thread); then f32 weights on both sides, in a thread that sees the variable set.
    compare(WeightFormat::Native, QUANTIZED_LOGIT_TOLERANCE);
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    std::thread::spawn(|| compare(WeightFormat::F32, F32_LOGIT_TOLERANCE))
        .join()
        .unwrap();
}

fn compare(format: WeightFormat, tolerance: f32) {
    let path = pull_default_model(Progress::Hide).expect("default model");
    let model = load_gguf(&path).unwrap();
    let opts = EngineOptions {
        format,
        num_blocks: Some(64),
        ..Default::default()
    };
    let mut engine = Engine::new(model, opts).unwrap();
    for prompt in PROMPTS {
        let ids = engine.tokenizer().encode(prompt, false).unwrap();
        let (ref_tokens, ref_logits) = reference(&path, &ids);

        // Last-position logits of the prompt, straight from a forward step.
        let blocks: Vec<u32> = (0..ids.len().div_ceil(16) as u32).collect();
        let batch = Batch {
            seqs: vec![SeqChunk {
                tokens: ids.clone(),
                start_pos: 0,
                block_table: blocks,
                want_logits: true,
            }],
        };
        let ours = engine.group().step(batch).unwrap().remove(0);
        let max_diff = ours
            .iter()
            .zip(&ref_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            max_diff < tolerance,
            "{format:?} prompt {prompt:?}: max logit diff {max_diff}"
        );

        let mut params = SamplingParams::greedy(STEPS);
        params.ignore_eos = true;
        let out = engine
            .generate(
                &[GenRequest {
                    prompt: ids,
                    params,
                }],
                &mut |_, _| {},
            )
            .unwrap();
        let same = out[0]
            .tokens
            .iter()
            .zip(&ref_tokens)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!("{format:?} {prompt:?}: {same}/{STEPS} greedy tokens equal, max logit diff {max_diff:.2e}");
        if format == WeightFormat::F32 {
            assert_eq!(out[0].tokens, ref_tokens, "{format:?} prompt {prompt:?}");
        } else {
            // Quantized kernels are shape-dependent inside candle, so a near-tie can flip
            // later; the first tokens must still agree.
            assert!(
                same >= 8,
                "{format:?} prompt {prompt:?}: only {same} tokens agree"
            );
        }
    }
    assert_eq!(engine.block_usage().0, 64, "every block back in the pool");
}

fn engine_with_kv(kv_dtype: KvDtype) -> Engine {
    let path = pull_default_model(Progress::Hide).expect("default model");
    let opts = EngineOptions {
        num_blocks: Some(64),
        kv_dtype,
        ..Default::default()
    };
    Engine::new(load_gguf(&path).unwrap(), opts).unwrap()
}

/// Greedy tokens of the default model with each KV cache dtype, `STEPS` tokens per prompt.
fn greedy(engine: &mut Engine) -> Vec<Vec<u32>> {
    let out = PROMPTS
        .iter()
        .map(|prompt| {
            let ids = engine.tokenizer().encode(prompt, false).unwrap();
            let mut params = SamplingParams::greedy(STEPS);
            params.ignore_eos = true;
            let out = engine
                .generate(
                    &[GenRequest {
                        prompt: ids,
                        params,
                    }],
                    &mut |_, _| {},
                )
                .unwrap();
            out[0].tokens.clone()
        })
        .collect();
    assert_eq!(engine.block_usage().0, 64, "every block back in the pool");
    out
}

/// Last-position logits of `tokens`, in one forward step.
fn last_logits(engine: &Engine, tokens: &[u32]) -> Vec<f32> {
    let batch = Batch {
        seqs: vec![SeqChunk {
            tokens: tokens.to_vec(),
            start_pos: 0,
            block_table: (0..tokens.len().div_ceil(16) as u32).collect(),
            want_logits: true,
        }],
    };
    engine.group().step(batch).unwrap().remove(0)
}

/// The best logit's lead over the second best.
fn margin(logits: &[f32]) -> f32 {
    let best = argmax(logits) as usize;
    let second = logits
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != best)
        .map(|(_, &x)| x)
        .fold(f32::NEG_INFINITY, f32::max);
    logits[best] - second
}

/// Largest |f16-cache − f32-cache| difference allowed on the f32 cache's ten best logits, on
/// the same tokens. Measured on the default model (Q4_1 weights): 0.52–0.66 for f16 and
/// 0.68–1.38 for bf16, while two f32 caches agree exactly (the forward pass is deterministic),
/// so this is the rounding of K and V alone, amplified through 30 layers; a layout or
/// conversion bug moves logits by far more.
const HALF_KV_LOGIT_TOLERANCE: f32 = 1.0;

/// Issue 17: a half-size KV cache (K and V rounded once when written, widened to f32 when
/// attention reads them). On the same tokens its logits stay within
/// `HALF_KV_LOGIT_TOLERANCE` of the f32 cache's; greedy text follows the f32 cache's until a
/// step whose top two logits are closer than the difference (a near-tie the rounding flips:
/// measured f32-cache leads of 0.004–0.157 where f16/bf16 text diverged, after 2 of 32 tokens
/// on the chat prompt). That divergence is why `scheduler.kv_cache_dtype` stays `f32` by
/// default.
#[test]
fn half_precision_kv_caches_differ_from_f32_only_at_near_ties() {
    let mut exact = engine_with_kv(KvDtype::F32);
    let f32_tokens = greedy(&mut exact);
    for dtype in [KvDtype::F16, KvDtype::Bf16] {
        let mut half = engine_with_kv(dtype);
        let got = greedy(&mut half);
        for (i, prompt) in PROMPTS.iter().enumerate() {
            let ids = exact.tokenizer().encode(prompt, false).unwrap();
            let (a, b) = (&got[i], &f32_tokens[i]);
            let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
            // The sequence both caches saw up to the first difference (or the whole run).
            let mut seq = ids.clone();
            seq.extend_from_slice(&b[..same.min(STEPS - 1)]);
            let (le, lh) = (last_logits(&exact, &seq), last_logits(&half, &seq));
            // Over the f32 cache's ten best tokens (the ones greedy picks between).
            let mut top: Vec<usize> = (0..le.len()).collect();
            top.sort_by(|&x, &y| le[y].total_cmp(&le[x]));
            let diff = top[..10]
                .iter()
                .map(|&t| (le[t] - lh[t]).abs())
                .fold(0f32, f32::max);
            let all = le
                .iter()
                .zip(&lh)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            eprintln!(
                "{dtype:?} prompt {i}: {same}/{STEPS} greedy tokens equal to the f32 cache's; \
                 at token {same}: top-10 logit diff {diff:.3} (whole vocabulary {all:.3}), \
                 f32-cache top-2 margin {:.3}",
                margin(&le)
            );
            let tolerance = match dtype {
                KvDtype::Bf16 => 2.0 * HALF_KV_LOGIT_TOLERANCE, // 8 mantissa bits, not 11
                _ => HALF_KV_LOGIT_TOLERANCE,
            };
            assert!(diff < tolerance, "{dtype:?} prompt {i}: logit diff {diff}");
            if same < STEPS {
                assert!(
                    margin(&le) < 2.0 * diff.max(1e-3),
                    "{dtype:?} prompt {i}: greedy text diverged at token {same} where the f32 \
                     cache's lead was {} (not a near-tie)",
                    margin(&le)
                );
            }
        }
    }
}
