//! Sampling parameters, the token sampler and stop conditions, with OpenAI/vLLM semantics.
//!
//! - [`SamplingParams`]: the request's knobs, with [`SamplingParams::validate`] giving a
//!   precise `InvalidSampling` message for each out-of-range value.
//! - [`Sampler`]: turns one row of logits into a token id. The order is vLLM's: logit bias →
//!   penalties (repetition, frequency, presence) → temperature → top-k → top-p → min-p →
//!   sample from the softmax. Temperature 0 is greedy (argmax, lowest id on ties), applied
//!   after the bias and the penalties.
//! - [`StopChecker`]: EOS, stop token ids, stop strings over the incrementally decoded text, and
//!   the `max_tokens` length limit. Stop strings are excluded from the output, and text that
//!   might be the start of a stop string is held back until it is resolved.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::grammar::GrammarSpec;
use crate::{ModelError, Result};

/// Temperatures below this are treated as greedy (vLLM's `_SAMPLING_EPS`).
const SAMPLING_EPS: f32 = 1e-5;
/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// The most `stop_token_ids` a request may carry (every step checks each of them).
pub const MAX_STOP_TOKEN_IDS: usize = 256;
/// Highest temperature accepted.
pub const MAX_TEMPERATURE: f32 = 100.0;
/// Most alternatives (`top_logprobs`, completions' `logprobs: N`, `prompt_logprobs`) one
/// request may ask per token: vLLM's default `max_logprobs`, OpenAI's chat bound.
pub const MAX_LOGPROBS: u32 = 20;
/// Most `logit_bias` entries one request may carry (OpenAI's bound).
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 300;
/// Largest `logit_bias` magnitude (OpenAI's bound: -100 bans a token, 100 forces it).
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// What a logprob of minus infinity (a token the logits rule out) is reported as: JSON has no
/// infinity, and vLLM writes -9999.0 too.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// How one request samples and when it stops.
#[derive(
    Clone,
    Debug,
    PartialEq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens; `None` or 0 turns it off. Values above the
    /// vocabulary size are clamped.
    pub top_k: Option<u32>,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to
    /// at least `top_p`; 1 turns it off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's; 0 = off.
    pub min_p: f32,
    /// vLLM-style multiplicative penalty on every token seen in the prompt or the output:
    /// positive logits are divided by it, negative ones multiplied; 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI-style: subtracted once from the logit of every token already in the output.
    pub presence_penalty: f32,
    /// OpenAI-style: subtracted from a token's logit once per occurrence in the output.
    pub frequency_penalty: f32,
    /// Seed of the request's random generator; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Strings that end generation; they are not part of the returned text.
    pub stop: Vec<String>,
    /// Token ids that end generation (besides EOS).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS (benchmarks).
    pub ignore_eos: bool,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Report each generated token's logprob and this many alternatives (0..=
    /// [`MAX_LOGPROBS`]); `None`: no logprobs.
    pub logprobs: Option<u32>,
    /// Report each prompt token's logprob (the first's is none) and this many alternatives
    /// (0..=[`MAX_LOGPROBS`]); `None`: no prompt logprobs. The prompt is then computed in
    /// full (no prefix-cache hit: a cached token has no logits).
    pub prompt_logprobs: Option<u32>,
    /// OpenAI's `logit_bias`: added to the logits of these tokens before everything else the
    /// sampler does (penalties, temperature, greedy's argmax), as vLLM does; at most
    /// [`MAX_LOGIT_BIAS_ENTRIES`] entries, each in [-[`MAX_LOGIT_BIAS`], [`MAX_LOGIT_BIAS`]].
    /// Logprobs are reported before it (see [`TokenLogprobs`]).
    pub logit_bias: Vec<LogitBias>,
    /// Structured output: what the generated text must match (see [`crate::grammar`]). The
    /// grammar masks the logits before everything else (logprobs included), allows EOS only
    /// where it accepts, and ends the sequence when it admits nothing more.
    pub grammar: Option<GrammarSpec>,
}

/// One entry of [`SamplingParams::logit_bias`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct LogitBias {
    /// Token id.
    pub token: u32,
    /// Added to its logit.
    pub bias: f32,
}

impl Default for SamplingParams {
    /// Greedy, no penalties, 16 tokens (the OpenAI completions default).
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            max_tokens: 16,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            grammar: None,
        }
    }
}

fn invalid(msg: String) -> ModelError {
    ModelError::InvalidSampling(msg)
}

