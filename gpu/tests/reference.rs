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

/// What "agrees with the reference" means for one weight format. Every bound holds at each of
/// the `STEPS` steps of the reference's own greedy sequence (teacher forcing: both sides see
/// the same context), on every prompt.
#[derive(Clone, Copy, Debug)]
struct Agreement {
    /// Largest |ours − reference| on any logit of the vocabulary.
    logits: f32,
    /// Largest |ours − reference| on the reference's ten best logits (those greedy picks
    /// between).
    top10: f32,
    /// A step may pick another token than the reference only where the reference's best logit
    /// leads its second by less than this (a near-tie).
    near_tie: f32,
    /// Most such steps per prompt.
    flips: usize,
}

/// Both sides run the weights dequantized to f32: what is left is f32 summation order in
/// matmuls, attention and norms. Measured (2026-11-26, Intel Xeon, 2 threads) over the 3 × 32
/// teacher-forced steps: at most 5.2e-5 on any logit, 2.7e-5 on the top ten, no step picking
/// another token (the closest lead was 0.026). The bounds are ~10× those figures (room for
/// another CPU's SIMD width changing summation order), and no flip is allowed.
const F32: Agreement = Agreement {
    logits: 5e-4,
    top10: 2.5e-4,
    near_tie: 0.0,
    flips: 0,
};

