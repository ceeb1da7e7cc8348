//! The generated side of one sequence: its sampler, stop conditions and streaming
//! detokenizer, applied token by token. The standalone [`Engine`](crate::engine::Engine) and
//! the serving scheduler both drive sequences through this one type.

use crate::grammar::{Constraint, GrammarCompiler};
use crate::sampling::{
    FinishReason, Sampler, SamplingParams, StopChecker, StopDecision, StopReason, TokenLogprobs,
};
use crate::tokenizer::{DecodeStream, Tokenizer};
use crate::Result;

/// What one accepted token means for its sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenOutcome {
    /// Keep going; `text` became final with this token (possibly empty).
    Continue {
        /// Text to stream.
        text: String,
    },
    /// The sequence ended; `text` is its last piece (stop strings and stop tokens excluded).
    Finished {
        /// Why.
        reason: FinishReason,
        /// Last text.
        text: String,
    },
}

/// One sequence's generated tokens and the machinery that judges them.
#[derive(Debug)]
pub struct Generation {
    output: Vec<u32>,
    sampler: Sampler,
    stop: StopChecker,
    decode: DecodeStream,
    /// The request's grammar state, when it asked for structured output.
    constraint: Option<Constraint>,
}

impl Generation {
    /// A fresh sequence with `params`, detokenizing with `tokenizer` (special tokens skipped).
    pub fn new(params: &SamplingParams, tokenizer: &Tokenizer) -> Self {
        Self {
            output: Vec::new(),
            sampler: Sampler::new(params),
            stop: StopChecker::new(params, tokenizer.eos_ids()),
            decode: tokenizer.decode_stream(true),
            constraint: None,
        }
    }

    /// A fresh sequence whose output must match `constraint` (compiled from
    /// [`SamplingParams::grammar`] by the caller, off the scheduler).
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> Self {
        self.constraint = constraint;
        self
    }

    /// A fresh sequence as [`Generation::new`], with its grammar compiled here when `params`
    /// name one and `constraint` is `None`.
    ///
    /// # Errors
    /// [`crate::ModelError::InvalidGrammar`] when the grammar cannot be compiled.
    pub fn constrained(
        params: &SamplingParams,
        tokenizer: &Tokenizer,
        constraint: Option<Constraint>,
    ) -> Result<Self> {
        let constraint = match (constraint, &params.grammar) {
            (Some(c), _) => Some(c),
            (None, Some(spec)) => Some(GrammarCompiler::for_tokenizer(tokenizer)?.compile(spec)?),
            (None, None) => None,
        };
        Ok(Self::new(params, tokenizer).with_constraint(constraint))
    }

    /// Computes the grammar's mask of the next token now, if the sequence has a grammar and
    /// the mask is not ready (the scheduler calls it while the forward pass runs).
    ///
    /// # Errors
    /// [`crate::ModelError::InvalidGrammar`] when the grammar failed.
    pub fn prepare_mask(&mut self) -> Result<()> {
        match &mut self.constraint {
            Some(c) => c.prepare_mask(),
            None => Ok(()),
        }
    }

    /// A sequence continued from `prior`, the tokens an earlier attempt already generated
    /// (request migration): they go through the detokenizer and the stop conditions as if
    /// sampled here (their text is not emitted again), and the sampler's random stream skips
    /// their draws, so greedy and seeded sampling go on exactly as the original would have.
    ///
    /// # Errors
    /// A detokenizer failure; [`crate::ModelError::InvalidSampling`] when `prior`
    /// already ends the sequence (a stop token, a stop string or `max_tokens`).
    pub fn resume(params: &SamplingParams, tokenizer: &Tokenizer, prior: &[u32]) -> Result<Self> {
        Self::resume_constrained(Self::new(params, tokenizer), prior)
    }

    /// As [`Generation::resume`], from a fresh `g` (with its grammar, which advances over
    /// `prior` too).
    ///
    /// # Errors
    /// As [`Generation::resume`]; [`crate::ModelError::InvalidGrammar`] when `prior` leaves
    /// the grammar.
    pub fn resume_constrained(mut g: Self, prior: &[u32]) -> Result<Self> {
        for (i, &token) in prior.iter().enumerate() {
            if let TokenOutcome::Finished { reason, .. } = g.accept(token)? {
                return Err(crate::ModelError::InvalidSampling(format!(
                    "the {} resumed token(s) already end the sequence at token {} ({})",
                    prior.len(),
                    i + 1,
                    reason.as_openai()
                )));
            }
        }
        g.sampler.skip_samples(prior.len());
        Ok(g)
    }

    /// Advances the sampler's random stream past `n` samples drawn elsewhere (the first token
    /// of a disaggregated request is sampled by the prefill instance from the same seed).
    pub fn skip_samples(&mut self, n: usize) {
        self.sampler.skip_samples(n);
    }

    /// The request's sampling parameters.
    pub fn params(&self) -> &SamplingParams {
        self.sampler.params()
    }

    /// Tokens generated so far (a stop token included, as the model produced it).
    pub fn output(&self) -> &[u32] {
        &self.output
    }

    /// Consumes the sequence, returning its tokens.
    pub fn into_output(self) -> Vec<u32> {
        self.output
    }

