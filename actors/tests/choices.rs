//! `n` > 1 (several choices from one prompt) on one colocated instance over HTTP: choice
//! indices, seeds (choice i samples with seed + i), greedy choices equal to `n` = 1, streamed
//! chunks equal to the whole answer, usage, the prompt's KV shared through the prefix cache,
//! and the 400s. Every test ends with the block pool full. (The disaggregated case is in
//! pd.rs.)

mod common;
use common::{
    assert_pool_full, choice_token_ids, post, post_to, stream_chunks, streamed_choice_token_ids,
};

use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use serde_json::{json, Value};

async fn start(name: &str) -> Instance {
    let model = load_model(&ModelSource::Synthetic("small".into())).unwrap();
    Instance::start(InstanceOptions::local(name, model))
        .await
        .unwrap()
}

/// 40 tokens: two full blocks of 16 (shareable) and a partial one.
fn prompt(salt: u32) -> Vec<u32> {
    (0..40).map(|t| (t * 31 + 11 + salt * 7) % 250).collect()
}

fn body(salt: u32, n: usize, temperature: f64, seed: Option<u64>) -> Value {
    json!({"prompt": prompt(salt), "n": n, "max_tokens": 8, "temperature": temperature,
           "seed": seed, "ignore_eos": true, "return_token_ids": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_seeded_per_choice_deterministic_and_share_the_prompt() {
    let inst = start("choices-n").await;
    let url = inst.url();
    let (status, a) = post(&url, &body(0, 4, 1.0, Some(5))).await;
    assert_eq!(status, 200, "{a}");
    let answers = choice_token_ids(&a);
    assert_eq!(answers.len(), 4, "{a}");
    assert!(answers.iter().all(|t| t.len() == 8), "{a}");
    // Usage: the prompt once, every choice's completion.
    assert_eq!(a["usage"]["prompt_tokens"], json!(40), "{a}");
    assert_eq!(a["usage"]["completion_tokens"], json!(32), "{a}");
    assert_eq!(a["usage"]["total_tokens"], json!(72), "{a}");
    // Deterministic across runs; choice i is the request with seed 5 + i.
    let (status, b) = post(&url, &body(0, 4, 1.0, Some(5))).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(choice_token_ids(&b), answers);
    for (i, want) in answers.iter().enumerate() {
        let (status, one) = post(&url, &body(0, 1, 1.0, Some(5 + i as u64))).await;
        assert_eq!(status, 200, "{one}");
        assert_eq!(&choice_token_ids(&one)[0], want, "choice {i}");
    }
    let distinct: std::collections::BTreeSet<_> = answers.iter().collect();
    assert!(distinct.len() > 1, "four seeds, one answer: {answers:?}");

    // Greedy: every choice is the n = 1 answer.
    let (status, one) = post(&url, &body(1, 1, 0.0, None)).await;
    assert_eq!(status, 200, "{one}");
    let (status, two) = post(&url, &body(1, 2, 0.0, None)).await;
    assert_eq!(status, 200, "{two}");
    let two = choice_token_ids(&two);
    assert_eq!(two, vec![choice_token_ids(&one)[0].clone(); 2]);

    // The other choices take the first's full prompt blocks from the prefix cache.
    let before = inst.stats().await.unwrap().prompt_tokens_cached;
    let (status, v) = post(&url, &body(2, 4, 1.0, Some(9))).await;
    assert_eq!(status, 200, "{v}");
    let cached = inst.stats().await.unwrap().prompt_tokens_cached - before;
    assert_eq!(
        cached,
        3 * 32,
        "choices 1..4 reuse the two full prompt blocks"
    );
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_choices_carry_their_index_and_equal_the_whole_answer() {
    let inst = start("choices-stream").await;
    let url = inst.url();
    let whole_body = body(3, 3, 0.8, Some(11));
    let (status, whole) = post(&url, &whole_body).await;
    assert_eq!(status, 200, "{whole}");
    let mut streamed = whole_body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = stream_chunks(&url, "/v1/completions", &streamed).await;
    let mut text = vec![String::new(); 3];
    let mut finished = [0; 3];
    let mut usage = Vec::new();
    for c in &chunks {
        if let Some(u) = c.get("usage").filter(|u| !u.is_null()) {
            usage.push(u.clone());
            continue;
        }
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        text[i].push_str(choice["text"].as_str().unwrap());
        if !choice["finish_reason"].is_null() {
            finished[i] += 1;
        }
    }
    assert_eq!(
        streamed_choice_token_ids(&chunks, 3),
        choice_token_ids(&whole)
    );
    for (i, t) in text.iter().enumerate() {
        assert_eq!(
            t,
            whole["choices"][i]["text"].as_str().unwrap(),
            "choice {i}"
        );
    }
    assert_eq!(finished, [1, 1, 1], "one finish per choice");
    assert_eq!(usage.len(), 1, "one usage chunk, at the end: {chunks:?}");
    // (The streamed request's first choice finds the prompt cached: only the counts match.)
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage[0][k], whole["usage"][k], "{k}");
    }
    assert!(
        chunks.last().unwrap().get("usage").is_some(),
        "usage comes last"
    );

    // Chat: each choice opens with its own role delta and ends with its own finish.
    let chat = json!({"messages": [{"role": "user", "content": "pick a word"}], "n": 2,
        "max_tokens": 5, "temperature": 1.0, "seed": 3, "stream": true});
    let chunks = stream_chunks(&url, "/v1/chat/completions", &chat).await;
    for i in 0..2 {
        let mine: Vec<_> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == json!(i))
            .collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant", "{i}");
        assert!(!mine.last().unwrap()["choices"][0]["finish_reason"].is_null());
    }
    let mut whole_chat = chat.clone();
    whole_chat["stream"] = json!(false);
    let (status, v) = post_to(&url, "/v1/chat/completions", &whole_chat).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["choices"][1]["index"], 1, "{v}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_n_and_best_of_are_400s_naming_the_field() {
    let inst = start("choices-bad").await;
    for (extra, needle) in [
        (json!({"n": 17}), "`n`"),
        (json!({"n": 0}), "`n`"),
        (json!({"n": -1}), "`n`"),
        (json!({"n": 2, "best_of": 4}), "`best_of`"),
        (json!({"n": 2, "resume_tokens": [1]}), "`resume_tokens`"),
    ] {
        let mut b = body(0, 1, 1.0, Some(1));
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (status, v) = post(&inst.url(), &b).await;
        assert_eq!(status, 400, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{extra}: {v}");
    }
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_prompts_answers_prompt_major_equal_to_one_request_each() {
    let inst = start("choices-batch").await;
    let url = inst.url();
    let prompts = [prompt(4), prompt(5), prompt(6)];
    let b = json!({"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 8,
                   "ignore_eos": true, "return_token_ids": true});
    let (status, v) = post(&url, &b).await;
    assert_eq!(status, 200, "{v}");
    let got = choice_token_ids(&v);
    assert_eq!(got.len(), 6, "{v}");
    // Choice j * n + i is prompt j's choice i (seed + i), as its own request answers it.
    for (j, p) in prompts.iter().enumerate() {
        let one = json!({"prompt": p, "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 8,
                         "ignore_eos": true, "return_token_ids": true});
        let (status, w) = post(&url, &one).await;
        assert_eq!(status, 200, "{w}");
        assert_eq!(
            got[2 * j..2 * j + 2],
            choice_token_ids(&w)[..],
            "prompt {j}"
        );
    }
    assert_eq!(v["usage"]["prompt_tokens"], json!(120), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], json!(36), "{v}");
    // Streamed: the same, per index; one usage chunk.
    let mut s = b.clone();
    s["stream"] = json!(true);
    s["stream_options"] = json!({"include_usage": true});
    let chunks = stream_chunks(&url, "/v1/completions", &s).await;
    assert_eq!(streamed_choice_token_ids(&chunks, 6), got);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], json!(120), "{usage}");
    assert_eq!(usage["completion_tokens"], json!(36), "{usage}");
    // A bad prompt anywhere in the list refuses the request, and nothing stays allocated.
    let bad = json!({"prompt": [prompt(1), [1_000_000]], "max_tokens": 2});
    let (status, v) = post(&url, &bad).await;
    assert_eq!(status, 400, "{v}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}