/// The file's Q4_1 weights on both sides. `WeightFormat::Native` runs our llama.cpp-exact
/// kernels (`gpu/src/quant`: activations quantized to Q8_1, llama.cpp's accumulation order;
/// `gpu/tests/llamacpp_tokens.rs` checks those against llama.cpp itself); candle's
/// `quantized_llama` quantizes and sums differently. Measured (same run as above) over the 3 × 32
/// teacher-forced steps: at most 1.42 on any logit (0.66–0.74 at the first step, median 0.70),
/// at most 0.95 on the top ten (median 0.26), and exactly one step per prompt picking another
/// token, each at a near-tie — reference leads of 0.007, 0.060 and 0.044 (at steps 14, 12, 30;
/// free-running generation then equals the reference for exactly 14, 12 and 30 tokens). The
/// bounds are the measured maxima plus ~25–30 % (both sides are deterministic and the
/// quantized dot products are integer arithmetic, so the margin is for another CPU's f32
/// summation order only, which moves logits by ~1e-4 as the f32 figures show): 1.75 on any
/// logit, 1.25 on the top ten; a flip only at a lead under 0.15 (2.5× the largest measured),
/// at most 2 per prompt. Before this, the test allowed 2.0 at the first step only and 8 of 32
/// free-running tokens. Re-measured when attention's scores became 8-lane dot products
/// (2026-11-27, AMD EPYC, 2 threads): at most 1.46 on any logit, 0.80 on the top ten; the first
/// two prompts pick no other token, the third one, at step 6, where the reference leads by
/// 0.157 and the two sides' top ten differ by up to 0.163 at that step (the f32 comparison
/// stayed at 4.2e-5 / 2.3e-5, no flip); a flip is now allowed at a lead under 0.2.
const QUANTIZED: Agreement = Agreement {
    logits: 1.75,
    top10: 1.25,
    near_tie: 0.2,
    flips: 2,
};

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy tokens and every step's logits (the step that chose each token) from the
/// reference implementation.
fn reference(path: &std::path::Path, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut file = std::fs::File::open(path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let mut forward = |input: &[u32], pos: usize| {
        let input = Tensor::new(input, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        model
            .forward(&input, pos)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let mut logits = vec![forward(prompt, 0)];
    let mut tokens = vec![argmax(&logits[0])];
    for i in 1..STEPS {
        logits.push(forward(&[tokens[i - 1]], prompt.len() + i - 1));
        tokens.push(argmax(&logits[i]));
    }
    (tokens, logits)
}

/// Our logits for every step of the reference's own sequence (teacher forcing): the prompt in
/// one forward step, then one step per reference token, so both sides see the same context
/// at every step whatever either would have chosen.
fn teacher_forced(engine: &Engine, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let total = prompt.len() + forced.len();
    let block_table: Vec<u32> = (0..total.div_ceil(16) as u32).collect();
    let step = |tokens: Vec<u32>, start_pos: usize| {
        let batch = Batch {
            seqs: vec![SeqChunk {
                tokens,
                start_pos,
                block_table: block_table.clone(),
                want_logits: true,
                all_logits: false,
                embeds: Vec::new(),
            }],
        };
        engine.group().step(batch).unwrap().remove(0)
    };
    let mut out = vec![step(prompt.to_vec(), 0)];
    for (i, &t) in forced[..forced.len() - 1].iter().enumerate() {
        out.push(step(vec![t], prompt.len() + i));
    }
    out
}

/// Largest |ours − reference| over the reference's ten best logits (the tokens greedy picks
/// between).
fn top_diff(reference: &[f32], ours: &[f32]) -> f32 {
    let mut top: Vec<usize> = (0..reference.len()).collect();
    top.sort_by(|&x, &y| reference[y].total_cmp(&reference[x]));
    top[..10]
        .iter()
        .map(|&t| (reference[t] - ours[t]).abs())
        .fold(0f32, f32::max)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn greedy_tokens_and_logits_match_candle_quantized_llama() {
    // Quantized weights first, on this thread (candle reads CANDLE_DEQUANTIZE_ALL once per
    // thread); then f32 weights on both sides, in a thread that sees the variable set.
    compare(WeightFormat::Native, QUANTIZED);
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    std::thread::spawn(|| compare(WeightFormat::F32, F32))
        .join()
        .unwrap();
}

fn compare(format: WeightFormat, bounds: Agreement) {
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

        // Every step's logits on the reference's sequence, within the bounds; the same argmax
        // except at near-ties.
        let ours = teacher_forced(&engine, &ids, &ref_tokens);
        let (mut max_diff, mut max_top, mut flips, mut first_flip) = (0f32, 0f32, 0, STEPS);
        for (k, (o, r)) in ours.iter().zip(&ref_logits).enumerate() {
            let (diff, top) = (max_abs_diff(o, r), top_diff(r, o));
            (max_diff, max_top) = (max_diff.max(diff), max_top.max(top));
            assert!(
                diff < bounds.logits && top < bounds.top10,
                "{format:?} prompt {prompt:?} step {k}: logits differ by up to {diff} \
                 ({top} on the top ten); bounds {bounds:?}"
            );
            if argmax(o) != ref_tokens[k] {
                eprintln!(
                    "{format:?} {prompt:?} step {k}: ours picks {} where the reference picks {} \
                     with a lead of {:.3} (top-ten logit diff {top:.3})",
                    argmax(o),
                    ref_tokens[k],
                    margin(r)
                );
                assert!(
                    margin(r) < bounds.near_tie,
                    "{format:?} prompt {prompt:?} step {k}: we pick {} where the reference \
                     picks {} by a lead of {} (not a near-tie under {})",
                    argmax(o),
                    ref_tokens[k],
                    margin(r),
                    bounds.near_tie
                );
                flips += 1;
                first_flip = first_flip.min(k);
            }
        }

        // Free-running greedy generation follows the reference up to the first near-tie.
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
        eprintln!(
            "{format:?} {prompt:?}: over {STEPS} teacher-forced steps logits differ by up to \
             {max_diff:.3e} ({max_top:.3e} on the top ten), {flips} near-tie flips; \
             {same}/{STEPS} free-running greedy tokens equal"
        );
        assert!(
            flips <= bounds.flips,
            "{format:?} prompt {prompt:?}: {flips} near-tie flips (at most {})",
            bounds.flips
        );
        // The same kernels as the teacher-forced steps: generation cannot leave the reference
        // before the first step that picks another token.
        assert!(
            same >= first_flip,
            "{format:?} prompt {prompt:?}: generation left the reference after {same} tokens, \
             before its first near-tie (step {first_flip})"
        );
        if format == WeightFormat::F32 {
            assert_eq!(out[0].tokens, ref_tokens, "{format:?} prompt {prompt:?}");
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
            all_logits: false,
            embeds: Vec::new(),
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
