//! One tensor-parallel rank of a Llama-family decoder and its forward pass over a mixed
//! batch of prefill chunks and decode tokens, reading and writing the paged KV cache.
//!
//! Rank `r` of `tp` owns query heads `[r·H/tp, (r+1)·H/tp)`, KV heads `[r·K/tp, (r+1)·K/tp)`,
//! MLP columns `[r·F/tp, (r+1)·F/tp)` and vocabulary rows `[r·V/tp, (r+1)·V/tp)`. Q/K/V and
//! gate/up are column-parallel (each rank computes its own output features), the attention
//! output and down projections are row-parallel (partial sums joined by an all-reduce), the
//! embedding is vocabulary-parallel (an all-reduce of zero-padded lookups) and the output layer
//! is vocabulary-parallel (an all-gather of logits).

use crate::collective::Collective;
use crate::config::{ModelConfig, RopeScaling, RopeStyle};
use crate::kv::{KvCache, KvKind};
use crate::quant::{self, QMatrix, QType};
use crate::weights::{concat_rows, convert, slice_rows, TensorStore, WeightFormat};
use crate::{ModelError, Result};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::ops::Range;
use std::sync::Arc;

pub use crate::batch::{Batch, EmbedSpan, SeqChunk};

/// A matmul weight. The block formats [`crate::quant`] runs (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K:
/// the file's own in [`WeightFormat::Native`]) are on this crate's llama.cpp-exact kernels,
/// the default's on its packed kernel where the CPU runs it (else, for Q4_0/Q4_1/Q8_0 models,
/// `native` itself; for other formats Q8_0 on the exact kernels),
/// all on its compute pool; only what those kernels do not take (f32 weights, Q5_* in native)
/// is on candle's.
///
/// Until issue 28 the default path's Q8_0 ran on candle's `QMatMul` (VNNI-packed). Each of its
/// matmuls is a barrier over a fixed set of threads that the caller waits on by spinning, so
/// one compute thread the OS deschedules stalls the whole step: with one other busy process on
/// a 2-vCPU machine, decode went from ~6 ms to ~150 ms per token (docs/benchmarks.md,
/// "Sharing the cores"). Our pool hands out work item by item instead.
enum LinearWeight {
    Quant(QMatrix),
    /// Q8_0, Q4_0 or Q4_1 weights with their exact values (not [`WeightFormat::Native`]) on
    /// AVX-512 VNNI CPUs: sixteen rows per vector ([`quant::PackedQ8`]), about 2× faster
    /// than [`QMatrix`]'s llama.cpp-exact order for prefill and batched decode.
    Packed(quant::PackedQ8),
    Candle(QMatMul),
}

struct Linear {
    weight: LinearWeight,
    bias: Option<Vec<f32>>,
    out_features: usize,
}

/// The weight in this crate's per-row layout, when its format is one [`crate::quant`] runs.
fn own_kernel_weight(w: &QTensor) -> Result<Option<QMatrix>> {
    let (rows, cols) = w.shape().dims2()?;
    let Some(qt) = QType::from_ggml(w.dtype()) else {
        return Ok(None);
    };
    Ok(QMatrix::from_gguf(qt, rows, cols, &w.data()?))
}

impl Linear {
    /// On [`crate::quant`]'s kernels when the weight's format is one of theirs (Q8_0, Q4_0
    /// and Q4_1 packed when `packed` allows and the CPU runs it), otherwise on candle's.
    fn new(w: QTensor, bias: Option<Vec<f32>>, packed: bool) -> Result<Self> {
        let (out_features, cols) = w.shape().dims2()?;
        let packed = match QType::from_ggml(w.dtype()) {
            Some(qt) if packed => quant::PackedQ8::from_gguf(qt, out_features, cols, &w.data()?),
            _ => None,
        };
        let weight = match packed {
            Some(p) => LinearWeight::Packed(p),
            None => match own_kernel_weight(&w)? {
                Some(q) => LinearWeight::Quant(q),
                None => LinearWeight::Candle(QMatMul::from_qtensor(w)?),
            },
        };
        Ok(Self {
            weight,
            bias,
            out_features,
        })
    }

    fn add_bias(&self, y: &mut [f32]) {
        self.add_bias_at(y, self.out_features, 0);
    }

