//! `pdserve bench serve`: a serving load generator for any OpenAI-compatible server, in the
//! manner of vLLM's `benchmark_serving`.
//!
//! It sends streamed `/v1/completions` (or `/v1/chat/completions`) requests under a closed loop
//! (`--concurrency N` workers), an open loop (`--request-rate R`, Poisson arrivals), or both (a
//! Poisson open loop capped at N in flight), bounded by a request count and a wall-clock time, and
//! reports TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99), request and token
//! throughput, and goodput under the SLOs given as flags. With neither `--concurrency` nor
//! `--request-rate`, requests are sent one at a time (concurrency 1).
//!
//! What is measured, per request (times from just before the request is sent):
//! - **TTFT**: arrival of the first SSE chunk that carries non-empty content (`choices[].text`
//!   for completions, `choices[].delta.content` / `reasoning_content` for chat). Role-only and
//!   usage-only chunks, comments and keep-alives do not count.
//! - **ITL**: the gaps between consecutive content chunks after the first. Chunks that arrive in
//!   one network read share one timestamp (their gap is 0), as in vLLM's client.
//! - **TPOT**: `(e2e − TTFT) / (output_tokens − 1)`, for requests with at least 2 output tokens.
//! - **Output tokens**: `usage.completion_tokens` of the stream (we always ask for it with
//!   `stream_options.include_usage`); if the server sends no usage, the number of content chunks.
//! - **Input tokens**: `usage.prompt_tokens`; if absent, the approximate prompt length we aimed at.
//!
//! Synthetic prompts are made of common English words, one word per wanted token, so their
//! length in tokens is **approximate** (a chat template adds its own tokens); token throughput
//! uses the server's reported usage. Every request sets `ignore_eos: true` (a vLLM extension) and
//! `min_tokens = max_tokens`, so servers that honour them produce exactly `max_tokens` tokens;
//! others may stop early, which the reported usage shows.
//!
//! The module is the whole client: [`BenchServeArgs`] and [`run`] are the CLI entry; [`run_bench`]
//! is the library-style entry used by tests; the measurable logic (SSE parsing, per-request
//! accounting, percentiles, goodput, Poisson schedule, report formatting) lives in pure functions
//! with unit tests below.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// How many error messages the report keeps (the first ones, in completion order).
const MAX_REPORTED_ERRORS: usize = 8;
/// Error bodies are cut to this many characters in the report.
const MAX_ERROR_CHARS: usize = 300;
/// Bound on connecting to the server (the per-request timeout bounds the whole request).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for the end of a body after `[DONE]` (to reuse the connection).
const DRAIN_TIMEOUT: Duration = Duration::from_millis(500);
/// Seed offset of the length/prompt generator, so that changing the arrival process (rate or not)
/// does not change the prompts of a given `--seed`.
const PROMPT_SEED_SALT: u64 = 0x9e37_79b9_7f4a_7c15;

/// Common English words that most BPE tokenizers (Llama, SmolLM2, Qwen, GPT) encode as one token
/// each when preceded by a space.
const PROMPT_WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "for", "that", "with", "on", "as", "it", "by", "at",
    "from", "this", "be", "are", "was", "or", "an", "have", "not", "but", "can", "all", "one",
    "time", "new", "we", "more", "will", "about", "out", "up", "so", "what", "there", "people",
    "year", "work", "day", "way", "world", "life", "house", "water", "food", "city", "book",
    "school", "family", "music", "light", "small", "great", "good", "long", "place", "hand",
    "number", "story", "river", "tree",
];

/// Which OpenAI-compatible route to drive.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST {url}/v1/completions` with `prompt`.
    Completions,
    /// `POST {url}/v1/chat/completions` with one user message.
    Chat,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// An inclusive length range `A:B`, drawn from uniformly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LenRange {
    /// Smallest length (inclusive).
    pub min: usize,
    /// Largest length (inclusive).
    pub max: usize,
}

/// Why a length range (`A:B`) was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LenRangeError {
    /// The text has no `:`.
    #[error("expected A:B, got {0:?}")]
    NotARange(String),
    /// One end is not a whole number.
    #[error("bad range {end} {text:?}: {source}")]
    NotANumber {
        /// `start` or `end`.
        end: &'static str,
        /// That end's text.
        text: String,
        /// Why it does not parse.
        source: std::num::ParseIntError,
    },
    /// The start is above the end.
    #[error("range start {min} is above its end {max}")]
    Reversed {
        /// The start.
        min: usize,
        /// The end.
        max: usize,
    },
}

impl std::str::FromStr for LenRange {
    type Err = LenRangeError;
    fn from_str(s: &str) -> std::result::Result<Self, LenRangeError> {
        let (a, b) = s
            .split_once(':')
            .ok_or_else(|| LenRangeError::NotARange(s.to_string()))?;
        let number = |end, text: &str| {
            text.trim()
                .parse()
                .map_err(|source| LenRangeError::NotANumber {
                    end,
                    text: text.to_string(),
                    source,
                })
        };
        let min = number("start", a)?;
        let max = number("end", b)?;
        if min > max {
            return Err(LenRangeError::Reversed { min, max });
        }
        Ok(LenRange { min, max })
    }
}

/// A prompt or output length: fixed, or uniform in an inclusive range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LenSpec {
    /// Always this many tokens.
    Fixed(usize),
    /// Uniform in `[min, max]`.
    Range(LenRange),
}

impl LenSpec {
    fn sample(self, rng: &mut StdRng) -> usize {
        match self {
            LenSpec::Fixed(n) => n,
            LenSpec::Range(r) => rng.random_range(r.min..=r.max),
        }
    }

    fn min(self) -> usize {
        match self {
            LenSpec::Fixed(n) => n,
            LenSpec::Range(r) => r.min,
        }
    }
}

/// `pdserve bench serve`: load-test an OpenAI-compatible server.
#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// Base URL of the server (plain http), e.g. http://127.0.0.1:8000; a trailing /v1 is ignored.
    #[arg(long)]
    pub url: String,
    /// Route to drive: completions (/v1/completions) or chat (/v1/chat/completions).
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// Model name to send (default: the first id of GET {url}/v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// API key, sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Closed loop: at most N requests in flight (with --request-rate: a cap on in-flight
    /// requests). With neither flag, 1.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Open loop: Poisson arrivals at R requests per second.
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Seed of the arrival process and of random lengths and prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop issuing after this many requests.
    #[arg(long, default_value_t = 64)]
    pub num_requests: usize,
    /// Stop issuing after this many seconds (in-flight requests still finish).
    #[arg(long, default_value_t = 300.0)]
    pub duration_s: f64,
    /// Per-request timeout in seconds (a request past it counts as failed).
    #[arg(long, default_value_t = 300.0)]
    pub timeout_s: f64,
    /// Prompt length in tokens (approximate: synthetic words). Default 256.
    #[arg(long, conflicts_with_all = ["input_len_range", "dataset"])]
    pub input_len: Option<usize>,
    /// Prompt length uniform in A:B tokens (approximate).
    #[arg(long, conflicts_with = "dataset")]
    pub input_len_range: Option<LenRange>,
    /// Output tokens per request (max_tokens = min_tokens). Default 64.
    #[arg(long, conflicts_with = "output_len_range")]
    pub output_len: Option<usize>,
    /// Output tokens uniform in A:B.
    #[arg(long)]
    pub output_len_range: Option<LenRange>,
    /// JSONL file of prompts: one `{"prompt": "...", "output_len": 128}` per line (output_len
    /// optional; default from --output-len). Used in order, cycling if there are fewer lines
    /// than requests.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Multi-turn workload: this many chat sessions sharing one system prompt; request `i`
    /// is turn `i / N + 1` of session `i % N`, its prompt the system prompt plus that
    /// session's user turns so far (the answers are not replayed: each turn extends the
    /// previous turn's prompt, which is what prefix caching reuses).
    #[arg(long, conflicts_with_all = ["dataset", "input_len", "input_len_range"])]
    pub multi_turn_sessions: Option<usize>,
    /// Multi-turn: tokens of the shared system prompt (approximate). Default 1024.
    #[arg(long, requires = "multi_turn_sessions")]
    pub system_prompt_len: Option<usize>,
    /// Multi-turn: tokens of each user turn (approximate). Default 64.
    #[arg(long, requires = "multi_turn_sessions")]
    pub turn_len: Option<usize>,
    /// Multi-turn: tokens of each session's own context (a document, tool output...) after
    /// the system prompt, before its first user turn (approximate). Default 0.
    #[arg(long, requires = "multi_turn_sessions")]
    pub session_context_len: Option<usize>,
    /// Start at request index K of the sequence: with `--multi-turn-sessions N`, `--first-request
    /// N` sends the sessions' second turns first (a run split in parts, e.g. around an
    /// instance restart, continues where the previous part ended).
    #[arg(long, default_value_t = 0)]
    pub first_request: usize,
    /// SLO on time to first token (ms) for goodput.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// SLO on time per output token (ms) for goodput.
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// SLO on end-to-end latency (ms) for goodput.
    #[arg(long)]
    pub slo_e2e_ms: Option<f64>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write every successful answer's text to FILE, one JSON object per line
    /// (`{"index": i, "text": ...}`, by request index): two runs of one greedy workload can
    /// then be compared answer by answer.
    #[arg(long, value_name = "FILE")]
    pub answers: Option<PathBuf>,
}

/// Service-level objectives for goodput; `None` is not checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Slo {
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Time per output token, ms.
    pub tpot_ms: Option<f64>,
    /// End-to-end latency, ms.
    pub e2e_ms: Option<f64>,
}

/// One line of a `--dataset` JSONL file.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct DatasetEntry {
    /// Prompt text (sent as is).
    pub prompt: String,
    /// Output tokens wanted; `None` takes the configured output length.
    #[serde(default)]
    pub output_len: Option<usize>,
}