impl SamplingParams {
    /// Greedy parameters with the given token budget.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            max_tokens,
            ..Self::default()
        }
    }

    /// Whether sampling reduces to argmax (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature < SAMPLING_EPS || self.top_k == Some(1)
    }

    /// Checks every field against its valid range for a model of `vocab_size` tokens.
    ///
    /// # Errors
    /// `ModelError::InvalidSampling` naming the first offending field, its value and the
    /// accepted range.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        if !self.temperature.is_finite() || !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return Err(invalid(format!(
                "temperature must be in [0, {MAX_TEMPERATURE}], got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid(format!(
                "min_p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(invalid(format!(
                "repetition_penalty must be a finite number > 0, got {}",
                self.repetition_penalty
            )));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(invalid(format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        if self.max_tokens == 0 {
            return Err(invalid("max_tokens must be at least 1, got 0".into()));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(invalid(format!(
                "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                self.stop.len()
            )));
        }
        for s in &self.stop {
            if s.is_empty() {
                return Err(invalid("stop strings must not be empty".into()));
            }
            if s.len() > MAX_STOP_STRING_BYTES {
                return Err(invalid(format!(
                    "stop strings must be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}",
                    s.len()
                )));
            }
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(invalid(format!(
                "at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {}",
                self.stop_token_ids.len()
            )));
        }
        if let Some(&id) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            return Err(invalid(format!(
                "stop_token_ids entry {id} is outside the vocabulary of {vocab_size} tokens"
            )));
        }
        for (name, n) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(n) = n.filter(|&n| n > MAX_LOGPROBS) {
                return Err(invalid(format!(
                    "{name} must be in [0, {MAX_LOGPROBS}], got {n}"
                )));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS_ENTRIES {
            return Err(invalid(format!(
                "logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {}",
                self.logit_bias.len()
            )));
        }
        for b in &self.logit_bias {
            if b.token as usize >= vocab_size {
                return Err(invalid(format!(
                    "logit_bias token {} is outside the vocabulary of {vocab_size} tokens",
                    b.token
                )));
            }
            if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b.bias) {
                return Err(invalid(format!(
                    "logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {} for token {}",
                    b.bias, b.token
                )));
            }
        }
        if let Some(grammar) = &self.grammar {
            grammar.validate()?;
        }
        Ok(())
    }
}

/// One alternative of a [`TokenLogprobs`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TopLogprob {
    /// Token id.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
}

/// A token's log-probability and the most likely alternatives at its position.
///
/// The convention is vLLM's default (`logprobs_mode = raw_logprobs`): the log-softmax of the
/// model's logits as they come out of the forward pass, before penalties, temperature, top-k,
/// top-p and min-p. Computed in f64 with a stable log-sum-exp; minus infinity is reported as
/// [`LOGPROB_FLOOR`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TokenLogprobs {
    /// The token (sampled, or the prompt's).
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens, most likely first (lowest id first on ties); as many as asked.
    pub top: Vec<TopLogprob>,
}

impl TokenLogprobs {
    /// The log-softmax of `logits` at `token`, and its `top_n` largest entries. NaN logits
    /// count as minus infinity; an id outside `logits` gets [`LOGPROB_FLOOR`].
    pub fn compute(logits: &[f32], token: u32, top_n: usize) -> Self {
        let clean = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
        let max = logits
            .iter()
            .map(|&v| clean(v))
            .fold(f32::NEG_INFINITY, f32::max);
        let lse = if max.is_infinite() {
            max as f64
        } else {
            let m = max as f64;
            let sum: f64 = logits.iter().map(|&v| ((clean(v) as f64) - m).exp()).sum();
            m + sum.ln()
        };
        let logprob_of = |v: f32| -> f32 {
            let lp = (clean(v) as f64 - lse) as f32;
            if lp.is_finite() {
                lp.min(0.0)
            } else {
                LOGPROB_FLOOR
            }
        };
        let top_n = top_n.min(logits.len());
        let mut top: Vec<(f32, u32)> = Vec::new();
        if top_n > 0 {
            top.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
            if top_n < top.len() {
                top.select_nth_unstable_by(top_n - 1, by_logit_desc);
                top.truncate(top_n);
            }
            top.sort_unstable_by(by_logit_desc);
        }
        TokenLogprobs {
            token,
            logprob: logits
                .get(token as usize)
                .map_or(LOGPROB_FLOOR, |&v| logprob_of(v)),
            top: top
                .into_iter()
                .map(|(l, t)| TopLogprob {
                    token: t,
                    logprob: logprob_of(l),
                })
                .collect(),
        }
    }