    /// Adds the bias to this layer's columns `at .. at + out` of `y`'s rows of `width` values
    /// (its part of joined Q|K|V or gate|up rows).
    fn add_bias_at(&self, y: &mut [f32], width: usize, at: usize) {
        if let Some(b) = &self.bias {
            for row in y.chunks_mut(width) {
                let part = &mut row[at..at + self.out_features];
                part.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
    }

    /// `x` is `[rows, in]` row-major; returns `[rows, out]`.
    fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let inp = x.len() / rows;
        let mut y = match &self.weight {
            LinearWeight::Quant(q) => quant::matmul(q, x, rows),
            LinearWeight::Packed(p) => p.matmul(x, rows),
            LinearWeight::Candle(weight) => {
                let xt = Tensor::from_slice(x, (rows, inp), &Device::Cpu)?;
                weight.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?
            }
        };
        self.add_bias(&mut y);
        Ok(y)
    }

    /// Adds the output of a layer whose input is split across the ranks (the attention
    /// output projection: each rank holds its heads' values; the down projection: its share of
    /// the FFN) to `acc` (`[rows, out_total]`, the residual stream; the same on every rank).
    ///
    /// The ranks first gather the whole input row, then each computes its own slice of the
    /// output values ([`ModelShard::load`] cuts this weight by output rows), each value one
    /// dot product over the whole input row, and the slices are gathered. So every value is
    /// the single dot product llama.cpp computes, in its order, whatever the TP size: sharding
    /// changes no rounding, and tp=1 is llama.cpp's arithmetic. (Until issue 28 these layers
    /// summed partial dot products over fixed column chunks, the shards of the largest TP size:
    /// tp-invariant too, but a different sum than llama.cpp's, and in a model whose
    /// activations are quantized to 8 bits before every matmul that difference moved the
    /// default model's log-probabilities by up to 0.6 against llama.cpp's.)
    fn add_split_input(
        &self,
        x: &[f32],
        rows: usize,
        comm: &dyn Collective,
        acc: &mut [f32],
    ) -> Result<()> {
        let ranks = comm.size();
        let whole_rows = |parts: Vec<f32>| -> Vec<f32> {
            if ranks == 1 {
                return parts;
            }
            // `parts` is [rank][row][width]: make it [row][rank][width].
            let width = parts.len() / ranks / rows;
            let mut out = Vec::with_capacity(parts.len());
            for r in 0..rows {
                for k in 0..ranks {
                    let at = (k * rows + r) * width;
                    out.extend_from_slice(&parts[at..at + width]);
                }
            }
            out
        };
        // One rank holds the whole input and every output row: nothing to gather (and no copy).
        let y = if ranks == 1 {
            self.forward(x, rows)?
        } else {
            let input = whole_rows(comm.all_gather(x)?);
            whole_rows(comm.all_gather(&self.forward(&input, rows)?)?)
        };
        let width = acc.len() / rows;
        for_rows(acc, width, |r0, part| {
            let y = &y[r0 * width..r0 * width + part.len()];
            part.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        });
        Ok(())
    }
}

/// Projections whose outputs are concatenated per row (Q|K|V, gate|up). With converted
/// weights they are fused into one matmul; in [`WeightFormat::Native`] they stay separate, as
/// the file's own layout (and llama.cpp) has them.
struct Stacked {
    parts: Vec<Linear>,
}

impl Stacked {
    fn new(
        parts: Vec<QTensor>,
        biases: Vec<Option<Vec<f32>>>,
        format: WeightFormat,
    ) -> Result<Self> {
        if format == WeightFormat::Native {
            let parts = parts
                .into_iter()
                .zip(biases)
                .map(|(p, b)| Linear::new(p, b, false))
                .collect::<Result<Vec<_>>>()?;
            return Ok(Self { parts });
        }
        let bias = if biases.iter().all(Option::is_none) {
            None
        } else {
            let mut all = Vec::new();
            for (p, b) in parts.iter().zip(&biases) {
                let n = p.shape().dims2()?.0;
                all.extend(b.clone().unwrap_or_else(|| vec![0.0; n]));
            }
            Some(all)
        };
        Ok(Self {
            parts: vec![Linear::new(
                convert(concat_rows(&parts)?, format)?,
                bias,
                true,
            )?],
        })
    }

    fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        if self.parts.len() == 1 {
            return self.parts[0].forward(x, rows);
        }
        let quants: Vec<&QMatrix> = self
            .parts
            .iter()
            .filter_map(|p| match &p.weight {
                LinearWeight::Quant(q) => Some(q),
                LinearWeight::Packed(_) | LinearWeight::Candle(_) => None,
            })
            .collect();
        let same_input = quants.len() == self.parts.len()
            && quants.iter().all(|q| {
                q.cols() == quants[0].cols() && q.qtype().act_type() == quants[0].qtype().act_type()
            });
        let width: usize = self.parts.iter().map(|p| p.out_features).sum();
        if same_input {
            // One activation quantization and one pool job for all the parts, each writing its
            // columns of the joined rows in place.
            let mut y = quant::matmul_concat(&quants, x, rows);
            let mut at = 0;
            for p in &self.parts {
                p.add_bias_at(&mut y, width, at);
                at += p.out_features;
            }
            return Ok(y);
        }
        let outs = self
            .parts
            .iter()
            .map(|p| p.forward(x, rows))
            .collect::<Result<Vec<_>>>()?;
        let mut y = Vec::with_capacity(rows * width);
        for r in 0..rows {
            for (o, p) in outs.iter().zip(&self.parts) {
                y.extend_from_slice(&o[r * p.out_features..(r + 1) * p.out_features]);
            }
        }
        Ok(y)
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Stacked,
    out: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Stacked,
    down: Linear,
}

/// Precomputed RoPE cosines and sines, `[position][head_dim / 2]`.
struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
}

impl RopeTable {
    /// The angles as llama.cpp computes them (`ggml_rope_cache_init`): per position, the
    /// first pair's angle is the position, each next one the previous times
    /// `base^(-2 / head_dim)`, in f32, then divided by the pair's frequency factor and
    /// multiplied by the linear scale. That rounds differently from `position × base^(-2i/d)`
    /// in the last bits, and with 8-bit activations a last-bit difference can move a
    /// log-probability by 0.1. Llama 3's scaling (from `config.json`; a GGUF carries it as
    /// frequency factors) keeps the per-pair frequencies.
    fn new(cfg: &ModelConfig) -> Self {
        let half = cfg.head_dim / 2;
        let scale = cfg.rope_position_scale();
        let mut cos = Vec::with_capacity(cfg.context_length * half);
        let mut sin = Vec::with_capacity(cfg.context_length * half);
        if let RopeScaling::Llama3 { .. } = cfg.rope_scaling {
            let inv = cfg.rope_inv_freq();
            for p in 0..cfg.context_length {
                for f in &inv {
                    let a = p as f32 * scale * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        } else {
            let step = cfg.rope_theta.powf(-2.0 / cfg.head_dim as f32);
            for p in 0..cfg.context_length {
                let mut theta = p as f32;
                for i in 0..half {
                    let factor = cfg.rope_freq_factors.as_ref().map_or(1.0, |f| f[i]);
                    let a = scale * (theta / factor);
                    cos.push(a.cos());
                    sin.push(a.sin());
                    theta *= step;
                }
            }
        }
        Self {
            cos,
            sin,
            half,
            style: cfg.rope_style,
        }
    }

    fn apply(&self, x: &mut [f32], pos: usize) {
        let c = &self.cos[pos * self.half..(pos + 1) * self.half];
        let s = &self.sin[pos * self.half..(pos + 1) * self.half];
        match self.style {
            RopeStyle::Interleaved => {
                for j in 0..self.half {
                    let (a, b) = (x[2 * j], x[2 * j + 1]);
                    x[2 * j] = a * c[j] - b * s[j];
                    x[2 * j + 1] = a * s[j] + b * c[j];
                }
            }
            RopeStyle::Half => {
                for j in 0..self.half {
                    let (a, b) = (x[j], x[j + self.half]);
                    x[j] = a * c[j] - b * s[j];
                    x[j + self.half] = a * s[j] + b * c[j];
                }
            }
        }
    }
}

fn split(n: usize, rank: usize, tp: usize) -> Range<usize> {
    n / tp * rank..n / tp * (rank + 1)
}

/// The weights of one tensor-parallel rank.
pub struct ModelShard {
    config: ModelConfig,
    rank: usize,
    tp: usize,
    heads: Range<usize>,
    kv_heads: Range<usize>,
    vocab: Range<usize>,
    embed: Arc<QTensor>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Linear,
    rope: RopeTable,
    /// [`WeightFormat::Native`]: RMSNorm sums as llama.cpp does (see [`rms_norm`]).
    native: bool,
}

impl std::fmt::Debug for ModelShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelShard")
            .field("rank", &self.rank)
            .field("tp", &self.tp)
            .field("heads", &self.heads)
            .field("kv_heads", &self.kv_heads)
            .finish()
    }
}