/// Where prompts come from.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptSource {
    /// Synthetic prompts of approximately this many tokens.
    Synthetic(LenSpec),
    /// Prompts of a dataset, in order, cycling.
    Dataset(Vec<DatasetEntry>),
    /// Chat sessions sharing a system prompt (see [`BenchServeArgs::multi_turn_sessions`]).
    MultiTurn {
        /// Sessions.
        sessions: usize,
        /// Tokens of the shared system prompt.
        system_len: usize,
        /// Tokens per user turn.
        turn_len: usize,
        /// Tokens of each session's own context before its first turn.
        context_len: usize,
    },
}

/// A validated benchmark configuration (what [`BenchServeArgs`] becomes).
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Base URL, without a trailing `/` or `/v1`.
    pub url: String,
    /// Route to drive.
    pub endpoint: Endpoint,
    /// Model to send; `None` asks `/v1/models`.
    pub model: Option<String>,
    /// Bearer token.
    pub api_key: Option<String>,
    /// Cap on requests in flight; `None` with no rate sends all requests at once.
    pub concurrency: Option<usize>,
    /// Poisson arrival rate (req/s); `None` issues as fast as the concurrency cap allows.
    pub request_rate: Option<f64>,
    /// Seed of arrivals, lengths and prompts.
    pub seed: u64,
    /// Requests to issue at most.
    pub num_requests: usize,
    /// Index of the first request in the prompt sequence.
    pub first_request: usize,
    /// Time after which no request is issued.
    pub duration: Duration,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Prompt source.
    pub prompts: PromptSource,
    /// Output length (dataset entries may override it).
    pub output_len: LenSpec,
    /// Goodput SLOs.
    pub slo: Slo,
}

impl BenchConfig {
    /// Builds a configuration from the command line, reading `--dataset` if given.
    ///
    /// # Errors
    /// An unreadable or malformed dataset, or an invalid value (see [`BenchConfig::validate`]).
    pub fn from_args(args: &BenchServeArgs) -> Result<BenchConfig> {
        let prompts = match &args.dataset {
            None if args.multi_turn_sessions.is_some() => PromptSource::MultiTurn {
                sessions: args.multi_turn_sessions.unwrap_or(1),
                system_len: args.system_prompt_len.unwrap_or(1024),
                turn_len: args.turn_len.unwrap_or(64),
                context_len: args.session_context_len.unwrap_or(0),
            },
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading dataset {}", path.display()))?;
                let entries = parse_dataset(&text)
                    .with_context(|| format!("parsing dataset {}", path.display()))?;
                PromptSource::Dataset(entries)
            }
            None => PromptSource::Synthetic(match (args.input_len, args.input_len_range) {
                (_, Some(r)) => LenSpec::Range(r),
                (Some(n), None) => LenSpec::Fixed(n),
                (None, None) => LenSpec::Fixed(256),
            }),
        };
        let output_len = match (args.output_len, args.output_len_range) {
            (_, Some(r)) => LenSpec::Range(r),
            (Some(n), None) => LenSpec::Fixed(n),
            (None, None) => LenSpec::Fixed(64),
        };
        let concurrency = match (args.concurrency, args.request_rate) {
            (None, None) => Some(1),
            (c, _) => c,
        };
        let cfg = BenchConfig {
            url: normalize_base_url(&args.url),
            endpoint: args.endpoint,
            model: args.model.clone(),
            api_key: args.api_key.clone(),
            concurrency,
            request_rate: args.request_rate,
            seed: args.seed,
            num_requests: args.num_requests,
            first_request: args.first_request,
            duration: secs("--duration-s", args.duration_s)?,
            request_timeout: secs("--timeout-s", args.timeout_s)?,
            prompts,
            output_len,
            slo: Slo {
                ttft_ms: args.slo_ttft_ms,
                tpot_ms: args.slo_tpot_ms,
                e2e_ms: args.slo_e2e_ms,
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks values that would make the run meaningless.
    ///
    /// # Errors
    /// A zero request count, concurrency or output length, a non-positive or non-finite rate,
    /// a zero duration or timeout, an empty dataset, or a URL that is not plain `http://`.
    pub fn validate(&self) -> Result<()> {
        if !self.url.starts_with("http://") {
            bail!("--url must be a plain http:// URL (got {:?})", self.url);
        }
        if self.num_requests == 0 {
            bail!("--num-requests must be at least 1");
        }
        if self.concurrency == Some(0) {
            bail!("--concurrency must be at least 1");
        }
        if let Some(r) = self.request_rate {
            if !(r.is_finite() && r > 0.0) {
                bail!("--request-rate must be a positive number (got {r})");
            }
        }
        if self.duration.is_zero() || self.request_timeout.is_zero() {
            bail!("--duration-s and --timeout-s must be positive");
        }
        if self.output_len.min() == 0 {
            bail!("output length must be at least 1 token");
        }
        match &self.prompts {
            PromptSource::Synthetic(len) if len.min() == 0 => {
                bail!("input length must be at least 1 token")
            }
            PromptSource::Dataset(entries) if entries.is_empty() => bail!("the dataset is empty"),
            PromptSource::Dataset(entries) if entries.iter().any(|e| e.output_len == Some(0)) => {
                bail!("dataset output_len must be at least 1")
            }
            PromptSource::MultiTurn {
                sessions,
                system_len,
                turn_len,
                context_len,
            } if *sessions == 0 || *system_len + *turn_len + *context_len == 0 => {
                bail!("--multi-turn-sessions and the prompt lengths must be at least 1")
            }
            _ => {}
        }
        for (name, v) in [
            ("--slo-ttft-ms", self.slo.ttft_ms),
            ("--slo-tpot-ms", self.slo.tpot_ms),
            ("--slo-e2e-ms", self.slo.e2e_ms),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v >= 0.0) {
                    bail!("{name} must be a non-negative number (got {v})");
                }
            }
        }
        Ok(())
    }
}

fn secs(flag: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s).map_err(|e| anyhow::anyhow!("{flag} {s}: {e}"))
}

/// Strips trailing `/` and a trailing `/v1` from a base URL.
pub fn normalize_base_url(url: &str) -> String {
    let u = url.trim().trim_end_matches('/');
    u.strip_suffix("/v1")
        .unwrap_or(u)
        .trim_end_matches('/')
        .to_string()
}

/// Parses a JSONL dataset: one object per non-blank line with a `prompt` string and an optional
/// `output_len`; other fields are ignored.
///
/// # Errors
/// A line that is not such an object (the error names the line), or no entries at all.
pub fn parse_dataset(text: &str) -> Result<Vec<DatasetEntry>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let entry: DatasetEntry =
            serde_json::from_str(line).with_context(|| format!("line {}", i + 1))?;
        out.push(entry);
    }
    if out.is_empty() {
        bail!("no entries");
    }
    Ok(out)
}

/// Synthetic prompt text of approximately `tokens` tokens: that many common words.
pub fn synthetic_prompt(rng: &mut StdRng, tokens: usize) -> String {
    let mut s = String::with_capacity(tokens * 6);
    for i in 0..tokens {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(PROMPT_WORDS[rng.random_range(0..PROMPT_WORDS.len())]);
    }
    s
}

/// Token lengths of a multi-turn workload's prompt parts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TurnShape {
    /// The shared system prompt.
    pub system_len: usize,
    /// Each session's own context, after the system prompt.
    pub context_len: usize,
    /// Each user turn.
    pub turn_len: usize,
}

/// The prompt of turn `turns` (from 1) of chat `session`: the shared system prompt, the
/// session's own context (when `shape.context_len > 0`), then the session's first `turns`
/// user turns, each its own seeded synthetic words. Turn `t + 1` extends turn `t`'s prompt,
/// so a prefix cache can reuse all of it.
pub fn multi_turn_prompt(seed: u64, shape: TurnShape, session: usize, turns: usize) -> String {
    let mut rng = StdRng::seed_from_u64(seed ^ PROMPT_SEED_SALT ^ 0x5157_u64);
    let mut s = synthetic_prompt(&mut rng, shape.system_len);
    let turn_len = shape.turn_len;
    if shape.context_len > 0 {
        let mut rng = StdRng::seed_from_u64(
            (seed ^ PROMPT_SEED_SALT ^ 0xC0_17E7).wrapping_add((session as u64) << 32),
        );
        s.push_str("\nContext: ");
        s.push_str(&synthetic_prompt(&mut rng, shape.context_len));
    }
    for t in 0..turns {
        let mut rng = StdRng::seed_from_u64(
            (seed ^ PROMPT_SEED_SALT)
                .wrapping_add((session as u64) << 32)
                .wrapping_add(t as u64 + 1),
        );
        s.push_str("\nUser: ");
        s.push_str(&synthetic_prompt(&mut rng, turn_len));
    }
    s
}

/// One request to send.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSpec {
    /// Index in issue order.
    pub index: usize,
    /// Prompt text.
    pub prompt: String,
    /// Prompt tokens we aimed at (used when the server reports no usage).
    pub approx_prompt_tokens: usize,
    /// `max_tokens` (and `min_tokens`).
    pub max_tokens: usize,
}

/// Produces the request specs of a run, deterministically from the seed.
#[derive(Debug)]
pub struct RequestGenerator {
    rng: StdRng,
    seed: u64,
    prompts: PromptSource,
    output_len: LenSpec,
    next: usize,
}

impl RequestGenerator {
    /// A generator for `cfg`'s prompts and lengths, from request `cfg.first_request` of the
    /// sequence on (the earlier ones are drawn and dropped, so a part of a split run sends
    /// what the whole run would have).
    pub fn new(cfg: &BenchConfig) -> Self {
        let mut g = RequestGenerator {
            rng: StdRng::seed_from_u64(cfg.seed ^ PROMPT_SEED_SALT),
            seed: cfg.seed,
            prompts: cfg.prompts.clone(),
            output_len: cfg.output_len,
            next: 0,
        };
        for _ in 0..cfg.first_request {
            g.next();
        }
        g
    }
}