    /// Checks logprobs that came from elsewhere (a peer instance, `kv_transfer_params`): at
    /// most `max_top` alternatives, ids inside the vocabulary, every value finite and ≤ 0.
    ///
    /// # Errors
    /// The first [`LogprobsError`] found.
    pub fn validate(
        &self,
        vocab_size: usize,
        max_top: usize,
    ) -> std::result::Result<(), LogprobsError> {
        if self.top.len() > max_top {
            return Err(LogprobsError::TooManyTop {
                got: self.top.len(),
                max_top,
            });
        }
        let ok = |lp: f32| lp.is_finite() && lp <= 0.0;
        std::iter::once((self.token, self.logprob))
            .chain(self.top.iter().map(|t| (t.token, t.logprob)))
            .try_for_each(|(token, logprob)| {
                if token as usize >= vocab_size {
                    Err(LogprobsError::OutsideVocabulary { token, vocab_size })
                } else if !ok(logprob) {
                    Err(LogprobsError::NotALogprob { token, logprob })
                } else {
                    Ok(())
                }
            })
    }
}

/// Why logprobs that came from elsewhere were refused ([`TokenLogprobs::validate`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LogprobsError {
    /// More alternatives than the request asked for.
    #[error("{got} top logprobs, more than the {max_top} asked")]
    TooManyTop {
        /// Alternatives given.
        got: usize,
        /// Alternatives asked.
        max_top: usize,
    },
    /// A token id (the chosen one or an alternative) outside the vocabulary.
    #[error("token {token} is outside the vocabulary of {vocab_size}")]
    OutsideVocabulary {
        /// The id.
        token: u32,
        /// The vocabulary's size.
        vocab_size: usize,
    },
    /// A value that is no log probability (NaN, infinite or above 0).
    #[error("logprob {logprob} of token {token} is not a finite value <= 0")]
    NotALogprob {
        /// The token it is for.
        token: u32,
        /// The value.
        logprob: f32,
    },
}

/// Counts of each distinct token in `tokens` (sorted by id), reusing `scratch`.
fn token_counts(tokens: &[u32], scratch: &mut Vec<u32>) -> Vec<(u32, u32)> {
    scratch.clear();
    scratch.extend_from_slice(tokens);
    scratch.sort_unstable();
    let mut counts: Vec<(u32, u32)> = Vec::new();
    for &t in scratch.iter() {
        match counts.last_mut() {
            Some((id, n)) if *id == t => *n += 1,
            _ => counts.push((t, 1)),
        }
    }
    counts
}

/// Applies repetition (prompt + output), frequency and presence (output) penalties in place.
/// Ids outside `logits` are ignored.
pub fn apply_penalties(
    logits: &mut [f32],
    params: &SamplingParams,
    prompt_tokens: &[u32],
    output_tokens: &[u32],
) {
    let mut scratch = Vec::new();
    apply_penalties_with(logits, params, prompt_tokens, output_tokens, &mut scratch);
}

fn apply_penalties_with(
    logits: &mut [f32],
    params: &SamplingParams,
    prompt_tokens: &[u32],
    output_tokens: &[u32],
    scratch: &mut Vec<u32>,
) {
    let rp = params.repetition_penalty;
    if rp != 1.0 {
        scratch.clear();
        scratch.extend_from_slice(prompt_tokens);
        scratch.extend_from_slice(output_tokens);
        scratch.sort_unstable();
        scratch.dedup();
        for &t in scratch.iter() {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / rp } else { *l * rp };
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        for (t, n) in token_counts(output_tokens, scratch) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.frequency_penalty * n as f32 + params.presence_penalty;
            }
        }
    }
}

/// Index of the largest value; the lowest index wins ties. NaNs are never chosen unless all
/// values are NaN (then 0).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v || (!found && !v.is_nan()) {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

/// Descending by logit, ascending by id on ties (NaN sorts last).
fn by_logit_desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    key(b.0).total_cmp(&key(a.0)).then(a.1.cmp(&b.1))
}

/// Samples token ids from logits for one request.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    candidates: Vec<(f32, u32)>,
    probs: Vec<f32>,
    scratch: Vec<u32>,
}

impl Sampler {
    /// A sampler for `params`, seeded from `params.seed` or from the OS.
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params: params.clone(),
            rng,
            candidates: Vec::new(),
            probs: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Advances the random stream past `n` samples, as if they had been drawn: a sequence
    /// continued on another instance (request migration) then samples exactly what the
    /// original would have. Greedy sampling draws nothing.
    pub fn skip_samples(&mut self, n: usize) {
        if self.params.is_greedy() {
            return;
        }
        for _ in 0..n {
            let _ = self.rng.random::<f32>();
        }
    }

