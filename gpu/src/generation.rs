//! The generated side of one sequence: its sampler, stop conditions and streaming
//! detokenizer, applied token by token. The standalone [`Engine`](crate::engine::Engine) and
//! the serving scheduler both drive sequences through this one type.

use crate::sampling::{
    FinishReason, Sampler, SamplingParams, StopChecker, StopDecision, StopReason,
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
}

impl Generation {
    /// A fresh sequence with `params`, detokenizing with `tokenizer` (special tokens skipped).
    pub fn new(params: &SamplingParams, tokenizer: &Tokenizer) -> Self {
        Self {
            output: Vec::new(),
            sampler: Sampler::new(params),
            stop: StopChecker::new(params, tokenizer.eos_ids()),
            decode: tokenizer.decode_stream(true),
        }
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
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[u32]) -> u32 {
        self.sampler.sample(logits, prompt, &self.output)
    }

    /// Appends `token` and applies the stop conditions.
    ///
    /// # Errors
    /// A detokenizer failure.
    pub fn accept(&mut self, token: u32) -> Result<TokenOutcome> {
        self.output.push(token);
        let piece = self.decode.step(token)?.unwrap_or_default();
        Ok(match self.stop.push(token, &piece) {
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