impl Iterator for RequestGenerator {
    type Item = RequestSpec;
    fn next(&mut self) -> Option<RequestSpec> {
        let index = self.next;
        self.next += 1;
        let (prompt, approx_prompt_tokens, out) = match &self.prompts {
            PromptSource::Synthetic(len) => {
                let n = len.sample(&mut self.rng);
                (synthetic_prompt(&mut self.rng, n), n, None)
            }
            PromptSource::Dataset(entries) => {
                let e = &entries[index % entries.len()];
                (
                    e.prompt.clone(),
                    e.prompt.split_whitespace().count(),
                    e.output_len,
                )
            }
            PromptSource::MultiTurn {
                sessions,
                system_len,
                turn_len,
                context_len,
            } => {
                let (session, turns) = (index % sessions, index / sessions + 1);
                let shape = TurnShape {
                    system_len: *system_len,
                    context_len: *context_len,
                    turn_len: *turn_len,
                };
                (
                    multi_turn_prompt(self.seed, shape, session, turns),
                    system_len + context_len + turns * turn_len,
                    None,
                )
            }
        };
        let max_tokens = out.unwrap_or_else(|| self.output_len.sample(&mut self.rng));
        Some(RequestSpec {
            index,
            prompt,
            approx_prompt_tokens,
            max_tokens,
        })
    }
}

/// Poisson arrival times: offsets in seconds from the start, with exponential gaps of mean
/// `1 / rate`, seeded.
#[derive(Debug)]
pub struct PoissonArrivals {
    rng: StdRng,
    rate: f64,
    t: f64,
}

impl PoissonArrivals {
    /// Arrivals at `rate` per second (must be positive).
    pub fn new(rate: f64, seed: u64) -> Self {
        PoissonArrivals {
            rng: StdRng::seed_from_u64(seed),
            rate,
            t: 0.0,
        }
    }
}

impl Iterator for PoissonArrivals {
    type Item = f64;
    fn next(&mut self) -> Option<f64> {
        // Inverse CDF of the exponential; 1 - u lies in (0, 1], so ln is finite.
        let u: f64 = self.rng.random();
        self.t += -(1.0 - u).ln() / self.rate;
        Some(self.t)
    }
}

/// The request body for `endpoint`.
pub fn request_body(endpoint: Endpoint, model: &str, spec: &RequestSpec) -> Value {
    #[derive(serde::Serialize)]
    struct Body<'a> {
        model: &'a str,
        max_tokens: usize,
        min_tokens: usize,
        ignore_eos: bool,
        temperature: f64,
        stream: bool,
        stream_options: Value,
        #[serde(skip_serializing_if = "Option::is_none")]
        prompt: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        messages: Option<Value>,
    }
    let (prompt, messages) = match endpoint {
        Endpoint::Completions => (Some(spec.prompt.as_str()), None),
        Endpoint::Chat => (
            None,
            Some(json!([{ "role": "user", "content": spec.prompt }])),
        ),
    };
    let body = Body {
        model,
        max_tokens: spec.max_tokens,
        min_tokens: spec.max_tokens,
        ignore_eos: true,
        temperature: 0.0,
        stream: true,
        stream_options: json!({ "include_usage": true }),
        prompt,
        messages,
    };
    // Plain fields and string keys: serializing cannot fail.
    serde_json::to_value(body).unwrap_or_default()
}

/// One Server-Sent Event's payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseEvent {
    /// The `data:` lines of one event, joined by `\n`.
    Data(String),
    /// `data: [DONE]`, the OpenAI end-of-stream marker.
    Done,
}

/// Incremental SSE parser: feed it bytes as they arrive, in any split; it returns the complete
/// events. Comments (`: keep-alive`) and fields other than `data` are skipped; lines end in `\n`
/// or `\r\n`.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Adds bytes; returns the events they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut consumed = 0;
        while let Some(pos) = self.buf[consumed..].iter().position(|&b| b == b'\n') {
            let mut line = &self.buf[consumed..consumed + pos];
            if let Some(l) = line.strip_suffix(b"\r") {
                line = l;
            }
            let line = String::from_utf8_lossy(line).into_owned();
            consumed += pos + 1;
            self.line(&line, &mut out);
        }
        self.buf.drain(..consumed);
        out
    }

    /// Ends the stream: a last event that was not followed by a blank line is returned too.
    pub fn finish(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            let line = String::from_utf8_lossy(&rest);
            let line = line.strip_suffix('\r').unwrap_or(&line).to_string();
            self.line(&line, &mut out);
        }
        self.line("", &mut out);
        out
    }

    fn line(&mut self, line: &str, out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                out.push(if data.trim() == "[DONE]" {
                    SseEvent::Done
                } else {
                    SseEvent::Data(data)
                });
            }
            return;
        }
        if line.starts_with(':') {
            return; // comment / keep-alive
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
    }
}

/// What one request measured. Times are seconds since the request was sent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestRecord {
    /// Index in issue order.
    pub index: usize,
    /// `None` on success; the HTTP status and body, the transport error, the in-stream error or
    /// the timeout otherwise.
    pub error: Option<String>,
    /// Time to the first content chunk.
    pub ttft: Option<f64>,
    /// Gaps between consecutive content chunks after the first.
    pub itl: Vec<f64>,
    /// End-to-end latency (until the stream ended, or the failure).
    pub e2e: f64,
    /// Output tokens (usage, or content chunks counted).
    pub output_tokens: u64,
    /// Prompt tokens (usage, or the approximate prompt length).
    pub prompt_tokens: u64,
    /// Whether the server reported usage.
    pub usage_reported: bool,
    /// Prompt tokens the server served from its prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`), when it said.
    pub cached_tokens: Option<u64>,
    /// The answer's text: every content chunk's, in order.
    pub text: String,
}

impl RequestRecord {
    /// Time per output token after the first, if there were at least two output tokens.
    pub fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft?;
        (self.output_tokens > 1).then(|| (self.e2e - ttft) / (self.output_tokens - 1) as f64)
    }

    /// A failed record.
    pub fn failed(index: usize, e2e: f64, error: String) -> Self {
        RequestRecord {
            index,
            error: Some(error),
            e2e,
            ..Default::default()
        }
    }
}

/// Why one streamed request failed (its [`RequestRecord::error`], in words).
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The request could not be sent, or its answer's head not read.
    #[error("transport error: {}", error_chain(.0))]
    Transport(reqwest::Error),
    /// The answer's body broke off.
    #[error("transport error mid-stream: {}", error_chain(.0))]
    MidStream(reqwest::Error),
    /// The server answered with an error status.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status.
        status: reqwest::StatusCode,
        /// The start of its body.
        body: String,
    },
    /// A stream event whose data is not JSON.
    #[error("bad stream chunk ({source}): {data}")]
    BadChunk {
        /// The parse error.
        source: serde_json::Error,
        /// The start of the data.
        data: String,
    },
    /// The server sent an error object inside the stream.
    #[error("error in stream: {0}")]
    Server(String),
}

/// Whether to keep reading a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// More events may come.
    Continue,
    /// `[DONE]` seen.
    Done,
}

/// Accounts one streamed answer, event by event (pure: times are passed in).
#[derive(Debug, Default)]
pub struct StreamAccumulator {
    content_times: Vec<f64>,
    completion_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    text: String,
    done: bool,
}

impl StreamAccumulator {
    /// Takes one event that arrived at `t`.
    ///
    /// # Errors
    /// The server's message when the event is an error object, or a parse error for data that
    /// is not JSON.
    pub fn on_event(&mut self, event: &SseEvent, t: f64) -> std::result::Result<Flow, StreamError> {
        let data = match event {
            SseEvent::Done => {
                self.done = true;
                return Ok(Flow::Done);
            }
            SseEvent::Data(d) => d,
        };
        let v: Value = serde_json::from_str(data).map_err(|source| StreamError::BadChunk {
            source,
            data: truncate(data, MAX_ERROR_CHARS),
        })?;
        // Read through the `Value`: a chunk that is no object has none of these fields (serde's
        // structs would take a list).
        let chunk = match v.is_object().then(|| StreamChunk::deserialize(&v)) {
            Some(Ok(chunk)) => chunk,
            _ => StreamChunk::default(),
        };
        if let Some(msg) = stream_error_message(&chunk) {
            return Err(StreamError::Server(truncate(&msg, MAX_ERROR_CHARS)));
        }
        if chunk_has_content(&chunk) {
            self.content_times.push(t);
            append_content(&chunk, &mut self.text);
        }
        if let Some(u) = chunk.usage.and_then(Loose::get) {
            if let Some(c) = u.completion_tokens.and_then(Loose::get) {
                self.completion_tokens = Some(c);
            }
            if let Some(p) = u.prompt_tokens.and_then(Loose::get) {
                self.prompt_tokens = Some(p);
            }
            let cached = u.prompt_tokens_details.and_then(Loose::get);
            if let Some(c) = cached.and_then(|d| d.cached_tokens).and_then(Loose::get) {
                self.cached_tokens = Some(c);
            }
        }
        Ok(Flow::Continue)
    }

    /// The record of a stream that ended at `t`.
    pub fn finish(self, index: usize, t: f64, approx_prompt_tokens: usize) -> RequestRecord {
        if !self.done && self.content_times.is_empty() && self.completion_tokens.is_none() {
            return RequestRecord::failed(index, t, "stream ended before any data".to_string());
        }
        let itl = self.content_times.windows(2).map(|w| w[1] - w[0]).collect();
        RequestRecord {
            index,
            error: None,
            ttft: self.content_times.first().copied(),
            itl,
            e2e: t,
            output_tokens: self
                .completion_tokens
                .unwrap_or(self.content_times.len() as u64),
            prompt_tokens: self.prompt_tokens.unwrap_or(approx_prompt_tokens as u64),
            usage_reported: self.completion_tokens.is_some(),
            cached_tokens: self.cached_tokens,
            text: self.text,
        }
    }
}

/// A field of a server's JSON read when it has its type; another type reads as absent.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Loose<T> {
    Is(T),
    Other(serde::de::IgnoredAny),
}

impl<T> Loose<T> {
    fn get(self) -> Option<T> {
        match self {
            Self::Is(t) => Some(t),
            Self::Other(_) => None,
        }
    }
}