    /// Samples the next token from `logits` (penalties look at `prompt` and the output).
    /// The grammar of a constrained sequence is not applied here: the scheduler samples
    /// through [`Generation::sample_with_logprobs`], which masks first.
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32]) -> u32 {
        self.sampler.sample(logits, prompt, &self.output)
    }

    /// As [`Self::sample`], and, when the request asked for logprobs
    /// ([`SamplingParams::logprobs`]), the chosen token's log-probability and the top
    /// alternatives of `logits` as the model produced them (before penalties and temperature:
    /// see [`TokenLogprobs`]).
    ///
    /// A grammar masks `logits` first (tokens it forbids become −∞), so the logprobs are
    /// those of the masked row, as vLLM reports them.
    ///
    /// # Errors
    /// [`crate::ModelError::InvalidGrammar`] when the grammar failed or allows nothing.
    pub fn sample_with_logprobs(
        &mut self,
        logits: &mut [f32],
        prompt: &[u32],
    ) -> Result<(u32, Option<TokenLogprobs>)> {
        if let Some(c) = &mut self.constraint {
            c.apply(logits)?;
        }
        let Some(top_n) = self.sampler.params().logprobs else {
            return Ok((self.sample(logits, prompt), None));
        };
        // The sampler rewrites the row in place (penalties, temperature).
        let raw = logits.to_vec();
        let token = self.sample(logits, prompt);
        Ok((
            token,
            Some(TokenLogprobs::compute(&raw, token, top_n as usize)),
        ))
    }

    /// Appends `token` and applies the stop conditions.
    ///
    /// # Errors
    /// A detokenizer failure.
    pub fn accept(&mut self, token: u32) -> Result<TokenOutcome> {
        if let Some(c) = &mut self.constraint {
            c.advance(token)?;
        }
        self.output.push(token);
        let piece = self.decode.step(token)?.unwrap_or_default();
        Ok(match self.stop.push(token, &piece) {
            StopDecision::Continue { mut text_to_emit }
                if self.constraint.as_ref().is_some_and(Constraint::is_done) =>
            {
                // The grammar is complete and admits nothing more: stop as EOS would,
                // releasing what waited for a stop string and the detokenizer.
                text_to_emit.push_str(&self.stop.finish());
                text_to_emit.push_str(&self.decode.flush()?);
                TokenOutcome::Finished {
                    reason: FinishReason::Stop,
                    text: text_to_emit,
                }
            }
            StopDecision::Continue { text_to_emit } => {
                TokenOutcome::Continue { text: text_to_emit }
            }
            StopDecision::Stop {
                reason,
                mut text_to_emit,
            } => {
                if matches!(reason, StopReason::Length) {
                    // Nothing follows: release what the detokenizer still holds.
                    text_to_emit.push_str(&self.decode.flush()?);
                }
                TokenOutcome::Finished {
                    reason: reason.finish_reason(),
                    text: text_to_emit,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Runs `steps` samples over seeded random logits from `gen`, starting at step `from`.
    fn run(gen: &mut Generation, from: usize, steps: usize) -> (Vec<u32>, String) {
        let prompt = [1u32, 2, 3];
        let (mut tokens, mut text) = (Vec::new(), String::new());
        for step in from..from + steps {
            let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + step as u64);
            let mut logits: Vec<f32> = (0..256).map(|_| rng.random::<f32>() * 8.0 - 4.0).collect();
            let t = gen.sample(&mut logits, &prompt);
            tokens.push(t);
            match gen.accept(t).unwrap() {
                TokenOutcome::Continue { text: piece } => text.push_str(&piece),
                TokenOutcome::Finished { text: piece, .. } => {
                    text.push_str(&piece);
                    break;
                }
            }
        }
        (tokens, text)
    }

    #[test]
    fn a_resumed_sequence_continues_exactly_as_the_original() {
        let tok = Tokenizer::byte_level_synthetic();
        for (temperature, seed) in [(0.0, None), (0.9, Some(7)), (1.3, Some(42))] {
            let params = SamplingParams {
                max_tokens: 40,
                temperature,
                top_p: 0.95,
                seed,
                frequency_penalty: 0.3,
                ..SamplingParams::default()
            };
            let mut whole = Generation::new(&params, &tok);
            let (all, all_text) = run(&mut whole, 0, 40);
            assert_eq!(all.len(), 40);
            for cut in [1, 17, 39] {
                let mut first = Generation::new(&params, &tok);
                let (head, head_text) = run(&mut first, 0, cut);
                let mut resumed = Generation::resume(&params, &tok, &head).unwrap();
                assert_eq!(resumed.output(), &head[..]);
                let (tail, tail_text) = run(&mut resumed, cut, 40);
                assert_eq!([head, tail].concat(), all, "t={temperature} cut={cut}");
                assert_eq!(
                    format!("{head_text}{tail_text}"),
                    all_text,
                    "t={temperature} cut={cut}"
                );
            }
            // Tokens that already end the sequence cannot be continued.
            let e = Generation::resume(&params, &tok, &all).unwrap_err();
            assert!(e.to_string().contains("already end the sequence"), "{e}");
        }
    }
}