impl ModelShard {
    /// Cuts rank `rank` of `tp` out of a loaded model.
    ///
    /// # Errors
    /// [`ModelError::BadTpSize`] when `tp` does not split the model; missing or misshapen
    /// tensors.
    pub fn load(
        cfg: &ModelConfig,
        store: &TensorStore,
        rank: usize,
        tp: usize,
        format: WeightFormat,
    ) -> Result<Self> {
        cfg.validate()?;
        cfg.check_tp(tp)?;
        let requested = format;
        let format = crate::weights::resolve(format, store);
        if rank == 0 {
            tracing::info!(%requested, weights = %format, "weight format");
        }
        let (h, kvh, hd, d, f, v) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.vocab_size,
        );
        let native = format == WeightFormat::Native;
        // The output rows of the layers whose input is split across the ranks (see
        // [`Linear::add_split_input`]).
        let out_rows = split(d, rank, tp);
        let heads = split(h, rank, tp);
        let kv_heads = split(kvh, rank, tp);
        let ffn = split(f, rank, tp);
        let vocab = split(v, rank, tp);
        let rows = |r: &Range<usize>| r.start * hd..r.end * hd;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let name = |s: &str| format!("blk.{i}.{s}");
            let q = store.get_shaped(&name("attn_q.weight"), &[h * hd, d])?;
            let k = store.get_shaped(&name("attn_k.weight"), &[kvh * hd, d])?;
            let vw = store.get_shaped(&name("attn_v.weight"), &[kvh * hd, d])?;
            let o = store.get_shaped(&name("attn_output.weight"), &[d, h * hd])?;
            let gate = store.get_shaped(&name("ffn_gate.weight"), &[f, d])?;
            let up = store.get_shaped(&name("ffn_up.weight"), &[f, d])?;
            let down = store.get_shaped(&name("ffn_down.weight"), &[d, f])?;
            let qkv = vec![
                slice_rows(q, rows(&heads))?,
                slice_rows(k, rows(&kv_heads))?,
                slice_rows(vw, rows(&kv_heads))?,
            ];
            let qkv_bias = if cfg.qkv_bias {
                let qb = store.vector(&name("attn_q.bias"), h * hd)?;
                let kb = store.vector(&name("attn_k.bias"), kvh * hd)?;
                let vb = store.vector(&name("attn_v.bias"), kvh * hd)?;
                vec![
                    Some(qb[rows(&heads)].to_vec()),
                    Some(kb[rows(&kv_heads)].to_vec()),
                    Some(vb[rows(&kv_heads)].to_vec()),
                ]
            } else {
                vec![None, None, None]
            };
            let gate_up = vec![slice_rows(gate, ffn.clone())?, slice_rows(up, ffn.clone())?];
            layers.push(Layer {
                attn_norm: store.vector(&name("attn_norm.weight"), d)?,
                qkv: Stacked::new(qkv, qkv_bias, format)?,
                out: Linear::new(
                    convert(slice_rows(o, out_rows.clone())?, format)?,
                    None,
                    !native,
                )?,
                ffn_norm: store.vector(&name("ffn_norm.weight"), d)?,
                gate_up: Stacked::new(gate_up, vec![None, None], format)?,
                down: Linear::new(
                    convert(slice_rows(down, out_rows.clone())?, format)?,
                    None,
                    !native,
                )?,
            });
        }
        let embed_full = store.get_shaped("token_embd.weight", &[v, d])?;
        let embed = Arc::new(slice_rows(embed_full, vocab.clone())?);
        let head_full = if store.contains("output.weight") {
            store.get_shaped("output.weight", &[v, d])?
        } else {
            embed_full
        };
        let lm_head = Linear::new(
            convert(slice_rows(head_full, vocab.clone())?, format)?,
            None,
            !native,
        )?;
        Ok(Self {
            config: cfg.clone(),
            rank,
            tp,
            heads,
            kv_heads,
            vocab,
            embed,
            layers,
            final_norm: store.vector("output_norm.weight", d)?,
            lm_head,
            rope: RopeTable::new(cfg),
            native,
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// KV heads this rank owns (model-wide indices).
    pub fn kv_heads(&self) -> Range<usize> {
        self.kv_heads.clone()
    }

    /// This rank's index and the group size.
    pub fn rank(&self) -> (usize, usize) {
        (self.rank, self.tp)
    }

    /// Checks a batch against the cache and the context before any work is done.
    ///
    /// # Errors
    /// [`ModelError::ContextOverflow`] or [`ModelError::InvalidBatch`].
    pub fn validate_batch(&self, batch: &Batch, kv: &KvCache) -> Result<()> {
        let layout = kv.layout();
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i} has no tokens"
                )));
            }
            let end = s.start_pos + s.tokens.len();
            if end > self.config.context_length {
                return Err(ModelError::ContextOverflow {
                    tokens: end,
                    context: self.config.context_length,
                });
            }
            if s.block_table.len() < layout.blocks_for(end) {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i}: {} blocks cannot hold {end} tokens",
                    s.block_table.len()
                )));
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
            if let Some(t) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.config.vocab_size)
            {
                return Err(ModelError::InvalidBatch(format!(
                    "sequence {i}: token id {t} out of vocabulary"
                )));
            }
            s.check_embeds(i, self.config.hidden_size)?;
        }
        Ok(())
    }

    /// Runs one step. Returns, for every sequence with `want_logits`, the full-vocabulary
    /// logits of its last token, and for one with `all_logits` those of each of its tokens
    /// ([`SeqChunk::logit_rows`], in batch order; every rank returns the same values).
    /// `on_layer(l, kv)` is called once layer `l`'s K/V of the batch are in the cache and
    /// before any attention reads layer `l` (for layerwise KV push, and for KV restored
    /// layer by layer: it may write other blocks' layer `l` into `kv`).
    ///
    /// # Errors
    /// Invalid batches (checked before any write), collective failures.
    pub fn forward(
        &self,
        batch: &Batch,
        kv: &mut KvCache,
        comm: &dyn Collective,
        on_layer: &mut dyn FnMut(usize, &mut KvCache),
    ) -> Result<Vec<Vec<f32>>> {
        self.validate_batch(batch, kv)?;
        let cfg = &self.config;
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let t = batch.num_tokens();
        let nh = self.heads.len();
        let nkv = self.kv_heads.len();
        let qkv_w = (nh + 2 * nkv) * hd;

        // Embedding: each rank fills the rows of tokens in its vocabulary slice.
        let mut x = vec![0f32; t * d];
        let tokens: Vec<u32> = batch
            .seqs
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let local: Vec<(usize, u32)> = tokens
            .iter()
            .enumerate()
            .filter(|(_, &tok)| self.vocab.contains(&(tok as usize)))
            .map(|(i, &tok)| (i, tok - self.vocab.start as u32))
            .collect();
        if !local.is_empty() {
            let ids: Vec<u32> = local.iter().map(|&(_, id)| id).collect();
            let ids = Tensor::new(ids.as_slice(), &Device::Cpu)?;
            let rows = self
                .embed
                .embedding(&ids)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for (j, &(i, _)) in local.iter().enumerate() {
                x[i * d..(i + 1) * d].copy_from_slice(&rows[j * d..(j + 1) * d]);
            }
        }
        comm.all_reduce_sum(&mut x)?;

        // Where each sequence's tokens sit in the flattened step.
        let mut offsets = Vec::with_capacity(batch.seqs.len());
        let mut acc = 0;
        for s in &batch.seqs {
            offsets.push(acc);
            acc += s.tokens.len();
        }

        // Image rows replace their placeholder tokens' embeddings (every rank has the whole
        // batch, so every rank writes the same rows after the all-reduce).
        for (row, values) in batch.image_rows() {
            x[row * d..(row + 1) * d].copy_from_slice(values);
        }

        // Each flattened token's position in its sequence.
        let positions: Vec<usize> = batch
            .seqs
            .iter()
            .flat_map(|s| s.start_pos..s.start_pos + s.tokens.len())
            .collect();
        let mut h = vec![0f32; t * d];
        // The FFN activation, `[t, ffn / tp]`, reused by every layer.
        let mut act = Vec::new();
        let native = self.native;
        for (li, layer) in self.layers.iter().enumerate() {
            for_rows(&mut h, d, |r0, out| {
                let x = &x[r0 * d..r0 * d + out.len()];
                rms_norm(x, &layer.attn_norm, cfg.rms_norm_eps, d, native, out)
            });
            let mut qkv = layer.qkv.forward(&h, t)?;
            // RoPE on Q and K (on the pool for prefills), then K/V into the cache.
            for_rows(&mut qkv, qkv_w, |r0, part| {
                for (k, row) in part.chunks_mut(qkv_w).enumerate() {
                    for head in 0..nh + nkv {
                        self.rope
                            .apply(&mut row[head * hd..(head + 1) * hd], positions[r0 + k]);
                    }
                }
            });
            for (s, &off) in batch.seqs.iter().zip(&offsets) {
                for i in 0..s.tokens.len() {
                    let pos = s.start_pos + i;
                    let row = &qkv[(off + i) * qkv_w..(off + i + 1) * qkv_w];
                    let block = s.block_table[pos / kv.layout().block_size] as usize;
                    let slot = pos % kv.layout().block_size;
                    for g in 0..nkv {
                        let k = &row[(nh + g) * hd..(nh + g + 1) * hd];
                        kv.write_slot(li, KvKind::Key, block, g, slot, k);
                        let v = &row[(nh + nkv + g) * hd..(nh + nkv + g + 1) * hd];
                        kv.write_slot(li, KvKind::Value, block, g, slot, v);
                    }
                }
            }
            on_layer(li, kv);
            let attn =
                crate::attention::attention(li, batch, &offsets, &qkv, qkv_w, nh, nkv, hd, kv);
            layer.out.add_split_input(&attn, t, comm, &mut x)?;

            for_rows(&mut h, d, |r0, out| {
                let x = &x[r0 * d..r0 * d + out.len()];
                rms_norm(x, &layer.ffn_norm, cfg.rms_norm_eps, d, native, out)
            });
            let gu = layer.gate_up.forward(&h, t)?;
            let f = gu.len() / t / 2;
            act.resize(t * f, 0.0);
            for_rows(&mut act, f, |r0, part| {
                for (k, act) in part.chunks_mut(f).enumerate() {
                    let r = r0 + k;
                    let g = &gu[r * 2 * f..r * 2 * f + f];
                    let u = &gu[r * 2 * f + f..(r + 1) * 2 * f];
                    crate::vecmath::swiglu(g, u, act);
                }
            });
            layer.down.add_split_input(&act, t, comm, &mut x)?;
        }

        // Logits for the last token of every sequence that wants them (every token of one
        // that wants all).
        let last_rows: Vec<usize> = batch
            .seqs
            .iter()
            .zip(&offsets)
            .flat_map(|(s, &off)| s.logit_rows().map(move |i| off + i))
            .collect();
        if last_rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut sel = Vec::with_capacity(last_rows.len() * d);
        for &r in &last_rows {
            sel.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut normed = vec![0f32; sel.len()];
        rms_norm(
            &sel,
            &self.final_norm,
            cfg.rms_norm_eps,
            d,
            self.native,
            &mut normed,
        );
        let local_logits = self.lm_head.forward(&normed, last_rows.len())?;
        let gathered = comm.all_gather(&local_logits)?;
        // `gathered` is rank-major: [rank][seq][vocab/tp]; rebuild [seq][vocab].
        let vr = self.vocab.len();
        let n = last_rows.len();
        Ok((0..n)
            .map(|s| {
                let mut full = Vec::with_capacity(cfg.vocab_size);
                for r in 0..self.tp {
                    let base = r * n * vr + s * vr;
                    full.extend_from_slice(&gathered[base..base + vr]);
                }
                full
            })
            .collect())
    }
}