/// The fields of a streamed chunk the load generator reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamChunk {
    error: Option<ChunkError>,
    object: Option<Loose<String>>,
    message: Option<Loose<String>>,
    choices: Option<Loose<Vec<Loose<ChunkChoice>>>>,
    usage: Option<Loose<ChunkUsage>>,
}

/// A chunk's `error`: `{"message": ...}`, a string, or anything else (shown as JSON).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChunkError {
    Text(String),
    Object(ErrorObject),
    Other(Value),
}

#[derive(Debug, Deserialize)]
struct ErrorObject {
    message: String,
}

#[derive(Debug, Deserialize)]
struct ChunkChoice {
    text: Option<Loose<String>>,
    delta: Option<Loose<ChunkDelta>>,
}

#[derive(Debug, Deserialize)]
struct ChunkDelta {
    content: Option<Loose<String>>,
    reasoning_content: Option<Loose<String>>,
    reasoning: Option<Loose<String>>,
}

#[derive(Debug, Deserialize)]
struct ChunkUsage {
    completion_tokens: Option<Loose<u64>>,
    prompt_tokens: Option<Loose<u64>>,
    prompt_tokens_details: Option<Loose<PromptTokensDetails>>,
}

#[derive(Debug, Deserialize)]
struct PromptTokensDetails {
    cached_tokens: Option<Loose<u64>>,
}

/// An error object sent inside a stream: `{"error": {...}}`, `{"error": "..."}` or vLLM's
/// `{"object": "error", "message": ...}`.
fn stream_error_message(v: &StreamChunk) -> Option<String> {
    if let Some(e) = &v.error {
        return Some(match e {
            ChunkError::Object(o) => o.message.clone(),
            ChunkError::Text(m) => m.clone(),
            ChunkError::Other(e) => e.to_string(),
        });
    }
    if matches!(&v.object, Some(Loose::Is(o)) if o == "error") {
        return Some(match &v.message {
            Some(Loose::Is(m)) => m.clone(),
            _ => "unknown error".to_string(),
        });
    }
    None
}

/// Whether a chunk carries generated text (completions `text`, chat `delta.content` or a
/// reasoning field).
fn chunk_has_content(v: &StreamChunk) -> bool {
    let non_empty = |x: &Option<Loose<String>>| matches!(x, Some(Loose::Is(s)) if !s.is_empty());
    let Some(Loose::Is(choices)) = &v.choices else {
        return false;
    };
    choices.iter().any(|c| match c {
        Loose::Is(c) => {
            non_empty(&c.text)
                || matches!(&c.delta, Some(Loose::Is(d)) if non_empty(&d.content)
                    || non_empty(&d.reasoning_content)
                    || non_empty(&d.reasoning))
        }
        Loose::Other(_) => false,
    })
}

/// Appends a chunk's text (completions' `text`, chat's `delta.content`) to `out`.
fn append_content(v: &StreamChunk, out: &mut String) {
    let Some(Loose::Is(choices)) = &v.choices else {
        return;
    };
    for c in choices {
        let Loose::Is(c) = c else { continue };
        if let Some(Loose::Is(t)) = &c.text {
            out.push_str(t);
        }
        if let Some(Loose::Is(d)) = &c.delta {
            if let Some(Loose::Is(t)) = &d.content {
                out.push_str(t);
            }
        }
    }
}

/// `GET /v1/models`' answer, as far as the load generator reads it.
#[derive(Debug, Deserialize)]
struct ModelList {
    data: Option<Loose<Vec<Loose<ModelEntry>>>>,
}

#[derive(Debug, Deserialize)]
struct ModelEntry {
    id: Option<Loose<String>>,
}

fn truncate(s: &str, max_chars: usize) -> String {
    let s = s.trim();
    match s.char_indices().nth(max_chars) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Percentile `p` (0–100) of sorted samples, linearly interpolated between closest ranks (numpy's
/// default, as vLLM reports); `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let (first, last) = (sorted.first()?, sorted.last()?);
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    let v = sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64);
    Some(v.clamp(*first, *last))
}

/// Mean and percentiles of one latency, in ms; all `None` (JSON `null`) without samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatencyStats {
    /// Arithmetic mean.
    pub mean: Option<f64>,
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

impl LatencyStats {
    /// Statistics of `samples` (any order).
    pub fn from_samples(samples: &[f64]) -> Self {
        let mut sorted: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        sorted.sort_by(f64::total_cmp);
        let mean = (!sorted.is_empty()).then(|| sorted.iter().sum::<f64>() / sorted.len() as f64);
        LatencyStats {
            mean,
            p50: percentile(&sorted, 50.0),
            p90: percentile(&sorted, 90.0),
            p99: percentile(&sorted, 99.0),
        }
    }
}

/// Whether a successful request meets every given SLO. A request without a first token is held
/// to the TTFT SLO with its end-to-end time; one without a TPOT (fewer than 2 tokens) passes the
/// TPOT SLO.
pub fn meets_slo(r: &RequestRecord, slo: &Slo) -> bool {
    if r.error.is_some() {
        return false;
    }
    let ms = |s: f64| s * 1000.0;
    slo.ttft_ms.is_none_or(|l| ms(r.ttft.unwrap_or(r.e2e)) <= l)
        && slo
            .tpot_ms
            .is_none_or(|l| r.tpot().is_none_or(|t| ms(t) <= l))
        && slo.e2e_ms.is_none_or(|l| ms(r.e2e) <= l)
}

/// Requests per second that succeeded and met every given SLO, over `duration_s`.
pub fn goodput(records: &[RequestRecord], slo: &Slo, duration_s: f64) -> f64 {
    let good = records.iter().filter(|r| meets_slo(r, slo)).count();
    per_second(good as f64, duration_s)
}

fn per_second(n: f64, duration_s: f64) -> f64 {
    if duration_s > 0.0 {
        n / duration_s
    } else {
        0.0
    }
}

/// The figures of one run (the `--json` output).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// Full URL driven.
    pub url: String,
    /// Route driven.
    pub endpoint: Endpoint,
    /// Model sent.
    pub model: String,
    /// In-flight cap (`null`: none).
    pub concurrency: Option<usize>,
    /// Poisson rate (`null`: closed loop).
    pub request_rate: Option<f64>,
    /// Requests issued (completed + failed).
    pub issued: usize,
    /// Successful requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
    /// From the first request's start until the last request ended, s.
    pub duration_s: f64,
    /// Prompt tokens of successful requests (server usage; approximate where it sent none).
    pub total_input_tokens: u64,
    /// Output tokens of successful requests.
    pub total_output_tokens: u64,
    /// Successful requests that came without usage (their token counts are estimates).
    pub usage_missing: usize,
    /// Prompt tokens of successful requests the server said it served from its prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`; `null` when no answer said).
    pub cached_input_tokens: Option<u64>,
    /// Multi-turn workload only: prompt tokens computed (prompt − cached) by the sessions'
    /// first turns and by turns 2 and later, where the server reported cached tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub computed_input_tokens_by_turn: Option<TurnTokens>,
    /// Successful requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Input plus output tokens per second.
    pub total_token_throughput: f64,
    /// Requests per second meeting every SLO in `slo` (= request throughput when none is set).
    pub goodput: f64,
    /// SLOs checked for goodput.
    pub slo: Slo,
    /// Time to first token, ms.
    pub ttft_ms: LatencyStats,
    /// Multi-turn workload only: time to first token of each session's first turn, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms_first_turn: Option<LatencyStats>,
    /// Multi-turn workload only: time to first token of turns 2 and later (the turns a prefix
    /// cache can serve), ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms_later_turns: Option<LatencyStats>,
    /// Time per output token after the first, ms.
    pub tpot_ms: LatencyStats,
    /// Inter-token latency (gaps between content chunks), ms.
    pub itl_ms: LatencyStats,
    /// End-to-end latency, ms.
    pub e2e_ms: LatencyStats,
    /// The first error messages, as `request N: message`.
    pub errors: Vec<String>,
    /// Every successful answer's text, by request index (`--answers`; not in the JSON).
    #[serde(skip)]
    pub answers: Vec<(usize, String)>,
}

/// Prompt tokens computed, split by turn (multi-turn workloads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TurnTokens {
    /// The sessions' first turns.
    pub first: u64,
    /// Turns 2 and later.
    pub later: u64,
}

/// Run-level facts that go into the report besides the records.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// Full URL driven.
    pub url: String,
    /// Route driven.
    pub endpoint: Endpoint,
    /// Model sent.
    pub model: String,
    /// In-flight cap.
    pub concurrency: Option<usize>,
    /// Poisson rate.
    pub request_rate: Option<f64>,
    /// Wall time of the run, s.
    pub duration_s: f64,
    /// Sessions of a multi-turn workload (request `i` is turn `i / sessions + 1`).
    pub sessions: Option<usize>,
}

