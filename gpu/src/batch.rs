//! What one forward step runs: a [`Batch`] of [`SeqChunk`]s (prefill chunks and decode
//! tokens), each with its KV block table and, in a vision-language prompt, the image rows
//! ([`EmbedSpan`]) that replace some of its token embeddings.
//!
//! A leaf of the crate: the model ([`crate::model`]), the attention kernels and the CUDA
//! executor all read it, and it reads none of them.

use crate::vision::ImageEmbeds;
use crate::ModelError;
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
    /// Checks that every image span of sequence `i` lies inside its tokens and its image's
    /// rows, with rows of the model's `width` (both backends run this before any work: the
    /// CUDA kernels index without bounds checks).
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] naming the first span that does not fit.
    pub fn check_embeds(&self, i: usize, width: usize) -> Result<(), ModelError> {
        for e in &self.embeds {
            let fits =
                e.at.checked_add(e.len)
                    .is_some_and(|end| end <= self.tokens.len())
                    && e.from
                        .checked_add(e.len)
                        .is_some_and(|end| end <= e.image.rows)
                    && e.image.width == width
                    && e.image.data.len() == e.image.rows * e.image.width;
            if !fits {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i}: embeddings at {}..+{} (rows {}.. of {} x {}) do not fit its \
                     {} tokens of width {width}",
                    e.at,
                    e.len,
                    e.from,
                    e.image.rows,
                    e.image.width,
                    self.tokens.len(),
                )));
            }
        }
        Ok(())
    }

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

impl Batch {
    /// The image rows of a step: for every row of every [`EmbedSpan`], in batch order, the
    /// step row it replaces (sequences concatenated) and its values. Spans must have been
    /// checked ([`SeqChunk::check_embeds`]).
    pub fn image_rows(&self) -> impl Iterator<Item = (usize, &[f32])> + '_ {
        let offsets = self.seqs.iter().scan(0, |acc, s| {
            let off = *acc;
            *acc += s.tokens.len();
            Some(off)
        });
        self.seqs.iter().zip(offsets).flat_map(|(s, off)| {
            s.embeds.iter().flat_map(move |e| {
                (0..e.len).map(move |k| (off + e.at + k, e.image.row(e.from + k)))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vision::ImageDigest;

    fn image(rows: usize, width: usize, seed: u8) -> Arc<ImageEmbeds> {
        Arc::new(ImageEmbeds {
            digest: ImageDigest([seed; 32]),
            rows,
            width,
            data: (0..rows * width)
                .map(|v| v as f32 + f32::from(seed) * 1000.0)
                .collect(),
        })
    }

    fn chunk(tokens: usize, embeds: Vec<EmbedSpan>) -> SeqChunk {
        SeqChunk {
            tokens: vec![0; tokens],
            start_pos: 0,
            block_table: vec![0],
            want_logits: true,
            all_logits: false,
            embeds,
        }
    }

    #[test]
    fn image_rows_name_their_step_rows_across_sequences() {
        let (a, b) = (image(4, 2, 1), image(3, 2, 2));
        let batch = Batch {
            seqs: vec![
                // Rows 1..3 of `a` at tokens 2..4 of a 5-token chunk.
                chunk(
                    5,
                    vec![EmbedSpan {
                        at: 2,
                        image: a.clone(),
                        from: 1,
                        len: 2,
                    }],
                ),
                chunk(1, Vec::new()),
                // All of `b` at tokens 0..3, then row 0 of `a` at token 4.
                chunk(
                    6,
                    vec![
                        EmbedSpan {
                            at: 0,
                            image: b.clone(),
                            from: 0,
                            len: 3,
                        },
                        EmbedSpan {
                            at: 4,
                            image: a.clone(),
                            from: 0,
                            len: 1,
                        },
                    ],
                ),
            ],
        };
        let got: Vec<(usize, Vec<f32>)> =
            batch.image_rows().map(|(r, v)| (r, v.to_vec())).collect();
        let want = vec![
            (2, a.row(1).to_vec()),
            (3, a.row(2).to_vec()),
            (6, b.row(0).to_vec()),
            (7, b.row(1).to_vec()),
            (8, b.row(2).to_vec()),
            (10, a.row(0).to_vec()),
        ];
        assert_eq!(got, want);
        for (i, s) in batch.seqs.iter().enumerate() {
            s.check_embeds(i, 2).unwrap();
        }
        assert_eq!(
            Batch {
                seqs: vec![chunk(3, Vec::new())]
            }
            .image_rows()
            .count(),
            0
        );
    }

    #[test]
    fn spans_outside_their_tokens_rows_or_width_are_refused() {
        let a = image(4, 2, 1);
        let bad = [
            EmbedSpan {
                at: 4,
                image: a.clone(),
                from: 0,
                len: 2,
            },
            EmbedSpan {
                at: usize::MAX,
                image: a.clone(),
                from: 0,
                len: 2,
            },
            EmbedSpan {
                at: 0,
                image: a.clone(),
                from: 3,
                len: 2,
            },
            EmbedSpan {
                at: 0,
                image: a.clone(),
                from: usize::MAX,
                len: 1,
            },
        ];
        for e in bad {
            let err = chunk(5, vec![e.clone()]).check_embeds(7, 2).unwrap_err();
            assert!(err.to_string().contains("sequence 7"), "{err}");
        }
        let ok = EmbedSpan {
            at: 0,
            image: a,
            from: 0,
            len: 4,
        };
        chunk(5, vec![ok.clone()]).check_embeds(0, 2).unwrap();
        assert!(chunk(5, vec![ok]).check_embeds(0, 3).is_err());
    }
}