    /// Picks the next token from `logits` (modified in place by penalties and temperature).
    /// `prompt_tokens` and `output_tokens` feed the penalties.
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> u32 {
        assert!(!logits.is_empty(), "cannot sample from an empty logits row");
        let p = &self.params;
        for b in &p.logit_bias {
            if let Some(l) = logits.get_mut(b.token as usize) {
                *l += b.bias;
            }
        }
        apply_penalties_with(logits, p, prompt_tokens, output_tokens, &mut self.scratch);
        if p.is_greedy() {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        for l in logits.iter_mut() {
            *l *= inv_t;
        }

        // Candidates: the top-k (partial selection), else everything.
        let n = logits.len();
        let k = match p.top_k {
            Some(k) if k > 0 && (k as usize) < n => k as usize,
            _ => n,
        };
        self.candidates.clear();
        self.candidates
            .extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        if k < n {
            self.candidates.select_nth_unstable_by(k - 1, by_logit_desc);
            self.candidates.truncate(k);
        }
        let need_sorted = p.top_p < 1.0;
        if need_sorted {
            self.candidates.sort_unstable_by(by_logit_desc);
        }

        // Softmax over the candidates.
        let max = self
            .candidates
            .iter()
            .map(|c| c.0)
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        // Exactly one draw per non-greedy sample, taken here (before any early return), so a
        // sequence's random stream is a function of (seed, tokens sampled so far): a request
        // continued elsewhere replays it with `Sampler::skip_samples`.
        let draw = self.rng.random::<f32>();
        if max == f32::NEG_INFINITY {
            return argmax(logits);
        }
        self.probs.clear();
        self.probs.extend(self.candidates.iter().map(|c| {
            if c.0.is_nan() {
                0.0
            } else {
                (c.0 - max).exp()
            }
        }));
        let mut total: f32 = self.probs.iter().sum();

        // Top-p on the sorted candidates: keep while the mass before a token is < top_p.
        if need_sorted {
            let target = p.top_p * total;
            let mut cum = 0.0f32;
            let mut keep = self.probs.len();
            for (i, &pr) in self.probs.iter().enumerate() {
                if cum >= target && i > 0 {
                    keep = i;
                    break;
                }
                cum += pr;
            }
            self.probs.truncate(keep);
            self.candidates.truncate(keep);
            total = self.probs.iter().sum();
        }

        // Min-p relative to the most likely token (whose unnormalised weight is 1).
        if p.min_p > 0.0 {
            let threshold = p.min_p * self.probs.iter().copied().fold(0.0, f32::max);
            for pr in self.probs.iter_mut() {
                if *pr < threshold {
                    *pr = 0.0;
                }
            }
            total = self.probs.iter().sum();
        }

        let mut u = draw * total;
        let mut last_nonzero = 0;
        for (i, &pr) in self.probs.iter().enumerate() {
            if pr > 0.0 {
                last_nonzero = i;
                if u < pr {
                    return self.candidates[i].1;
                }
                u -= pr;
            }
        }
        // Rounding left `u` past the end: take the last token with weight.
        self.candidates[last_nonzero].1
    }
}

/// Why a sequence stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// The model produced one of the request's `stop_token_ids`.
    StopToken(u32),
    /// The text contained one of the request's stop strings (which is not emitted).
    StopString(String),
    /// `max_tokens` were generated.
    Length,
}

impl StopReason {
    /// The OpenAI `finish_reason` for this stop.
    pub fn finish_reason(&self) -> FinishReason {
        match self {
            StopReason::Length => FinishReason::Length,
            _ => FinishReason::Stop,
        }
    }
}

/// OpenAI's `finish_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// A natural stop: EOS, stop token or stop string.
    Stop,
    /// The token budget ran out.
    Length,
}