/// Builds the report from the records of a run (records in completion order).
pub fn summarize(records: &[RequestRecord], info: RunInfo, slo: &Slo) -> BenchReport {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let ms = |secs: Vec<f64>| secs.into_iter().map(|s| s * 1000.0).collect::<Vec<_>>();
    let ttft = ms(ok.iter().filter_map(|r| r.ttft).collect());
    let turns = |later: bool| {
        info.sessions.map(|n| {
            let t = ms(ok
                .iter()
                .filter(|r| (r.index >= n) == later)
                .filter_map(|r| r.ttft)
                .collect());
            LatencyStats::from_samples(&t)
        })
    };
    let tpot = ms(ok.iter().filter_map(|r| r.tpot()).collect());
    let itl = ms(ok.iter().flat_map(|r| r.itl.iter().copied()).collect());
    let e2e = ms(ok.iter().map(|r| r.e2e).collect());
    let total_input_tokens: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let total_output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let reported: Vec<&&RequestRecord> = ok.iter().filter(|r| r.cached_tokens.is_some()).collect();
    let cached_input_tokens =
        (!reported.is_empty()).then(|| reported.iter().map(|r| r.cached_tokens.unwrap_or(0)).sum());
    let computed_input_tokens_by_turn = info.sessions.filter(|_| !reported.is_empty()).map(|n| {
        let mut t = TurnTokens::default();
        for r in &reported {
            let computed = r.prompt_tokens.saturating_sub(r.cached_tokens.unwrap_or(0));
            if r.index >= n {
                t.later += computed;
            } else {
                t.first += computed;
            }
        }
        t
    });
    let d = info.duration_s;
    BenchReport {
        url: info.url,
        endpoint: info.endpoint,
        model: info.model,
        concurrency: info.concurrency,
        request_rate: info.request_rate,
        issued: records.len(),
        completed: ok.len(),
        failed: records.len() - ok.len(),
        duration_s: d,
        total_input_tokens,
        total_output_tokens,
        usage_missing: ok.iter().filter(|r| !r.usage_reported).count(),
        cached_input_tokens,
        computed_input_tokens_by_turn,
        request_throughput: per_second(ok.len() as f64, d),
        output_throughput: per_second(total_output_tokens as f64, d),
        total_token_throughput: per_second((total_input_tokens + total_output_tokens) as f64, d),
        goodput: goodput(records, slo, d),
        slo: *slo,
        ttft_ms: LatencyStats::from_samples(&ttft),
        ttft_ms_first_turn: turns(false),
        ttft_ms_later_turns: turns(true),
        tpot_ms: LatencyStats::from_samples(&tpot),
        itl_ms: LatencyStats::from_samples(&itl),
        e2e_ms: LatencyStats::from_samples(&e2e),
        errors: records
            .iter()
            .filter_map(|r| {
                r.error
                    .as_ref()
                    .map(|e| format!("request {}: {e}", r.index))
            })
            .take(MAX_REPORTED_ERRORS)
            .collect(),
        answers: {
            let mut a: Vec<(usize, String)> =
                ok.iter().map(|r| (r.index, r.text.clone())).collect();
            a.sort_by_key(|(i, _)| *i);
            a
        },
    }
}

/// The human-readable table.
pub fn format_report(r: &BenchReport) -> String {
    const W: usize = 50;
    fn row(s: &mut String, label: &str, value: &str) {
        let _ = writeln!(s, "{:<40} {value}", format!("{label}:"));
    }
    let num = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
    let mut s = String::new();
    let _ = writeln!(s, "{:=^W$}", " Serving Benchmark Result ");
    row(&mut s, "URL", &r.url);
    row(&mut s, "Model", &r.model);
    let load = match (r.request_rate, r.concurrency) {
        (Some(rate), Some(c)) => format!("Poisson {rate} req/s, at most {c} in flight"),
        (Some(rate), None) => format!("Poisson {rate} req/s"),
        (None, Some(c)) => format!("concurrency {c}"),
        (None, None) => "all at once".to_string(),
    };
    row(&mut s, "Load", &load);
    row(&mut s, "Successful requests", &r.completed.to_string());
    row(&mut s, "Failed requests", &r.failed.to_string());
    row(
        &mut s,
        "Benchmark duration (s)",
        &format!("{:.2}", r.duration_s),
    );
    row(
        &mut s,
        "Total input tokens",
        &r.total_input_tokens.to_string(),
    );
    row(
        &mut s,
        "Total generated tokens",
        &r.total_output_tokens.to_string(),
    );
    if r.usage_missing > 0 {
        row(
            &mut s,
            "Requests without usage (estimated)",
            &r.usage_missing.to_string(),
        );
    }
    row(
        &mut s,
        "Request throughput (req/s)",
        &format!("{:.2}", r.request_throughput),
    );
    let slos: Vec<String> = [
        ("TTFT", r.slo.ttft_ms),
        ("TPOT", r.slo.tpot_ms),
        ("E2E", r.slo.e2e_ms),
    ]
    .iter()
    .filter_map(|(n, v)| v.map(|v| format!("{n}≤{v}ms")))
    .collect();
    let goodput_label = if slos.is_empty() {
        "Goodput (req/s, no SLO)".to_string()
    } else {
        format!("Goodput (req/s, {})", slos.join(" "))
    };
    row(&mut s, &goodput_label, &format!("{:.2}", r.goodput));
    row(
        &mut s,
        "Output token throughput (tok/s)",
        &format!("{:.2}", r.output_throughput),
    );
    row(
        &mut s,
        "Total token throughput (tok/s)",
        &format!("{:.2}", r.total_token_throughput),
    );
    for (title, short, st) in [
        ("Time to First Token", "TTFT", &r.ttft_ms),
        (
            "Time per Output Token (excl. 1st token)",
            "TPOT",
            &r.tpot_ms,
        ),
        ("Inter-token Latency", "ITL", &r.itl_ms),
        ("End-to-end Latency", "E2E", &r.e2e_ms),
    ] {
        let _ = writeln!(s, "{:-^W$}", format!(" {title} "));
        row(&mut s, &format!("Mean {short} (ms)"), &num(st.mean));
        row(&mut s, &format!("P50 {short} (ms)"), &num(st.p50));
        row(&mut s, &format!("P90 {short} (ms)"), &num(st.p90));
        row(&mut s, &format!("P99 {short} (ms)"), &num(st.p99));
    }
    if let (Some(first), Some(later)) = (&r.ttft_ms_first_turn, &r.ttft_ms_later_turns) {
        let _ = writeln!(s, "{:-^W$}", " TTFT by turn (multi-turn) ");
        row(&mut s, "P50 TTFT, first turns (ms)", &num(first.p50));
        row(&mut s, "P50 TTFT, turns 2+ (ms)", &num(later.p50));
        row(&mut s, "P99 TTFT, turns 2+ (ms)", &num(later.p99));
    }
    if let Some(t) = &r.computed_input_tokens_by_turn {
        row(
            &mut s,
            "Prompt tokens computed, first turns",
            &t.first.to_string(),
        );
        row(
            &mut s,
            "Prompt tokens computed, turns 2+",
            &t.later.to_string(),
        );
    }
    let _ = writeln!(s, "{:=^W$}", "");
    if !r.errors.is_empty() {
        let _ = writeln!(s, "First errors ({} failed in all):", r.failed);
        for e in &r.errors {
            let _ = writeln!(s, "  {e}");
        }
    }
    s
}

/// What every request task shares.
#[derive(Debug)]
struct RequestContext {
    client: reqwest::Client,
    url: String,
    endpoint: Endpoint,
    model: String,
    api_key: Option<String>,
    timeout: Duration,
}

/// Sends one request and measures it; never fails (failures are records).
async fn send_request(ctx: &RequestContext, spec: RequestSpec) -> RequestRecord {
    let start = Instant::now();
    match tokio::time::timeout(ctx.timeout, stream_request(ctx, &spec, start)).await {
        Ok(Ok(record)) => record,
        Ok(Err(e)) => {
            RequestRecord::failed(spec.index, start.elapsed().as_secs_f64(), e.to_string())
        }
        Err(_) => RequestRecord::failed(
            spec.index,
            start.elapsed().as_secs_f64(),
            format!("timeout after {:.1}s", ctx.timeout.as_secs_f64()),
        ),
    }
}

async fn stream_request(
    ctx: &RequestContext,
    spec: &RequestSpec,
    start: Instant,
) -> std::result::Result<RequestRecord, StreamError> {
    let mut req = ctx
        .client
        .post(&ctx.url)
        .json(&request_body(ctx.endpoint, &ctx.model, spec));
    if let Some(key) = &ctx.api_key {
        req = req.bearer_auth(key);
    }
    let mut resp = req.send().await.map_err(StreamError::Transport)?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Err(StreamError::Status {
            status,
            body: truncate(&body, MAX_ERROR_CHARS),
        });
    }
    let mut parser = SseParser::default();
    let mut acc = StreamAccumulator::default();
    let mut done = false;
    'read: loop {
        let chunk = resp.chunk().await.map_err(StreamError::MidStream)?;
        let t = start.elapsed().as_secs_f64();
        let events = match &chunk {
            Some(bytes) => parser.push(bytes),
            None => parser.finish(),
        };
        for ev in &events {
            if acc.on_event(ev, t)? == Flow::Done {
                done = true;
                break 'read;
            }
        }
        if chunk.is_none() {
            break;
        }
    }
    let record = acc.finish(
        spec.index,
        start.elapsed().as_secs_f64(),
        spec.approx_prompt_tokens,
    );
    if done {
        // Read the body's end (servers close the stream right after [DONE]) so the connection
        // goes back to the pool; bounded, and not part of the measurement.
        let drain = async { while let Ok(Some(_)) = resp.chunk().await {} };
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, drain).await;
    }
    Ok(record)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s
}

/// Checks the server is reachable and finds the model: `cfg.model`, or the first id of
/// `GET /v1/models`.
async fn resolve_model(client: &reqwest::Client, cfg: &BenchConfig) -> Result<String> {
    let models_url = format!("{}/v1/models", cfg.url);
    let mut req = client.get(&models_url).timeout(CONNECT_TIMEOUT * 3);
    if let Some(key) = &cfg.api_key {
        req = req.bearer_auth(key);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("server unreachable at {}: {}", cfg.url, error_chain(&e)))?;
    if let Some(m) = &cfg.model {
        return Ok(m.clone()); // reachable; some servers have no /v1/models, which is fine here
    }
    let status = resp.status();
    if !status.is_success() {
        bail!("GET {models_url} answered {status}; pass --model");
    }
    let v: Value = resp
        .json()
        .await
        .with_context(|| format!("GET {models_url}: bad JSON"))?;
    v.is_object()
        .then(|| ModelList::deserialize(&v).ok())
        .flatten()
        .and_then(|m| m.data?.get()?.into_iter().next()?.get()?.id?.get())
        .with_context(|| format!("GET {models_url} lists no model; pass --model"))
}