/// RMSNorm, `x · scale · w` with `scale = 1 / sqrt(mean(x²) + eps)`. With `llama` (native
/// weights) as llama.cpp computes it: squares in f32 summed in f64, the rest in f32; otherwise
/// summed in f32, as the default path always has.
/// Rows of a prefill handed to one compute-pool item by [`for_rows`].
const ROWS_PER_ITEM: usize = 16;

/// Runs `f(first_row, rows)` over `out`, rows of `row_len` values: in pieces of
/// [`ROWS_PER_ITEM`] rows on the compute pool when there is more than one piece, else in one
/// piece on this thread. `f` computes each row the same way whatever piece it is in, so the
/// split changes no result.
fn for_rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if out.len() <= ROWS_PER_ITEM * row_len {
        return f(0, out);
    }
    let parts: Vec<std::sync::Mutex<&mut [f32]>> = out
        .chunks_mut(ROWS_PER_ITEM * row_len)
        .map(std::sync::Mutex::new)
        .collect();
    quant::pool::global().run(parts.len(), &|k| {
        let mut part = parts[k].lock().expect("each piece is run once");
        f(k * ROWS_PER_ITEM, &mut part)
    });
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, d: usize, llama: bool, out: &mut [f32]) {
    // Each row's sum of squares is one sequential sum (llama.cpp's order); four rows are
    // summed side by side so that their additions overlap instead of waiting on each other.
    let mut means = vec![0f32; x.len() / d];
    let mut quads = x.chunks_exact(4 * d);
    for (q, m) in (&mut quads).zip(means.chunks_exact_mut(4)) {
        let rows: [&[f32]; 4] = std::array::from_fn(|k| &q[k * d..(k + 1) * d]);
        if llama {
            let mut ss = [0f64; 4];
            for v in columns(rows) {
                for k in 0..4 {
                    ss[k] += (v[k] * v[k]) as f64;
                }
            }
            for k in 0..4 {
                m[k] = (ss[k] / d as f64) as f32;
            }
        } else {
            let mut ss = [0f32; 4];
            for v in columns(rows) {
                for k in 0..4 {
                    ss[k] += v[k] * v[k];
                }
            }
            for k in 0..4 {
                m[k] = ss[k] / d as f32;
            }
        }
    }
    let done = means.len() - quads.remainder().len() / d;
    for (xr, m) in quads.remainder().chunks(d).zip(&mut means[done..]) {
        *m = if llama {
            let ss: f64 = xr.iter().map(|v| (v * v) as f64).sum();
            (ss / d as f64) as f32
        } else {
            xr.iter().map(|v| v * v).sum::<f32>() / d as f32
        };
    }
    for ((xr, or), mean) in x.chunks(d).zip(out.chunks_mut(d)).zip(means) {
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// The four rows' values column by column.
fn columns(rows: [&[f32]; 4]) -> impl Iterator<Item = [f32; 4]> + '_ {
    let [a, b, c, d] = rows;
    a.iter()
        .zip(b)
        .zip(c)
        .zip(d)
        .map(|(((a, b), c), d)| [*a, *b, *c, *d])
}

#[cfg(test)]
mod tests {
    use super::rms_norm;

    #[test]
    fn rms_norm_of_many_rows_gives_each_rows_own_bits() {
        // Seven rows: one group of four summed side by side, three on their own.
        let d = 40;
        let x: Vec<f32> = (0..7 * d)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 97.0)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / 64.0).collect();
        for llama in [false, true] {
            let mut all = vec![0f32; x.len()];
            rms_norm(&x, &w, 1e-5, d, llama, &mut all);
            for (r, row) in x.chunks(d).enumerate() {
                let mut one = vec![0f32; d];
                rms_norm(row, &w, 1e-5, d, llama, &mut one);
                assert_eq!(one, all[r * d..(r + 1) * d], "row {r}, llama {llama}");
                // Against the definition, in f64.
                let ms = row
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
                    / d as f64;
                let scale = 1.0 / (ms + 1e-5).sqrt();
                for ((&o, &v), &g) in one.iter().zip(row).zip(&w) {
                    let want = f64::from(v) * scale * f64::from(g);
                    assert!((f64::from(o) - want).abs() <= 1e-5 * want.abs().max(1e-3));
                }
            }
        }
    }
}
