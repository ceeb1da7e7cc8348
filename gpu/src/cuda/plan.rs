//! A forward step flattened into the index arrays the kernels read: built on the host from a
//! [`Batch`], uploaded once per step.
//!
//! Token `t` of the step (sequences concatenated in batch order) has id `tokens[t]`, position
//! `positions[t]`, sequence `token_seq[t]` and global KV slot `slots[t] = block * block_size +
//! position % block_size`, where `block` is its sequence's block for that position. Sequence
//! `s`'s block table starts at `block_tables[seq_bt_start[s]]`. The attention kernel finds key
//! `j` of token `t` at [`StepPlan::key_location`]; the K/V write kernel puts token `t` at
//! [`StepPlan::slot_of`]. Both are tested against the batch's own block tables.

use crate::batch::Batch;
use crate::config::ModelConfig;
use crate::kv::KvLayout;
use crate::{ModelError, Result};

/// Index arrays of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Token ids, `[T]`.
    pub tokens: Vec<u32>,
    /// Positions, `[T]`.
    pub positions: Vec<i32>,
    /// Sequence of each token, `[T]`.
    pub token_seq: Vec<i32>,
    /// Global KV slot of each token, `[T]`.
    pub slots: Vec<i64>,
    /// Start of each sequence's block table in `block_tables`, `[S]`.
    pub seq_bt_start: Vec<i32>,
    /// Block tables, concatenated (each cut to the blocks its context needs).
    pub block_tables: Vec<i32>,
    /// Step rows whose logits are wanted (the last token of each such sequence), in order.
    pub logit_rows: Vec<i32>,
}

fn too_large(what: &str) -> ModelError {
    ModelError::InvalidBatch(format!("{what} does not fit the kernels' 32-bit indices"))
}