/// Runs a benchmark and returns its report. Requests that fail are counted in the report, not
/// returned as errors.
///
/// # Errors
/// An invalid configuration, or a server that is unreachable (or lists no model when none was
/// given) at the start.
pub async fn run_bench(cfg: &BenchConfig) -> Result<BenchReport> {
    cfg.validate()?;
    // No proxy from the environment: measure the server.
    // A fresh connection per request (a loopback connect costs tens of microseconds): servers
    // close kept-alive connections on their own terms (llama-server's cpp-httplib after a few
    // seconds idle or a few requests), and a request sent on one the server is closing fails
    // ("connection closed before message completed") through no fault of either side.
    let client = pdserve_actors::http::http_client()
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_max_idle_per_host(0)
        .build()
        .context("building the HTTP client")?;
    let model = resolve_model(&client, cfg).await?;
    let ctx = Arc::new(RequestContext {
        client,
        url: format!("{}{}", cfg.url, cfg.endpoint.path()),
        endpoint: cfg.endpoint,
        model: model.clone(),
        api_key: cfg.api_key.clone(),
        timeout: cfg.request_timeout,
    });
    let in_flight_cap = cfg.concurrency.map(|n| Arc::new(Semaphore::new(n)));
    let mut arrivals = cfg.request_rate.map(|r| PoissonArrivals::new(r, cfg.seed));
    let mut specs = RequestGenerator::new(cfg);
    let mut tasks = tokio::task::JoinSet::new();
    let mut records = Vec::new();

    let start = Instant::now();
    let deadline = tokio::time::Instant::from_std(start + cfg.duration);
    for _ in 0..cfg.num_requests {
        if let Some(arrivals) = arrivals.as_mut() {
            let offset = arrivals.next().unwrap_or(f64::INFINITY);
            let Ok(offset) = Duration::try_from_secs_f64(offset) else {
                break;
            };
            let at = tokio::time::Instant::from_std(start + offset);
            if at >= deadline {
                break;
            }
            tokio::time::sleep_until(at).await;
        }
        let permit = match &in_flight_cap {
            Some(sem) => match tokio::time::timeout_at(deadline, sem.clone().acquire_owned()).await
            {
                Ok(permit) => Some(permit.context("in-flight semaphore closed")?),
                Err(_) => break, // the duration ended while waiting for a free slot
            },
            None => None,
        };
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        let Some(spec) = specs.next() else { break };
        let ctx = ctx.clone();
        tasks.spawn(async move {
            let _permit = permit;
            send_request(&ctx, spec).await
        });
        while let Some(done) = tasks.try_join_next() {
            records.push(done.context("request task panicked")?);
        }
    }
    tracing::debug!(
        issued = records.len() + tasks.len(),
        "bench serve: issuing done"
    );
    // Every request carries its own timeout, so this wait is bounded.
    while let Some(done) = tasks.join_next().await {
        records.push(done.context("request task panicked")?);
    }
    let info = RunInfo {
        url: ctx.url.clone(),
        endpoint: cfg.endpoint,
        model,
        concurrency: cfg.concurrency,
        request_rate: cfg.request_rate,
        duration_s: start.elapsed().as_secs_f64(),
        sessions: match &cfg.prompts {
            PromptSource::MultiTurn { sessions, .. } => Some(*sessions),
            _ => None,
        },
    };
    Ok(summarize(&records, info, &cfg.slo))
}