impl FinishReason {
    /// `"stop"` or `"length"`.
    pub fn as_openai(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What to do after one generated token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopDecision {
    /// Keep generating; send `text_to_emit` (possibly empty) to the client.
    Continue {
        /// Text that is final and may be streamed.
        text_to_emit: String,
    },
    /// Stop; send `text_to_emit` (possibly empty) as the last piece.
    Stop {
        /// Why.
        reason: StopReason,
        /// The last text of the sequence (never includes a stop string).
        text_to_emit: String,
    },
}

/// Watches one sequence's tokens and text for stop conditions.
///
/// The text of an EOS or stop token is not emitted. Text that could be the start of a stop
/// string is held back until a later token completes the stop string (it is then dropped,
/// with everything after it) or rules it out (it is then released).
#[derive(Debug, Clone)]
pub struct StopChecker {
    eos_ids: Vec<u32>,
    ignore_eos: bool,
    stop_token_ids: Vec<u32>,
    stop: Vec<String>,
    max_tokens: usize,
    generated: usize,
    held: String,
    stopped: bool,
}

impl StopChecker {
    /// A checker for `params`; `eos_ids` are the model's end-of-generation tokens.
    pub fn new(params: &SamplingParams, eos_ids: &[u32]) -> Self {
        StopChecker {
            eos_ids: eos_ids.to_vec(),
            ignore_eos: params.ignore_eos,
            stop_token_ids: params.stop_token_ids.clone(),
            stop: params.stop.clone(),
            max_tokens: params.max_tokens,
            generated: 0,
            held: String::new(),
            stopped: false,
        }
    }

    /// Tokens seen so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Whether a `Stop` decision was already returned.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Records one generated `token` whose decoded text is `new_text` (may be empty while a
    /// character is incomplete) and says whether to go on.
    pub fn push(&mut self, token: u32, new_text: &str) -> StopDecision {
        self.generated += 1;
        let token_stop = if !self.ignore_eos && self.eos_ids.contains(&token) {
            Some(StopReason::Eos)
        } else if self.stop_token_ids.contains(&token) {
            Some(StopReason::StopToken(token))
        } else {
            None
        };
        if let Some(reason) = token_stop {
            let held = std::mem::take(&mut self.held);
            return self.stop_with(reason, held);
        }
        self.held.push_str(new_text);

        // A complete stop string: emit what precedes the earliest one.
        let earliest = self
            .stop
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|pos| (pos, s)))
            .min_by_key(|(pos, s)| (*pos, std::cmp::Reverse(s.len())));
        if let Some((pos, s)) = earliest {
            let s = s.clone();
            let emit = self.held[..pos].to_string();
            self.held.clear();
            return self.stop_with(StopReason::StopString(s), emit);
        }

        // Hold back the longest suffix that could still grow into a stop string.
        let hold = self.partial_match_len();
        let split = self.held.len() - hold;
        let emit: String = self.held[..split].to_string();
        self.held.drain(..split);

        if self.generated >= self.max_tokens {
            let mut emit = emit;
            emit.push_str(&std::mem::take(&mut self.held));
            return self.stop_with(StopReason::Length, emit);
        }
        StopDecision::Continue { text_to_emit: emit }
    }