impl StepPlan {
    /// Flattens `batch` for a cache of `layout` (the batch was validated against it).
    ///
    /// # Errors
    /// [`ModelError::InvalidBatch`] when a block table is too short for its tokens or an index
    /// does not fit 32 bits.
    pub fn new(batch: &Batch, layout: &KvLayout) -> Result<Self> {
        let bs = layout.block_size;
        let mut p = StepPlan::default();
        for (si, s) in batch.seqs.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            let need = end.div_ceil(bs);
            if s.block_table.len() < need {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {si}: {} blocks cannot hold {end} tokens",
                    s.block_table.len()
                )));
            }
            let start =
                i32::try_from(p.block_tables.len()).map_err(|_| too_large("block tables"))?;
            p.seq_bt_start.push(start);
            for &b in &s.block_table[..need] {
                p.block_tables
                    .push(i32::try_from(b).map_err(|_| too_large("a block id"))?);
            }
            let si32 = i32::try_from(si).map_err(|_| too_large("the sequence count"))?;
            for (i, &tok) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + i;
                p.tokens.push(tok);
                p.positions
                    .push(i32::try_from(pos).map_err(|_| too_large("a position"))?);
                p.token_seq.push(si32);
                let block = s.block_table[pos / bs] as i64;
                p.slots.push(block * bs as i64 + (pos % bs) as i64);
            }
            let first = p.tokens.len() - s.tokens.len();
            for row in s.logit_rows().map(|i| first + i) {
                p.logit_rows
                    .push(i32::try_from(row).map_err(|_| too_large("the step"))?);
            }
        }
        Ok(p)
    }

    /// Checks `batch` as the CPU backend does (no empty sequence, nothing past the context,
    /// block ids inside the pool, token ids inside the vocabulary), then flattens it. Nothing
    /// reaches the device unless this succeeds: the kernels index without bounds checks.
    ///
    /// # Errors
    /// [`ModelError::ContextOverflow`] or [`ModelError::InvalidBatch`].
    pub fn validated(batch: &Batch, layout: &KvLayout, cfg: &ModelConfig) -> Result<Self> {
        if batch.seqs.is_empty() {
            return Err(ModelError::InvalidBatch("empty batch".into()));
        }
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i} has no tokens"
                )));
            }
            let end = s.start_pos + s.tokens.len();
            if end > cfg.context_length {
                return Err(ModelError::ContextOverflow {
                    tokens: end,
                    context: cfg.context_length,
                });
            }
            if let Some(b) = s
                .block_table
                .iter()
                .find(|&&b| b as usize >= layout.num_blocks)
            {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i}: block id {b} out of range"
                )));
            }
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i}: token id {t} out of vocabulary"
                )));
            }
            s.check_embeds(i, cfg.hidden_size)?;
        }
        Self::new(batch, layout)
    }

    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// `(block, slot)` of key `j` of token `t`'s context, as the attention kernel computes it.
    pub fn key_location(&self, t: usize, j: usize, block_size: usize) -> (usize, usize) {
        let start = self.seq_bt_start[self.token_seq[t] as usize] as usize;
        (
            self.block_tables[start + j / block_size] as usize,
            j % block_size,
        )
    }

    /// The distinct blocks this step writes K/V into, sorted.
    pub fn touched_blocks(&self, block_size: usize) -> Vec<u32> {
        let mut b: Vec<u32> = self
            .slots
            .iter()
            .map(|&s| (s as usize / block_size) as u32)
            .collect();
        b.sort_unstable();
        b.dedup();
        b
    }

    /// `(block, slot)` the K/V write kernel stores token `t` at.
    pub fn slot_of(&self, t: usize, block_size: usize) -> (usize, usize) {
        let g = self.slots[t] as usize;
        (g / block_size, g % block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SeqChunk;
    use crate::cuda::layout::slot_elem_offset;
    use crate::kv::{KvDtype, KvKind};

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 32,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F32,
        }
    }

    fn mixed_batch() -> Batch {
        Batch {
            seqs: vec![
                // A prefill chunk in the middle of a prompt.
                SeqChunk {
                    tokens: vec![10, 11, 12, 13, 14, 15],
                    start_pos: 3,
                    block_table: vec![7, 2, 9, 30],
                    want_logits: false,
                    all_logits: false,
                    embeds: Vec::new(),
                },
                // A decode token.
                SeqChunk {
                    tokens: vec![42],
                    start_pos: 8,
                    block_table: vec![1, 5, 6, 0],
                    want_logits: true,
                    all_logits: false,
                    embeds: Vec::new(),
                },
                // A whole short prompt.
                SeqChunk {
                    tokens: vec![1, 2, 3],
                    start_pos: 0,
                    block_table: vec![4],
                    want_logits: true,
                    all_logits: false,
                    embeds: Vec::new(),
                },
            ],
        }
    }

    #[test]
    fn keys_and_slots_follow_each_sequences_block_table() {
        let l = layout();
        let b = mixed_batch();
        let p = StepPlan::new(&b, &l).unwrap();
        assert_eq!(p.num_tokens(), b.num_tokens());
        assert_eq!(p.logit_rows, vec![6, 9]);
        // Tables are cut to what each context needs.
        assert_eq!(p.block_tables, vec![7, 2, 9, 1, 5, 6, 4]);
        // Positions 3..9 of the chunk, 8 of the decode, 0..3 of the prompt.
        assert_eq!(p.touched_blocks(4), vec![2, 4, 6, 7, 9]);
        let mut t = 0;
        for (si, s) in b.seqs.iter().enumerate() {
            for i in 0..s.tokens.len() {
                let pos = s.start_pos + i;
                assert_eq!(p.positions[t] as usize, pos);
                assert_eq!(p.token_seq[t] as usize, si);
                assert_eq!(p.tokens[t], s.tokens[i]);
                let (blk, slot) = p.slot_of(t, l.block_size);
                assert_eq!((blk, slot), (s.block_table[pos / 4] as usize, pos % 4));
                // The write kernel's element offset is the CPU cache's byte offset.
                for kind in [KvKind::Key, KvKind::Value] {
                    for h in 0..l.num_kv_heads {
                        assert_eq!(
                            slot_elem_offset(&l, kind, blk, h, slot) * 4,
                            l.slot_offset(kind, blk, h, slot)
                        );
                    }
                }
                for j in 0..=pos {
                    assert_eq!(
                        p.key_location(t, j, l.block_size),
                        (s.block_table[j / 4] as usize, j % 4),
                        "token {t} key {j}"
                    );
                }
                t += 1;
            }
        }
    }

    #[test]
    fn validation_refuses_what_the_kernels_could_not_index() {
        let l = layout();
        let cfg = ModelConfig {
            architecture: "llama".into(),
            vocab_size: 50,
            hidden_size: 16,
            num_layers: 2,
            num_heads: 2,
            num_kv_heads: 2,
            head_dim: 8,
            intermediate_size: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: crate::config::RopeScaling::None,
            rope_style: crate::config::RopeStyle::Half,
            context_length: 12,
            qkv_bias: false,
            rope_freq_factors: None,
        };
        assert!(StepPlan::validated(&mixed_batch(), &l, &cfg).is_ok());
        let kinds = |f: fn(&mut Batch)| {
            let mut b = mixed_batch();
            f(&mut b);
            StepPlan::validated(&b, &l, &cfg).unwrap_err().kind()
        };
        assert_eq!(kinds(|b| b.seqs[1].tokens.clear()), "invalid_batch");
        assert_eq!(kinds(|b| b.seqs[1].start_pos = 12), "context_overflow");
        assert_eq!(kinds(|b| b.seqs[2].block_table[0] = 32), "invalid_batch");
        assert_eq!(kinds(|b| b.seqs[0].tokens[0] = 50), "invalid_batch");
        assert_eq!(kinds(|b| b.seqs.clear()), "invalid_batch");
    }

    #[test]
    fn a_short_block_table_is_refused() {
        let mut b = mixed_batch();
        b.seqs[0].block_table.truncate(2);
        let e = StepPlan::new(&b, &layout()).unwrap_err();
        assert_eq!(e.kind(), "invalid_batch");
    }
}
