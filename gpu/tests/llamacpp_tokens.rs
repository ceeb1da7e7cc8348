//! The default model against llama.cpp itself, on the same GGUF.
//!
//! `data/llamacpp_greedy.json` holds, per prompt, the prompt ids from `llama-tokenize` and 40
//! greedy ids from llama.cpp (made by `data/gen_llamacpp_fixture.py`, whose commands the
//! fixture records). With `model.weights = native` pdserve runs the file's Q4_1 weights as
//! stored on its llama.cpp-exact kernels, activations quantized to Q8_1 as llama.cpp does, so
//! its tokens must follow llama.cpp's for at least 32 tokens. (The default, `auto`, keeps the
//! same weight values but sums in another order for speed, and is not held to this.)
//!
//! `data/llamacpp_first_logprobs.json` holds `llama-server`'s top-5 log-probabilities after
//! one-token prompts (the fixture records how they were made). Attention over one position
//! returns its value exactly, so everything left is arithmetic pdserve's native path does in
//! llama.cpp's order: the log-probabilities must agree to the rounding of llama-server's own
//! normalization (an f32 sum over the vocabulary, ~2e-4), not merely rank the same tokens.

use pdserve_gpu::engine::{Engine, EngineOptions, GenRequest};
use pdserve_gpu::fetch::{pull_default_model, Progress};
use pdserve_gpu::loader::load_gguf;
use pdserve_gpu::model::{Batch, SeqChunk};
use pdserve_gpu::sampling::SamplingParams;
use pdserve_gpu::weights::WeightFormat;
use serde::Deserialize;

/// Tokens that must agree with llama.cpp's, per prompt.
const MIN_AGREEING: usize = 32;

#[derive(Deserialize)]
struct Fixture {
    prompts: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    llama_cpp_ids: Vec<u32>,
}

#[test]
fn greedy_tokens_follow_llama_cpp_for_32_tokens() {
    let fixture: Fixture =
        serde_json::from_str(include_str!("data/llamacpp_greedy.json")).expect("fixture parses");
    assert_eq!(fixture.prompts.len(), 3);
    let path = pull_default_model(Progress::Hide).expect("default model");
    let mut engine = Engine::new(
        load_gguf(&path).unwrap(),
        EngineOptions {
            num_blocks: Some(64),
            format: WeightFormat::Native,
            ..Default::default()
        },
    )
    .unwrap();
    for case in &fixture.prompts {
        assert!(case.llama_cpp_ids.len() >= MIN_AGREEING);
        let ours = engine.tokenizer().encode(&case.prompt, false).unwrap();
        assert_eq!(ours, case.prompt_ids, "tokenization of {:?}", case.prompt);
        let mut params = SamplingParams::greedy(case.llama_cpp_ids.len());
        params.ignore_eos = true;
        let out = engine
            .generate(
                &[GenRequest {
                    prompt: case.prompt_ids.clone(),
                    params,
                }],
                &mut |_, _| {},
            )
            .unwrap();
        let same = out[0]
            .tokens
            .iter()
            .zip(&case.llama_cpp_ids)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{:?}: {same}/{} tokens equal to llama.cpp's",
            case.prompt,
            case.llama_cpp_ids.len()
        );
        assert!(
            same >= MIN_AGREEING,
            "{:?}: only {same} tokens agree\n ours: {:?}\n llama.cpp: {:?}",
            case.prompt,
            out[0].tokens,
            case.llama_cpp_ids
        );
    }
    assert_eq!(engine.block_usage().0, 64, "every block back in the pool");
}

#[derive(Deserialize)]
struct LogprobFixture {
    prompts: Vec<LogprobCase>,
}

#[derive(Deserialize)]
struct LogprobCase {
    prompt_ids: Vec<u32>,
    top5: Vec<Alternative>,
}

#[derive(Deserialize)]
struct Alternative {
    id: u32,
    logprob: f32,
}

/// Largest difference allowed from llama-server's log-probabilities: its softmax sums the
/// vocabulary's probabilities in f32, which alone moves every value by up to ~2e-4.
const LOGPROB_TOLERANCE: f32 = 1e-3;

#[test]
fn first_token_logprobs_equal_llama_cpp_s() {
    let fixture: LogprobFixture =
        serde_json::from_str(include_str!("data/llamacpp_first_logprobs.json"))
            .expect("fixture parses");
    assert!(fixture.prompts.len() >= 10);
    let path = pull_default_model(Progress::Hide).expect("default model");
    let engine = Engine::new(
        load_gguf(&path).unwrap(),
        EngineOptions {
            num_blocks: Some(8),
            format: WeightFormat::Native,
            ..Default::default()
        },
    )
    .unwrap();
    for case in &fixture.prompts {
        let batch = Batch {
            seqs: vec![SeqChunk {
                tokens: case.prompt_ids.clone(),
                start_pos: 0,
                block_table: vec![0],
                want_logits: true,
                all_logits: false,
                embeds: Vec::new(),
            }],
        };
        let logits = engine.group().step(batch).unwrap().remove(0);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let log_sum = logits
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .sum::<f64>()
            .ln() as f32
            + max;
        let mut ids: Vec<usize> = (0..logits.len()).collect();
        ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        for (rank, want) in case.top5.iter().enumerate() {
            let got = logits[want.id as usize] - log_sum;
            assert_eq!(
                ids[rank], want.id as usize,
                "prompt {:?}: rank {rank}",
                case.prompt_ids
            );
            assert!(
                (got - want.logprob).abs() <= LOGPROB_TOLERANCE,
                "prompt {:?}: token {} logprob {got} against llama.cpp's {}",
                case.prompt_ids,
                want.id,
                want.logprob
            );
        }
    }
}