    /// Releases any held-back text (call when the sequence ends for another reason, e.g. an
    /// abort).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn stop_with(&mut self, reason: StopReason, text_to_emit: String) -> StopDecision {
        self.stopped = true;
        StopDecision::Stop {
            reason,
            text_to_emit,
        }
    }

    /// Length in bytes of the longest suffix of `held` that is a proper prefix of a stop string.
    fn partial_match_len(&self) -> usize {
        let mut best = 0;
        for s in &self.stop {
            let max = s.len().saturating_sub(1).min(self.held.len());
            for len in (best + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start) && s.starts_with(&self.held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    fn random_logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random::<f32>() * 10.0 - 5.0).collect()
    }

    #[test]
    fn logit_bias_moves_greedy_and_sampling_and_is_bounded() {
        let bias = |token, bias| LogitBias { token, bias };
        let mut s = Sampler::new(&params(|p| p.logit_bias = vec![bias(2, 100.0)]));
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[], &[]), 2);
        let mut s = Sampler::new(&params(|p| p.logit_bias = vec![bias(1, -100.0)]));
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[], &[]), 3);
        let p = params(|p| {
            p.temperature = 1.0;
            p.seed = Some(3);
            p.logit_bias = vec![bias(7, 100.0)];
        });
        let mut s = Sampler::new(&p);
        let logits = random_logits(1000, 1);
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), 7);
        }
        assert!(p.validate(1000).is_ok());
        for (bad, needle) in [
            (vec![bias(1000, 1.0)], "outside the vocabulary"),
            (vec![bias(1, 100.5)], "[-100, 100]"),
            (vec![bias(1, f32::NAN)], "[-100, 100]"),
            (vec![bias(1, 0.0); 301], "at most 300"),
        ] {
            let e = params(|p| p.logit_bias = bad).validate(1000).unwrap_err();
            assert!(e.to_string().contains("logit_bias"), "{e}");
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[test]
    fn sampling_greedy_argmax_and_ties() {
        let mut s = Sampler::new(&SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[], &[]), 1);
        assert_eq!(
            s.sample(&mut [1.0, 5.0, 5.0, 5.0], &[], &[]),
            1,
            "lowest index wins ties"
        );
        assert_eq!(
            s.sample(&mut [f32::NAN, -1.0, -2.0], &[], &[]),
            1,
            "NaN never wins"
        );
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn sampling_seeded_reproducible_and_seeds_differ() {
        let logits = random_logits(49152, 7);
        let draw = |seed| {
            let p = params(|p| {
                p.temperature = 1.0;
                p.seed = Some(seed);
            });
            let mut s = Sampler::new(&p);
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
        // Real sampling, not argmax.
        assert!(draw(1).iter().any(|&t| t != argmax(&logits)));
    }

    #[test]
    fn sampling_top_k_1_and_tiny_top_p_equal_greedy() {
        for seed in 0..20 {
            let logits = random_logits(1000, seed);
            let greedy = argmax(&logits);
            let mut s = Sampler::new(&params(|p| {
                p.temperature = 1.5;
                p.top_k = Some(1);
                p.seed = Some(seed);
            }));
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), greedy);
            let mut s = Sampler::new(&params(|p| {
                p.temperature = 1.5;
                p.top_p = 1e-6;
                p.seed = Some(seed);
            }));
            assert_eq!(s.sample(&mut logits.clone(), &[], &[]), greedy);
        }
    }

    #[test]
    fn sampling_top_k_restricts_to_k_best() {
        let logits: Vec<f32> = (0..100).map(|i| i as f32 * 0.01).collect();
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 5.0;
            p.top_k = Some(3);
            p.seed = Some(3);
        }));
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..300 {
            seen.insert(s.sample(&mut logits.clone(), &[], &[]));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![97, 98, 99]);
    }

    #[test]
    fn sampling_top_p_keeps_nucleus() {
        // probs ∝ [0.5, 0.3, 0.15, 0.05]; top_p 0.7 keeps the first two.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.7;
            p.seed = Some(9);
        }));
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..300 {
            seen.insert(s.sample(&mut logits.clone(), &[], &[]));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn sampling_min_p_filters() {
        // probs ∝ [0.5, 0.3, 0.15, 0.05]; min_p 0.5 keeps tokens with p >= 0.25: 0 and 1.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 1.0;
            p.min_p = 0.5;
            p.seed = Some(11);
        }));
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..300 {
            seen.insert(s.sample(&mut logits.clone(), &[], &[]));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn sampling_distribution_matches_softmax() {
        let probs = [0.6f32, 0.3, 0.1];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(&params(|p| {
            p.temperature = 1.0;
            p.seed = Some(5);
        }));
        let mut counts = [0usize; 3];
        let n = 20_000;
        for _ in 0..n {
            counts[s.sample(&mut logits.clone(), &[], &[]) as usize] += 1;
        }
        for (c, p) in counts.iter().zip(probs) {
            let f = *c as f32 / n as f32;
            assert!((f - p).abs() < 0.02, "frequency {f} vs probability {p}");
        }
    }

    #[test]
    fn sampling_repetition_penalty_divides_positive_multiplies_negative() {
        let p = params(|p| p.repetition_penalty = 2.0);
        let mut logits = vec![4.0, -4.0, 4.0, -4.0, 1.0];
        apply_penalties(&mut logits, &p, &[0, 1], &[1, 99]);
        // 0 in prompt, 1 in both (once), 2/3/4 unseen; 99 out of range is ignored.
        assert_eq!(logits, vec![2.0, -8.0, 4.0, -4.0, 1.0]);
    }

    #[test]
    fn sampling_frequency_and_presence_penalties_on_output_only() {
        let p = params(|p| {
            p.frequency_penalty = 0.5;
            p.presence_penalty = 0.25;
        });
        let mut logits = vec![1.0; 4];
        apply_penalties(&mut logits, &p, &[3, 3, 3], &[0, 0, 0, 1]);
        assert_eq!(logits, vec![1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0, 1.0]);
    }

    #[test]
    fn sampling_penalties_change_greedy_choice() {
        let p = params(|p| p.frequency_penalty = 2.0);
        let mut s = Sampler::new(&p);
        assert_eq!(s.sample(&mut [3.0, 2.5], &[], &[0]), 1);
        assert_eq!(s.sample(&mut [3.0, 2.5], &[], &[]), 0);
    }

    #[test]
    fn logprobs_are_an_exact_stable_log_softmax() {
        // Huge logits: a naive exp overflows, the log-sum-exp does not.
        let logits = [1000.0f32, 999.0, 990.0, f32::NEG_INFINITY, f32::NAN];
        let lp = TokenLogprobs::compute(&logits, 1, 3);
        let z = (1.0f64 + (-1.0f64).exp() + (-10.0f64).exp()).ln();
        assert!((lp.logprob as f64 - (-1.0 - z)).abs() < 1e-6, "{lp:?}");
        let ids: Vec<u32> = lp.top.iter().map(|t| t.token).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        assert!((lp.top[0].logprob as f64 + z).abs() < 1e-6);
        // Excluded tokens report the floor, never -inf or NaN.
        assert_eq!(TokenLogprobs::compute(&logits, 3, 0).logprob, LOGPROB_FLOOR);
        assert_eq!(TokenLogprobs::compute(&logits, 4, 0).logprob, LOGPROB_FLOOR);
        assert_eq!(
            TokenLogprobs::compute(&logits, 99, 0).logprob,
            LOGPROB_FLOOR
        );
        // Over a random row: probabilities of the whole row sum to 1, any top-k to at most 1,
        // ties go to the lowest id, and the values pass the receiver's check.
        let row = random_logits(300, 5);
        let all = TokenLogprobs::compute(&row, 0, row.len());
        let sum: f64 = all.top.iter().map(|t| (t.logprob as f64).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-4, "{sum}");
        let top5 = TokenLogprobs::compute(&row, 0, 5);
        assert!(
            top5.top
                .iter()
                .map(|t| (t.logprob as f64).exp())
                .sum::<f64>()
                <= 1.0
        );
        assert_eq!(top5.top[..], all.top[..5]);
        assert_eq!(top5.top[0].token, argmax(&row));
        top5.validate(300, 5).unwrap();
        let ties = TokenLogprobs::compute(&[2.0, 5.0, 5.0, 1.0], 2, 2);
        assert_eq!((ties.top[0].token, ties.top[1].token), (1, 2));
        assert_eq!(ties.top[0].logprob, ties.logprob);
    }

    #[test]
    fn remote_logprobs_are_checked() {
        let good = TokenLogprobs::compute(&[1.0, 2.0, 3.0], 2, 2);
        assert!(good.validate(3, 2).is_ok());
        let e = good.validate(3, 1).unwrap_err();
        assert_eq!(e, LogprobsError::TooManyTop { got: 2, max_top: 1 });
        assert_eq!(e.to_string(), "2 top logprobs, more than the 1 asked");
        let e = good.validate(2, 2).unwrap_err();
        assert!(
            matches!(
                e,
                LogprobsError::OutsideVocabulary {
                    token: 2,
                    vocab_size: 2
                }
            ),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "token 2 is outside the vocabulary of 2");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.5] {
            let mut b = good.clone();
            b.top[1].logprob = bad;
            let e = b.validate(3, 2).unwrap_err();
            assert!(
                matches!(e, LogprobsError::NotALogprob { .. }),
                "{bad}: {e:?}"
            );
            assert!(e.to_string().contains("not a finite value <= 0"), "{e}");
        }
    }

    #[test]
    fn sampling_validation_messages() {
        let v = 100;
        let err = |f: fn(&mut SamplingParams)| params(f).validate(v).unwrap_err().to_string();
        assert!(SamplingParams::default().validate(v).is_ok());
        assert!(err(|p| p.temperature = -0.1).contains("temperature must be in [0, 100], got -0.1"));
        assert!(err(|p| p.temperature = f32::NAN).contains("temperature"));
        assert!(err(|p| p.temperature = 101.0).contains("temperature"));
        assert!(err(|p| p.top_p = 0.0).contains("top_p must be in (0, 1], got 0"));
        assert!(err(|p| p.top_p = 1.5).contains("top_p"));
        assert!(err(|p| p.min_p = -0.5).contains("min_p must be in [0, 1], got -0.5"));
        assert!(err(|p| p.repetition_penalty = 0.0)
            .contains("repetition_penalty must be a finite number > 0"));
        assert!(err(|p| p.presence_penalty = 2.5)
            .contains("presence_penalty must be in [-2, 2], got 2.5"));
        assert!(err(|p| p.frequency_penalty = -3.0)
            .contains("frequency_penalty must be in [-2, 2], got -3"));
        assert!(err(|p| p.max_tokens = 0).contains("max_tokens must be at least 1"));
        assert!(err(|p| p.stop = vec!["x".into(); 17]).contains("at most 16 stop strings"));
        assert!(err(|p| p.stop = vec![String::new()]).contains("must not be empty"));
        assert!(err(|p| p.stop_token_ids = vec![100]).contains("stop_token_ids entry 100"));
        assert!(err(|p| p.stop_token_ids = vec![1; MAX_STOP_TOKEN_IDS + 1])
            .contains("at most 256 stop_token_ids"));
        assert!(
            params(|p| p.top_k = Some(1_000_000)).validate(v).is_ok(),
            "top_k is clamped"
        );
        let e = params(|p| p.top_p = 0.0).validate(v).unwrap_err();
        assert_eq!(e.kind(), "invalid_sampling");
    }

    #[test]
    fn sampling_params_serde_defaults() {
        let p: SamplingParams =
            serde_json::from_str(r#"{"temperature":0.7,"stop":["\n"]}"#).unwrap();
        assert_eq!(p.temperature, 0.7);
        assert_eq!(p.max_tokens, 16);
        assert_eq!(p.stop, vec!["\n".to_string()]);
    }

    fn cont(text: &str) -> StopDecision {
        StopDecision::Continue {
            text_to_emit: text.into(),
        }
    }

    #[test]
    fn stop_string_split_across_tokens_is_caught_and_excluded() {
        let p = params(|p| {
            p.stop = vec!["STOP".into()];
            p.max_tokens = 100;
        });
        let mut c = StopChecker::new(&p, &[2]);
        assert_eq!(c.push(10, "hello S"), cont("hello "));
        assert_eq!(c.push(11, "TO"), cont(""));
        assert_eq!(
            c.push(12, "P and more"),
            StopDecision::Stop {
                reason: StopReason::StopString("STOP".into()),
                text_to_emit: String::new()
            }
        );
        assert!(c.is_stopped());
    }

    #[test]
    fn stop_held_text_released_when_match_fails() {
        let p = params(|p| {
            p.stop = vec!["STOP".into(), "\n\n".into()];
            p.max_tokens = 100;
        });
        let mut c = StopChecker::new(&p, &[2]);
        assert_eq!(c.push(1, "a ST"), cont("a "));
        assert_eq!(c.push(3, "ORE\n"), cont("STORE"));
        assert_eq!(c.finish(), "\n");
    }

    #[test]
    fn stop_eos_stop_token_and_length() {
        let p = params(|p| {
            p.stop_token_ids = vec![7];
            p.max_tokens = 3;
            p.stop = vec!["xyz".into()];
        });
        let mut c = StopChecker::new(&p, &[2]);
        assert_eq!(c.push(5, "ab x"), cont("ab "));
        assert_eq!(
            c.push(2, "<|im_end|>"),
            StopDecision::Stop {
                reason: StopReason::Eos,
                text_to_emit: "x".into()
            }
        );
        let mut c = StopChecker::new(&p, &[2]);
        assert!(matches!(
            c.push(7, "t"),
            StopDecision::Stop {
                reason: StopReason::StopToken(7),
                ..
            }
        ));
        let mut c = StopChecker::new(&p, &[2]);
        c.push(5, "a");
        c.push(5, "b");
        let d = c.push(5, "x");
        assert_eq!(
            d,
            StopDecision::Stop {
                reason: StopReason::Length,
                text_to_emit: "x".into()
            }
        );
        assert_eq!(StopReason::Length.finish_reason().as_openai(), "length");
        assert_eq!(StopReason::Eos.finish_reason().as_openai(), "stop");
    }

    #[test]
    fn stop_ignore_eos_keeps_going() {
        let p = params(|p| {
            p.ignore_eos = true;
            p.max_tokens = 10;
        });
        let mut c = StopChecker::new(&p, &[2]);
        assert_eq!(c.push(2, "e"), cont("e"));
    }

    #[test]
    fn stop_earliest_of_several_strings_wins_and_multibyte_safe() {
        let p = params(|p| {
            p.stop = vec!["é!".into(), "b".into()];
            p.max_tokens = 10;
        });
        let mut c = StopChecker::new(&p, &[]);
        assert_eq!(c.push(1, "aé"), cont("a"));
        assert_eq!(
            c.push(1, "!b"),
            StopDecision::Stop {
                reason: StopReason::StopString("é!".into()),
                text_to_emit: String::new()
            }
        );
    }
}