/// Entry point of `pdserve bench serve`: runs the benchmark on its own tokio runtime and prints
/// the table, or one JSON object with `--json`.
///
/// # Errors
/// Invalid arguments, an unreadable dataset, or a server unreachable at the start. Failed
/// requests are reported, not errors.
pub fn run(args: BenchServeArgs) -> Result<()> {
    let cfg = BenchConfig::from_args(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("bench-serve")
        .build()
        .context("building the tokio runtime")?;
    let report = rt.block_on(run_bench(&cfg))?;
    if let Some(path) = &args.answers {
        let mut lines = String::new();
        for (index, text) in &report.answers {
            lines.push_str(&serde_json::to_string(
                &json!({"index": index, "text": text}),
            )?);
            lines.push('\n');
        }
        std::fs::write(path, lines).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", format_report(&report));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&str]) -> Vec<SseEvent> {
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for c in chunks {
            out.extend(p.push(c.as_bytes()));
        }
        out.extend(p.finish());
        out
    }

    #[test]
    fn sse_parses_events_split_at_every_byte() {
        let stream =
            ": keep-alive\n\ndata: {\"a\":1}\n\ndata: {\"b\":\"é\"}\r\n\r\ndata: [DONE]\n\n";
        let expected = vec![
            SseEvent::Data("{\"a\":1}".into()),
            SseEvent::Data("{\"b\":\"é\"}".into()),
            SseEvent::Done,
        ];
        assert_eq!(events(&[stream]), expected);
        // One byte at a time: split lines, split CRLF, split inside a multi-byte UTF-8 character.
        let mut p = SseParser::default();
        let mut out = Vec::new();
        for b in stream.as_bytes() {
            out.extend(p.push(std::slice::from_ref(b)));
        }
        out.extend(p.finish());
        assert_eq!(out, expected);
    }

    #[test]
    fn sse_skips_comments_and_other_fields_and_joins_data_lines() {
        let got = events(&[
            ":ping\n\nevent: message\nid: 7\nretry: 100\ndata:{\"x\":1}\n\n",
            "data: line1\ndata: line2\n\n",
            "event: only-an-event\n\n",
        ]);
        assert_eq!(
            got,
            vec![
                SseEvent::Data("{\"x\":1}".into()),
                SseEvent::Data("line1\nline2".into())
            ]
        );
    }

    #[test]
    fn sse_flushes_an_unterminated_last_event() {
        assert_eq!(
            events(&["data: {\"a\":1}\n\ndata: [DONE]"]).last(),
            Some(&SseEvent::Done)
        );
        assert_eq!(events(&["data: [DONE]\n"]), vec![SseEvent::Done]);
        assert!(events(&[": only a comment"]).is_empty());
    }

    #[test]
    fn accumulator_measures_ttft_itl_tpot_and_uses_usage() {
        let mut a = StreamAccumulator::default();
        let ev = |s: &str| SseEvent::Data(s.to_string());
        let chunks = [
            (
                r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
                0.05,
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}"#,
                0.10,
            ),
            (r#"{"choices":[{"index":0,"text":" there"}]}"#, 0.13),
            (
                r#"{"choices":[{"index":0,"delta":{"content":"!!"}}]}"#,
                0.19,
            ),
            (
                r#"{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":4,"total_tokens":15}}"#,
                0.2,
            ),
        ];
        for (c, t) in chunks {
            assert_eq!(a.on_event(&ev(c), t).unwrap(), Flow::Continue);
        }
        assert_eq!(a.on_event(&SseEvent::Done, 0.21).unwrap(), Flow::Done);
        let r = a.finish(3, 0.25, 999);
        assert_eq!(r.index, 3);
        assert_eq!(r.error, None);
        assert_eq!(r.ttft, Some(0.10));
        assert_eq!(r.itl.len(), 2);
        assert!((r.itl[0] - 0.03).abs() < 1e-9 && (r.itl[1] - 0.06).abs() < 1e-9);
        assert_eq!(
            (r.output_tokens, r.prompt_tokens, r.usage_reported),
            (4, 11, true)
        );
        assert!((r.tpot().unwrap() - 0.05).abs() < 1e-9); // (0.25 - 0.10) / 3
        assert_eq!(r.text, "Hi there!!");
    }

    #[test]
    fn accumulator_reads_cached_prompt_tokens() {
        let mut a = StreamAccumulator::default();
        a.on_event(&SseEvent::Data(r#"{"choices":[{"text":"x"}]}"#.into()), 0.1)
            .unwrap();
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        a.on_event(&SseEvent::Data(usage.into()), 0.2).unwrap();
        let r = a.finish(0, 0.2, 1);
        assert_eq!((r.prompt_tokens, r.cached_tokens), (100, Some(64)));
        assert_eq!(r.text, "x");
        // A server that does not say has no cached count (not zero).
        let mut b = StreamAccumulator::default();
        let usage =
            r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":9,"completion_tokens":1}}"#;
        b.on_event(&SseEvent::Data(usage.into()), 0.1).unwrap();
        assert_eq!(b.finish(0, 0.1, 1).cached_tokens, None);
    }

    #[test]
    fn accumulator_without_usage_counts_content_chunks() {
        let mut a = StreamAccumulator::default();
        for (i, t) in [0.1, 0.2, 0.3].into_iter().enumerate() {
            let c = format!(r#"{{"choices":[{{"text":"t{i}"}}]}}"#);
            a.on_event(&SseEvent::Data(c), t).unwrap();
        }
        let r = a.finish(0, 0.3, 42);
        assert_eq!(
            (r.output_tokens, r.prompt_tokens, r.usage_reported),
            (3, 42, false)
        );
        assert_eq!(r.error, None);
    }

    #[test]
    fn accumulator_reports_errors_in_stream() {
        for (chunk, msg) in [
            (
                r#"{"error":{"message":"out of blocks","code":500}}"#,
                "out of blocks",
            ),
            (
                r#"{"object":"error","message":"bad field","type":"BadRequestError"}"#,
                "bad field",
            ),
            (r#"{"error":"plain"}"#, "plain"),
        ] {
            let mut a = StreamAccumulator::default();
            let e = a.on_event(&SseEvent::Data(chunk.into()), 0.1).unwrap_err();
            assert!(matches!(e, StreamError::Server(ref m) if m == msg), "{e}");
            assert_eq!(e.to_string(), format!("error in stream: {msg}"));
        }
        let mut a = StreamAccumulator::default();
        let e = a
            .on_event(&SseEvent::Data("not json".into()), 0.1)
            .unwrap_err();
        assert!(
            matches!(e, StreamError::BadChunk { ref data, .. } if data == "not json"),
            "{e}"
        );
        assert!(e.to_string().starts_with("bad stream chunk ("), "{e}");
        // A stream that ends with nothing at all is a failure.
        let r = StreamAccumulator::default().finish(5, 0.4, 1);
        assert!(r.error.as_deref().unwrap().contains("before any data"));
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        // numpy.percentile(range(1, 11), [0, 50, 90, 99, 100]) = 1, 5.5, 9.1, 9.91, 10
        for (p, want) in [
            (0.0, 1.0),
            (50.0, 5.5),
            (90.0, 9.1),
            (99.0, 9.91),
            (100.0, 10.0),
        ] {
            assert!((percentile(&v, p).unwrap() - want).abs() < 1e-9, "p{p}");
        }
        let s = LatencyStats::from_samples(&[3.0, 1.0, 2.0, f64::NAN]);
        assert_eq!((s.mean, s.p50), (Some(2.0), Some(2.0)));
        assert_eq!(LatencyStats::from_samples(&[]), LatencyStats::default());
    }

    fn rec(ttft: f64, e2e: f64, tokens: u64) -> RequestRecord {
        RequestRecord {
            ttft: Some(ttft),
            e2e,
            output_tokens: tokens,
            usage_reported: true,
            ..Default::default()
        }
    }

    #[test]
    fn goodput_checks_only_given_slos() {
        // TPOTs: 10 ms, 50 ms, (1 token: none); TTFT 100, 300, 50 ms; E2E 1090, 5250, 50 ms.
        let records = vec![
            rec(0.1, 1.09, 100),
            rec(0.3, 5.25, 100),
            rec(0.05, 0.05, 1),
            RequestRecord::failed(3, 0.01, "HTTP 400".into()),
        ];
        let none = Slo::default();
        assert_eq!(goodput(&records, &none, 2.0), 1.5); // 3 successes / 2 s
        let ttft = Slo {
            ttft_ms: Some(200.0),
            ..Default::default()
        };
        assert_eq!(goodput(&records, &ttft, 1.0), 2.0);
        let tpot = Slo {
            tpot_ms: Some(20.0),
            ..Default::default()
        };
        assert_eq!(goodput(&records, &tpot, 1.0), 2.0); // the 1-token request has no TPOT: passes
        let all = Slo {
            ttft_ms: Some(200.0),
            tpot_ms: Some(20.0),
            e2e_ms: Some(1000.0),
        };
        assert_eq!(goodput(&records, &all, 1.0), 1.0);
        assert_eq!(goodput(&records, &all, 0.0), 0.0);
        // No first token: held to the TTFT SLO by its end-to-end time.
        let no_token = RequestRecord {
            ttft: None,
            e2e: 0.5,
            ..Default::default()
        };
        assert!(!meets_slo(
            &no_token,
            &Slo {
                ttft_ms: Some(100.0),
                ..Default::default()
            }
        ));
    }

    #[test]
    fn poisson_schedule_has_the_asked_mean_rate_and_is_seeded() {
        let rate = 8.0;
        let n = 20_000;
        let times: Vec<f64> = PoissonArrivals::new(rate, 7).take(n).collect();
        assert!(times.windows(2).all(|w| w[1] > w[0]));
        let measured = n as f64 / times[n - 1];
        assert!(
            (measured - rate).abs() / rate < 0.03,
            "measured {measured} req/s"
        );
        // Exponential gaps: the standard deviation equals the mean.
        let gaps: Vec<f64> = std::iter::once(times[0])
            .chain(times.windows(2).map(|w| w[1] - w[0]))
            .collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        assert!((sd / mean - 1.0).abs() < 0.05, "cv {}", sd / mean);
        let again: Vec<f64> = PoissonArrivals::new(rate, 7).take(100).collect();
        assert_eq!(&times[..100], &again[..]);
        assert_ne!(PoissonArrivals::new(rate, 8).next(), Some(times[0]));
    }

    #[test]
    fn multi_turn_prompts_share_the_system_prompt_and_extend_each_turn() {
        let args =
            parse("--url http://h:1 --multi-turn-sessions 3 --system-prompt-len 40 --turn-len 5")
                .unwrap();
        let cfg = BenchConfig::from_args(&args).unwrap();
        let specs: Vec<RequestSpec> = RequestGenerator::new(&cfg).take(9).collect();
        let shape = TurnShape {
            system_len: 40,
            context_len: 0,
            turn_len: 0,
        };
        let system = multi_turn_prompt(cfg.seed, shape, 0, 0);
        assert_eq!(system.split_whitespace().count(), 40);
        for s in &specs {
            assert!(s.prompt.starts_with(&system), "{}", s.prompt);
        }
        // Request 3 is turn 2 of session 0: it extends request 0 (turn 1 of session 0).
        assert!(specs[3].prompt.starts_with(&specs[0].prompt));
        assert!(specs[6].prompt.starts_with(&specs[3].prompt));
        assert_ne!(
            specs[0].prompt, specs[1].prompt,
            "sessions differ after the system prompt"
        );
        assert_eq!(specs[4].approx_prompt_tokens, 40 + 2 * 5);
        assert!(parse("--url http://h:1 --multi-turn-sessions 2 --input-len 5").is_err());
        assert!(parse("--url http://h:1 --turn-len 5").is_err());
        let zero = parse("--url http://h:1 --multi-turn-sessions 0").unwrap();
        assert!(BenchConfig::from_args(&zero).is_err());
    }

    #[test]
    fn session_context_follows_the_system_prompt_and_a_split_run_continues_the_sequence() {
        let line = "--url http://h:1 --multi-turn-sessions 2 --system-prompt-len 30 --turn-len 4 --session-context-len 20";
        let cfg = BenchConfig::from_args(&parse(line).unwrap()).unwrap();
        let specs: Vec<RequestSpec> = RequestGenerator::new(&cfg).take(6).collect();
        let shape = |context_len| TurnShape {
            system_len: 30,
            context_len,
            turn_len: 0,
        };
        let system = multi_turn_prompt(cfg.seed, shape(0), 0, 0);
        let with_context = |session| multi_turn_prompt(cfg.seed, shape(20), session, 0);
        assert_eq!(with_context(1).split_whitespace().count(), 30 + 1 + 20);
        for (i, s) in specs.iter().enumerate() {
            assert!(s.prompt.starts_with(&system));
            assert!(s.prompt.starts_with(&with_context(i % 2)), "{i}");
        }
        assert_ne!(
            with_context(0),
            with_context(1),
            "each session has its own context"
        );
        assert!(specs[2].prompt.starts_with(&specs[0].prompt));
        assert_eq!(specs[3].approx_prompt_tokens, 30 + 20 + 2 * 4);
        // `--first-request 3` starts where request 3 of the whole run is.
        let part =
            BenchConfig::from_args(&parse(&format!("{line} --first-request 3")).unwrap()).unwrap();
        let rest: Vec<RequestSpec> = RequestGenerator::new(&part).take(3).collect();
        assert_eq!(rest, specs[3..6].to_vec());
    }

    #[test]
    fn dataset_parsing() {
        let text = "{\"prompt\": \"hello world\", \"output_len\": 12}\n\n{\"prompt\": \"x\", \"extra\": 1}\n";
        let d = parse_dataset(text).unwrap();
        assert_eq!(
            d,
            vec![
                DatasetEntry {
                    prompt: "hello world".into(),
                    output_len: Some(12)
                },
                DatasetEntry {
                    prompt: "x".into(),
                    output_len: None
                },
            ]
        );
        let err = format!(
            "{:#}",
            parse_dataset("{\"prompt\": \"a\"}\n{\"output_len\": 3}\n").unwrap_err()
        );
        assert!(err.contains("line 2"), "{err}");
        assert!(parse_dataset("\n  \n").is_err());
        assert!(parse_dataset("not json").is_err());
    }

    fn config(prompts: PromptSource, output_len: LenSpec) -> BenchConfig {
        BenchConfig {
            url: "http://127.0.0.1:1".into(),
            endpoint: Endpoint::Completions,
            model: None,
            api_key: None,
            concurrency: Some(1),
            request_rate: None,
            seed: 1,
            num_requests: 10,
            first_request: 0,
            duration: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            prompts,
            output_len,
            slo: Slo::default(),
        }
    }

    #[test]
    fn request_generator_lengths_and_dataset_cycling() {
        let range = LenSpec::Range(LenRange { min: 3, max: 9 });
        let cfg = config(
            PromptSource::Synthetic(range),
            LenSpec::Range(LenRange { min: 2, max: 4 }),
        );
        let specs: Vec<RequestSpec> = RequestGenerator::new(&cfg).take(200).collect();
        for s in &specs {
            assert!((3..=9).contains(&s.approx_prompt_tokens));
            assert_eq!(s.prompt.split(' ').count(), s.approx_prompt_tokens);
            assert!((2..=4).contains(&s.max_tokens));
        }
        assert!(
            specs.iter().any(|s| s.approx_prompt_tokens == 3)
                && specs.iter().any(|s| s.approx_prompt_tokens == 9)
        );
        assert_eq!(
            specs,
            RequestGenerator::new(&cfg).take(200).collect::<Vec<_>>(),
            "seeded"
        );

        let entries = vec![
            DatasetEntry {
                prompt: "a b".into(),
                output_len: Some(5),
            },
            DatasetEntry {
                prompt: "c".into(),
                output_len: None,
            },
        ];
        let cfg = config(PromptSource::Dataset(entries), LenSpec::Fixed(7));
        let specs: Vec<RequestSpec> = RequestGenerator::new(&cfg).take(3).collect();
        let got: Vec<(&str, usize, usize)> = specs
            .iter()
            .map(|s| (s.prompt.as_str(), s.max_tokens, s.index))
            .collect();
        assert_eq!(got, vec![("a b", 5, 0), ("c", 7, 1), ("a b", 5, 2)]);
    }

    #[test]
    fn request_bodies_ask_for_streamed_usage_and_fixed_length() {
        let spec = RequestSpec {
            index: 0,
            prompt: "hi".into(),
            approx_prompt_tokens: 1,
            max_tokens: 9,
        };
        let b = request_body(Endpoint::Completions, "m", &spec);
        assert_eq!(b["prompt"], "hi");
        assert_eq!(
            (b["max_tokens"].as_u64(), b["min_tokens"].as_u64()),
            (Some(9), Some(9))
        );
        assert_eq!(
            (b["stream"].as_bool(), b["ignore_eos"].as_bool()),
            (Some(true), Some(true))
        );
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["temperature"].as_f64(), Some(0.0));
        let c = request_body(Endpoint::Chat, "m", &spec);
        assert_eq!(c["messages"], json!([{"role": "user", "content": "hi"}]));
        assert!(c.get("prompt").is_none());
    }

    #[test]
    fn config_validation_and_url_normalisation() {
        assert_eq!(normalize_base_url("http://h:8000/v1/"), "http://h:8000");
        assert_eq!(normalize_base_url("http://h:8000"), "http://h:8000");
        assert_eq!("3:7".parse::<LenRange>(), Ok(LenRange { min: 3, max: 7 }));
        assert_eq!(
            "7:3".parse::<LenRange>(),
            Err(LenRangeError::Reversed { min: 7, max: 3 })
        );
        assert_eq!(
            "7".parse::<LenRange>().unwrap_err().to_string(),
            "expected A:B, got \"7\""
        );
        let e = "3:x".parse::<LenRange>().unwrap_err();
        assert!(e.to_string().starts_with("bad range end \"x\": "), "{e}");
        let ok = config(
            PromptSource::Synthetic(LenSpec::Fixed(4)),
            LenSpec::Fixed(4),
        );
        ok.validate().unwrap();
        let bad = [
            BenchConfig {
                url: "https://x".into(),
                ..ok.clone()
            },
            BenchConfig {
                num_requests: 0,
                ..ok.clone()
            },
            BenchConfig {
                concurrency: Some(0),
                ..ok.clone()
            },
            BenchConfig {
                request_rate: Some(0.0),
                ..ok.clone()
            },
            BenchConfig {
                output_len: LenSpec::Fixed(0),
                ..ok.clone()
            },
            BenchConfig {
                prompts: PromptSource::Dataset(vec![]),
                ..ok.clone()
            },
            BenchConfig {
                slo: Slo {
                    tpot_ms: Some(-1.0),
                    ..Default::default()
                },
                ..ok.clone()
            },
        ];
        for b in bad {
            assert!(b.validate().is_err(), "{b:?}");
        }
    }

    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: BenchServeArgs,
    }

    /// Parses a command line given as one string (no quoting: arguments have no spaces).
    fn parse(args: &str) -> std::result::Result<BenchServeArgs, clap::Error> {
        use clap::Parser as _;
        Cli::try_parse_from(std::iter::once("bench-serve").chain(args.split_whitespace()))
            .map(|c| c.args)
    }

    #[test]
    fn command_line_flags_and_defaults() {
        let a = parse("--url http://h:1/v1").unwrap();
        let c = BenchConfig::from_args(&a).unwrap();
        assert_eq!(c.url, "http://h:1");
        assert_eq!(
            (c.endpoint, c.concurrency, c.request_rate),
            (Endpoint::Completions, Some(1), None)
        );
        assert_eq!(
            (c.num_requests, c.duration, c.request_timeout),
            (64, Duration::from_secs(300), Duration::from_secs(300))
        );
        assert_eq!(c.prompts, PromptSource::Synthetic(LenSpec::Fixed(256)));
        assert_eq!(c.output_len, LenSpec::Fixed(64));
        assert!(!a.json && a.model.is_none() && a.api_key.is_none());

        let a = parse(
            "--url http://h:1 --endpoint chat --model m --api-key k --request-rate 2.5 --concurrency 4 \
             --seed 9 --num-requests 10 --duration-s 1.5 --timeout-s 0.5 --input-len-range 10:20 \
             --output-len-range 3:5 --slo-ttft-ms 100 --slo-tpot-ms 20 --slo-e2e-ms 900 --json",
        )
        .unwrap();
        let c = BenchConfig::from_args(&a).unwrap();
        assert_eq!(
            (c.endpoint, c.concurrency, c.request_rate, c.seed),
            (Endpoint::Chat, Some(4), Some(2.5), 9)
        );
        assert_eq!(
            (c.model.as_deref(), c.api_key.as_deref(), c.num_requests),
            (Some("m"), Some("k"), 10)
        );
        assert_eq!(
            (c.duration, c.request_timeout),
            (Duration::from_millis(1500), Duration::from_millis(500))
        );
        assert_eq!(
            c.prompts,
            PromptSource::Synthetic(LenSpec::Range(LenRange { min: 10, max: 20 }))
        );
        assert_eq!(c.output_len, LenSpec::Range(LenRange { min: 3, max: 5 }));
        assert_eq!(
            c.slo,
            Slo {
                ttft_ms: Some(100.0),
                tpot_ms: Some(20.0),
                e2e_ms: Some(900.0)
            }
        );
        assert!(a.json);
        // Rate alone: an open loop without a cap.
        let c =
            BenchConfig::from_args(&parse("--url http://h:1 --request-rate 3").unwrap()).unwrap();
        assert_eq!((c.concurrency, c.request_rate), (None, Some(3.0)));

        for bad in [
            "--url http://h:1 --input-len 5 --input-len-range 1:2",
            "--url http://h:1 --output-len 5 --output-len-range 1:2",
            "--url http://h:1 --input-len 5 --dataset x.jsonl",
            "--url http://h:1 --input-len-range 9:2",
            "--url http://h:1 --endpoint embeddings",
            "--num-requests 3",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
        for invalid in [
            "--duration-s=-1",
            "--timeout-s 0",
            "--concurrency 0",
            "--request-rate=-2",
            "--output-len 0",
        ] {
            let a = parse(&format!("--url http://h:1 {invalid}")).unwrap();
            assert!(
                BenchConfig::from_args(&a).is_err(),
                "{invalid} should be refused"
            );
        }
        let a = parse("--url http://h:1 --dataset /nonexistent/d.jsonl").unwrap();
        assert!(
            format!("{:#}", BenchConfig::from_args(&a).unwrap_err()).contains("reading dataset")
        );
    }

    #[test]
    fn multi_turn_reports_split_ttft_by_turn() {
        let records: Vec<RequestRecord> = [(0, 0.4), (1, 0.6), (2, 0.1), (3, 0.3)]
            .into_iter()
            .map(|(index, ttft)| RequestRecord {
                index,
                ..rec(ttft, 1.0, 4)
            })
            .collect();
        let info = |sessions| RunInfo {
            url: "http://h/v1/chat/completions".into(),
            endpoint: Endpoint::Chat,
            model: "m".into(),
            concurrency: Some(2),
            request_rate: None,
            duration_s: 2.0,
            sessions,
        };
        // Two sessions: requests 0 and 1 are first turns, 2 and 3 second turns.
        let r = summarize(&records, info(Some(2)), &Slo::default());
        let (first, later) = (
            r.ttft_ms_first_turn.unwrap(),
            r.ttft_ms_later_turns.unwrap(),
        );
        assert_eq!(first.mean.map(f64::round), Some(500.0));
        assert_eq!(later.mean.map(f64::round), Some(200.0));
        assert!(format_report(&r).contains("P50 TTFT, turns 2+ (ms)"));
        // No cached counts reported: no computed split, and no claim of zero cached.
        assert_eq!(r.cached_input_tokens, None);
        assert_eq!(r.computed_input_tokens_by_turn, None);
        let cached: Vec<RequestRecord> = records
            .iter()
            .map(|r| RequestRecord {
                prompt_tokens: 100,
                cached_tokens: Some(if r.index >= 2 { 90 } else { 20 }),
                ..r.clone()
            })
            .collect();
        let c = summarize(&cached, info(Some(2)), &Slo::default());
        assert_eq!(c.cached_input_tokens, Some(2 * 20 + 2 * 90));
        assert_eq!(
            c.computed_input_tokens_by_turn,
            Some(TurnTokens {
                first: 160,
                later: 20
            })
        );
        assert!(format_report(&c).contains("Prompt tokens computed, turns 2+"));
        let plain = summarize(&records, info(None), &Slo::default());
        assert!(plain.ttft_ms_later_turns.is_none());
        let v = serde_json::to_value(&plain).unwrap();
        assert!(v.get("ttft_ms_later_turns").is_none(), "{v}");
    }

    #[test]
    fn report_summarises_records_and_formats() {
        let mut records = vec![rec(0.1, 1.0, 10), rec(0.2, 2.0, 10)];
        records[0].itl = vec![0.1, 0.1];
        records[0].prompt_tokens = 5;
        records[1].prompt_tokens = 5;
        records.push(RequestRecord::failed(
            2,
            0.1,
            "HTTP 400 Bad Request: nope".into(),
        ));
        let info = RunInfo {
            url: "http://h/v1/completions".into(),
            endpoint: Endpoint::Completions,
            model: "m".into(),
            concurrency: Some(2),
            request_rate: None,
            duration_s: 2.0,
            sessions: None,
        };
        let r = summarize(
            &records,
            info,
            &Slo {
                e2e_ms: Some(1500.0),
                ..Default::default()
            },
        );
        assert_eq!((r.issued, r.completed, r.failed), (3, 2, 1));
        assert_eq!((r.total_input_tokens, r.total_output_tokens), (10, 20));
        assert_eq!(
            (
                r.request_throughput,
                r.output_throughput,
                r.total_token_throughput
            ),
            (1.0, 10.0, 15.0)
        );
        assert_eq!(r.goodput, 0.5);
        assert_eq!(r.ttft_ms.mean.map(|m| (m * 1e6).round() / 1e6), Some(150.0));
        assert_eq!(r.itl_ms.p50.map(|m| m.round()), Some(100.0));
        assert_eq!(
            r.errors,
            vec!["request 2: HTTP 400 Bad Request: nope".to_string()]
        );
        let table = format_report(&r);
        for needle in [
            "Successful requests:",
            "Failed requests:",
            "P99 ITL (ms):",
            "Goodput (req/s, E2E≤1500ms)",
            "request 2: HTTP 400",
        ] {
            assert!(table.contains(needle), "{needle} missing from\n{table}");
        }
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["ttft_ms"]["p90"].as_f64().map(f64::round), Some(190.0));
        assert_eq!(v["endpoint"], "completions");
        assert!(v["slo"]["ttft_ms"].is_null());
    }
}
