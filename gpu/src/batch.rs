//! What one forward step runs: a [`Batch`] of [`SeqChunk`]s (prefill chunks and decode
//! tokens), each with its KV block table and, in a vision-language prompt, the image rows
//! ([`EmbedSpan`]) that replace some of its token embeddings.
//!
//! A leaf of the crate: the model ([`crate::model`]), the attention kernels and the CUDA
//! executor all read it, and it reads none of them.

use crate::vision::ImageEmbeds;
use std::sync::Arc;

/// One sequence's part of a forward step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqChunk {
    /// Tokens to run: a prefill chunk, or the one newest token of a decode.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]` (= tokens of this sequence already in the cache).
    pub start_pos: usize,
    /// The sequence's KV blocks, covering at least `start_pos + tokens.len()` positions.
    pub block_table: Vec<u32>,
    /// Whether to return logits for the last token.
    pub want_logits: bool,
    /// Return logits for every token of the chunk, in order, instead (prompt logprobs): one
    /// row per token whatever `want_logits` says.
    pub all_logits: bool,
    /// Input embeddings that replace the token embeddings of some of `tokens` (an image's
    /// rows at its placeholder tokens, in a vision-language prompt); empty for text.
    pub embeds: Vec<EmbedSpan>,
}

/// Rows of input embeddings that replace the token embeddings of consecutive tokens of a
/// chunk: rows `from .. from + len` of an image's embeddings at the chunk's tokens
/// `at .. at + len`. Each row takes one position, as llava- and SmolVLM-style models count
/// them (a prefill chunk may hold part of an image: the rest is in the next chunk).
#[derive(Clone, Debug)]
pub struct EmbedSpan {
    /// Index in the chunk's `tokens` of the first replaced token.
    pub at: usize,
    /// The image's rows.
    pub image: Arc<ImageEmbeds>,
    /// First row of `image` used.
    pub from: usize,
    /// Rows used.
    pub len: usize,
}

impl PartialEq for EmbedSpan {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.from, self.len, self.image.digest)
            == (other.at, other.from, other.len, other.image.digest)
    }
}

impl Eq for EmbedSpan {}

impl SeqChunk {
    /// Positions (within the chunk) whose logits the forward pass returns.
    pub fn logit_rows(&self) -> std::ops::Range<usize> {
        let n = self.tokens.len();
        if self.all_logits {
            0..n
        } else if self.want_logits {
            n.saturating_sub(1)..n
        } else {
            0..0
        }
    }
}

/// A forward step over several sequences.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// The sequences.
    pub seqs: Vec<SeqChunk>,
}

impl Batch {
    /// Total tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}
