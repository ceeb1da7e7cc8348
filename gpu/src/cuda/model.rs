//! One tensor-parallel rank of a Llama-family decoder on a GPU: the CPU backend's math
//! (`crate::model`), step for step, over device buffers and the paged device KV cache.
//!
//! Same sharding as the CPU rank: rank `r` of `tp` owns query heads, KV heads, MLP columns
//! and vocabulary rows `[r·n/tp, (r+1)·n/tp)`; Q/K/V and gate/up are fused column-parallel
//! matmuls, the attention output and down projections are row-parallel (joined by an
//! all-reduce through host memory, [`Collective`]), the embedding is vocabulary-parallel (an
//! all-reduce of zero-padded rows) and the output layer is vocabulary-parallel (an all-gather).
//!
//! Weights are dequantized at load (from any GGUF/safetensors type the CPU reads) to the
//! matmul type ([`GemmDtype`]: f16 by default, bf16 or f32); activations are f32 between
//! kernels and converted to the matmul type by the kernel that produces a matmul input.
//! Matmuls are cuBLAS `gemm_ex` with f32 accumulation and f32 output.
//!
//! One step: embedding → per layer [RMSNorm (+ residual) → QKV → RoPE → K/V write → paged
//! attention → O → all-reduce → RMSNorm (+ residual) → gate|up → SwiGLU → down → all-reduce]
//! → residual → final RMSNorm of the rows that want logits → LM head → all-gather.

use super::context::{karg_i32, karg_i64, GemmDtype, GpuContext, KArg, TypedBuffer};
use super::kv::DeviceKvCache;
use super::launch::{self, ROW_THREADS};
use super::layout::linear_gemm;
use super::plan::StepPlan;
use crate::batch::Batch;
use crate::collective::Collective;
use crate::config::{ModelConfig, RopeStyle};
use crate::device::DeviceError;
use crate::kv::KvDtype;
use crate::weights::{concat_rows, slice_cols, slice_rows, TensorStore};
use crate::Result;
use candle_core::quantized::QTensor;
use cudarc::driver::CudaSlice;
use std::ops::Range;
use std::sync::Arc;

fn split(n: usize, rank: usize, tp: usize) -> Range<usize> {
    n / tp * rank..n / tp * (rank + 1)
}

/// A matmul weight `[out, inp]` on the device, with its optional bias.
#[derive(Debug)]
struct DeviceLinear {
    w: TypedBuffer,
    bias: Option<CudaSlice<f32>>,
    out: usize,
    inp: usize,
}

impl DeviceLinear {
    fn upload(
        gpu: &GpuContext,
        w: &QTensor,
        bias: Option<Vec<f32>>,
        dtype: GemmDtype,
    ) -> Result<Self> {
        let (out, inp) = w.shape().dims2()?;
        let values = w
            .dequantize(&candle_core::Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let bias = bias.map(|b| gpu.upload(&b)).transpose()?;
        Ok(Self {
            w: gpu.upload_as(dtype, &values)?,
            bias,
            out,
            inp,
        })
    }

    /// `y[rows, out] = x[rows, inp] · Wᵀ (+ bias)`.
    fn forward(
        &self,
        gpu: &GpuContext,
        x: &TypedBuffer,
        rows: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        gpu.linear(&self.w, x, y, linear_gemm(rows, self.inp, self.out))?;
        if let Some(b) = &self.bias {
            gpu.launch(
                "bias_add",
                launch::elementwise(rows * self.out),
                &[
                    KArg::F32s(y),
                    KArg::F32s(b),
                    karg_i64(rows),
                    karg_i32(self.out),
                ],
            )?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    qkv: DeviceLinear,
    out: DeviceLinear,
    ffn_norm: CudaSlice<f32>,
    gate_up: DeviceLinear,
    down: DeviceLinear,
}

/// The weights of one tensor-parallel rank, on its GPU.
pub struct CudaShard {
    gpu: Arc<GpuContext>,
    config: ModelConfig,
    rank: usize,
    tp: usize,
    heads: Range<usize>,
    kv_heads: Range<usize>,
    vocab: Range<usize>,
    dtype: GemmDtype,
    embed: TypedBuffer,
    /// `None`: the output layer is the embedding (tied), read from `embed`.
    lm_head: Option<DeviceLinear>,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
}

impl std::fmt::Debug for CudaShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaShard")
            .field("gpu", &self.gpu)
            .field("rank", &self.rank)
            .field("tp", &self.tp)
            .field("dtype", &self.dtype)
            .finish()
    }
}

/// The CPU backend's RoPE table: `cos/sin[position][head_dim / 2]`, computed the same way, so
/// both backends rotate by bit-identical factors.
pub fn rope_tables(cfg: &ModelConfig) -> (Vec<f32>, Vec<f32>) {
    let inv = cfg.rope_inv_freq();
    let scale = cfg.rope_position_scale();
    let mut cos = Vec::with_capacity(cfg.context_length * inv.len());
    let mut sin = Vec::with_capacity(cfg.context_length * inv.len());
    for p in 0..cfg.context_length {
        for f in &inv {
            let a = p as f32 * scale * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

impl CudaShard {
    /// Cuts rank `rank` of `tp` out of `store` and uploads it to `gpu`, dequantized to `dtype`.
    ///
    /// # Errors
    /// [`ModelError::BadTpSize`], missing or misshapen tensors, device errors (out of memory).
    pub fn load(
        gpu: Arc<GpuContext>,
        cfg: &ModelConfig,
        store: &TensorStore,
        rank: usize,
        tp: usize,
        dtype: GemmDtype,
    ) -> Result<Self> {
        cfg.validate()?;
        cfg.check_tp(tp)?;
        if cfg.head_dim > launch::ATTN_MAX_HEAD_DIM {
            return Err(DeviceError::Unsupported(format!(
                "head_dim {} (at most {})",
                cfg.head_dim,
                launch::ATTN_MAX_HEAD_DIM
            ))
            .into());
        }
        let (h, kvh, hd, d, f, v) = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.vocab_size,
        );
        let heads = split(h, rank, tp);
        let kv_heads = split(kvh, rank, tp);
        let ffn = split(f, rank, tp);
        let vocab = split(v, rank, tp);
        let rows = |r: &Range<usize>| r.start * hd..r.end * hd;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let name = |s: &str| format!("blk.{i}.{s}");
            let get = |s: &str, shape: &[usize]| store.get_shaped(&name(s), shape);
            let q = slice_rows(get("attn_q.weight", &[h * hd, d])?, rows(&heads))?;
            let k = slice_rows(get("attn_k.weight", &[kvh * hd, d])?, rows(&kv_heads))?;
            let vw = slice_rows(get("attn_v.weight", &[kvh * hd, d])?, rows(&kv_heads))?;
            let qkv_bias = if cfg.qkv_bias {
                let mut b = store.vector(&name("attn_q.bias"), h * hd)?[rows(&heads)].to_vec();
                b.extend_from_slice(
                    &store.vector(&name("attn_k.bias"), kvh * hd)?[rows(&kv_heads)],
                );
                b.extend_from_slice(
                    &store.vector(&name("attn_v.bias"), kvh * hd)?[rows(&kv_heads)],
                );
                Some(b)
            } else {
                None
            };
            let o = slice_cols(get("attn_output.weight", &[d, h * hd])?, rows(&heads))?;
            let gate = slice_rows(get("ffn_gate.weight", &[f, d])?, ffn.clone())?;
            let up = slice_rows(get("ffn_up.weight", &[f, d])?, ffn.clone())?;
            let down = slice_cols(get("ffn_down.weight", &[d, f])?, ffn.clone())?;
            layers.push(DeviceLayer {
                attn_norm: gpu.upload(&store.vector(&name("attn_norm.weight"), d)?)?,
                qkv: DeviceLinear::upload(&gpu, &concat_rows(&[q, k, vw])?, qkv_bias, dtype)?,
                out: DeviceLinear::upload(&gpu, &o, None, dtype)?,
                ffn_norm: gpu.upload(&store.vector(&name("ffn_norm.weight"), d)?)?,
                gate_up: DeviceLinear::upload(&gpu, &concat_rows(&[gate, up])?, None, dtype)?,
                down: DeviceLinear::upload(&gpu, &down, None, dtype)?,
            });
        }
        let embed_q = slice_rows(
            store.get_shaped("token_embd.weight", &[v, d])?,
            vocab.clone(),
        )?;
        let embed_values = embed_q
            .dequantize(&candle_core::Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let embed = gpu.upload_as(dtype, &embed_values)?;
        let lm_head = if store.contains("output.weight") {
            let w = slice_rows(store.get_shaped("output.weight", &[v, d])?, vocab.clone())?;
            Some(DeviceLinear::upload(&gpu, &w, None, dtype)?)
        } else {
            None
        };
        let (cos, sin) = rope_tables(cfg);
        Ok(Self {
            config: cfg.clone(),
            rank,
            tp,
            heads,
            kv_heads,
            vocab,
            dtype,
            embed,
            lm_head,
            layers,
            final_norm: gpu.upload(&store.vector("output_norm.weight", d)?)?,
            rope_cos: gpu.upload(&cos)?,
            rope_sin: gpu.upload(&sin)?,
            gpu,
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

    /// The rank's GPU.
    pub fn gpu(&self) -> &Arc<GpuContext> {
        &self.gpu
    }

    fn kv_suffix(kv: &DeviceKvCache) -> &'static str {
        match kv.layout().dtype {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            // DeviceKvCache::new refuses bf16 (no kernel reads it).
            KvDtype::Bf16 => unreachable!("device KV caches are f32 or f16"),
        }
    }

    /// Runs one step, as [`crate::model::ModelShard::forward`]: returns the full-vocabulary
    /// logits of the last token of every sequence that wants them. `on_layer(l, kv)` runs
    /// once layer `l`'s K/V write is queued on the stream (the executor queues the mirror copy
    /// and its fence there).
    ///
    /// # Errors
    /// Invalid batches (checked before any device work), device and collective failures.
    pub fn forward(
        &self,
        batch: &Batch,
        kv: &DeviceKvCache,
        comm: &dyn Collective,
        on_layer: &mut dyn FnMut(usize, &StepPlan) -> Result<()>,
    ) -> Result<Vec<Vec<f32>>> {
        let plan = StepPlan::validated(batch, kv.layout(), &self.config)?;
        let g = &*self.gpu;
        let cfg = &self.config;
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let t = plan.num_tokens();
        let (nh, nkv) = (self.heads.len(), self.kv_heads.len());
        let qkv_w = (nh + 2 * nkv) * hd;
        let ffn = self.layers[0].gate_up.out / 2;
        let layout = *kv.layout();
        let kv_sfx = Self::kv_suffix(kv);
        let ty = self.dtype.suffix();

        // The step's index arrays.
        let tokens = g.upload(&plan.tokens)?;
        let positions = g.upload(&plan.positions)?;
        let token_seq = g.upload(&plan.token_seq)?;
        let slots = g.upload(&plan.slots)?;
        let seq_bt_start = g.upload(&plan.seq_bt_start)?;
        let block_tables = g.upload(&plan.block_tables)?;

        // Activations.
        let mut x = g.zeros::<f32>(t * d)?;
        let h = g.typed_zeros(self.dtype, t * d)?;
        let mut qkv = g.zeros::<f32>(t * qkv_w)?;
        let attn = g.typed_zeros(self.dtype, t * nh * hd)?;
        // Attention's launch is the same for every layer: split into parts when few rows
        // attend over long contexts, with room for the parts' partial results.
        let max_ctx = plan
            .positions
            .iter()
            .map(|&p| p as usize + 1)
            .max()
            .unwrap_or(1);
        let attn_launch = launch::attention(t, nh, hd, max_ctx)?;
        let partials = g.zeros::<f32>(attn_launch.partial_floats.max(1))?;
        let mut o = g.zeros::<f32>(t * d)?;
        let mut gu = g.zeros::<f32>(t * 2 * ffn)?;
        let act = g.typed_zeros(self.dtype, t * ffn)?;
        let mut down = g.zeros::<f32>(t * d)?;

        use KArg::{F32s, I32s, I64s, Raw, Typed, F32, U32};
        let (vstart, vlen) = (self.vocab.start as u32, self.vocab.len() as u32);
        g.launch(
            &format!("embedding_{ty}"),
            launch::per_row(t, d, ROW_THREADS)?,
            &[
                Typed(&self.embed),
                KArg::U32s(&tokens),
                U32(vstart),
                U32(vlen),
                karg_i32(d),
                F32s(&x),
            ],
        )?;
        all_reduce(g, comm, &mut x)?;
        // Image rows replace their placeholder tokens' embeddings, after the all-reduce as on
        // the CPU (every rank has the whole batch, so every rank writes the same rows).
        let (mut rows, mut at) = (Vec::new(), Vec::new());
        for (row, values) in batch.image_rows() {
            // Step rows fit i32: the plan's token indices did.
            at.push(row as i32);
            rows.extend_from_slice(values);
        }
        if !at.is_empty() {
            let (rows_d, at_d) = (g.upload(&rows)?, g.upload(&at)?);
            g.launch(
                "scatter_rows",
                launch::per_row(at.len(), d, ROW_THREADS)?,
                &[
                    F32s(&rows_d),
                    I32s(&at_d),
                    karg_i32(at.len()),
                    karg_i32(d),
                    F32s(&x),
                ],
            )?;
        }

        let eps = cfg.rms_norm_eps;
        let norm = |x: &CudaSlice<f32>, delta: Option<&CudaSlice<f32>>, w: &CudaSlice<f32>| {
            g.launch(
                &format!("rms_norm_{ty}"),
                launch::per_row(t, d, ROW_THREADS)?,
                &[
                    F32s(x),
                    delta.map_or(Raw(0), F32s),
                    Raw(0),
                    F32s(w),
                    F32(eps),
                    karg_i32(d),
                    Typed(&h),
                ],
            )
        };
        let rope_fn = match cfg.rope_style {
            RopeStyle::Interleaved => "rope_interleaved",
            RopeStyle::Half => "rope_half",
        };
        let scale = 1.0 / (hd as f32).sqrt();

        for (li, layer) in self.layers.iter().enumerate() {
            norm(&x, (li > 0).then_some(&down), &layer.attn_norm)?;
            layer.qkv.forward(g, &h, t, &mut qkv)?;
            g.launch(
                rope_fn,
                launch::per_row(t, (nh + nkv) * hd / 2, ROW_THREADS)?,
                &[
                    F32s(&qkv),
                    I32s(&positions),
                    karg_i32(qkv_w),
                    karg_i32(nh + nkv),
                    karg_i32(hd),
                    F32s(&self.rope_cos),
                    F32s(&self.rope_sin),
                ],
            )?;
            let cache = kv.region_ptr(li);
            g.launch(
                &format!("write_kv_{kv_sfx}"),
                launch::per_row(t, nkv * hd, ROW_THREADS)?,
                &[
                    F32s(&qkv),
                    I64s(&slots),
                    karg_i32(qkv_w),
                    karg_i32(nh),
                    karg_i32(nkv),
                    karg_i32(hd),
                    karg_i32(layout.block_size),
                    karg_i32(layout.num_blocks),
                    Raw(cache),
                ],
            )?;
            on_layer(li, &plan)?;
            attend(
                g,
                &attn_launch,
                &AttentionArgs {
                    kv_suffix: kv_sfx,
                    qkv: &qkv,
                    qkv_w,
                    q_heads: nh,
                    kv_heads: nkv,
                    head_dim: hd,
                    token_seq: &token_seq,
                    positions: &positions,
                    seq_bt_start: &seq_bt_start,
                    block_tables: &block_tables,
                    block_size: layout.block_size,
                    num_blocks: layout.num_blocks,
                    cache: Raw(cache),
                    scale,
                    partials: &partials,
                },
                &attn,
            )?;
            layer.out.forward(g, &attn, t, &mut o)?;
            all_reduce(g, comm, &mut o)?;
            norm(&x, Some(&o), &layer.ffn_norm)?;
            layer.gate_up.forward(g, &h, t, &mut gu)?;
            g.launch(
                &format!("silu_mul_{ty}"),
                launch::elementwise(t * ffn),
                &[F32s(&gu), karg_i64(t), karg_i32(ffn), Typed(&act)],
            )?;
            layer.down.forward(g, &act, t, &mut down)?;
            all_reduce(g, comm, &mut down)?;
        }
        g.launch(
            "add_inplace",
            launch::elementwise(t * d),
            &[F32s(&x), F32s(&down), karg_i64(t * d)],
        )?;

        let n = plan.logit_rows.len();
        if n == 0 {
            g.synchronize()?;
            return Ok(Vec::new());
        }
        let rows = g.upload(&plan.logit_rows)?;
        let hn = g.typed_zeros(self.dtype, n * d)?;
        g.launch(
            &format!("rms_norm_{ty}"),
            launch::per_row(n, d, ROW_THREADS)?,
            &[
                F32s(&x),
                Raw(0),
                I32s(&rows),
                F32s(&self.final_norm),
                F32(eps),
                karg_i32(d),
                Typed(&hn),
            ],
        )?;
        let vr = self.vocab.len();
        let mut logits = g.zeros::<f32>(n * vr)?;
        match &self.lm_head {
            Some(head) => head.forward(g, &hn, n, &mut logits)?,
            None => g.linear(&self.embed, &hn, &mut logits, linear_gemm(n, d, vr))?,
        }
        let local = g.download(&logits)?;
        let gathered = comm.all_gather(&local)?;
        // `gathered` is rank-major: [rank][seq][vocab/tp]; rebuild [seq][vocab].
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

    /// Greedy choices on the device: for each row of `logits` ([rows, cols] on the device),
    /// the argmax (lowest id on ties), its value and the runner-up's value.
    ///
    /// # Errors
    /// Device failures.
    pub fn argmax_rows(&self, logits: &[f32], cols: usize) -> Result<Vec<(u32, f32, f32)>> {
        let g = &*self.gpu;
        let rows = logits.len() / cols.max(1);
        let dev = g.upload(logits)?;
        let best = g.zeros::<i32>(rows)?;
        let v1 = g.zeros::<f32>(rows)?;
        let v2 = g.zeros::<f32>(rows)?;
        g.launch(
            "argmax_rows",
            launch::per_row(rows, cols, 1024)?,
            &[
                KArg::F32s(&dev),
                karg_i32(cols),
                KArg::I32s(&best),
                KArg::F32s(&v1),
                KArg::F32s(&v2),
            ],
        )?;
        let (b, x, y) = (g.download(&best)?, g.download(&v1)?, g.download(&v2)?);
        Ok(b.into_iter()
            .zip(x)
            .zip(y)
            .map(|((b, x), y)| (b as u32, x, y))
            .collect())
    }
}

/// Host all-reduce of a device buffer: download, [`Collective::all_reduce_sum`], upload.
fn all_reduce(g: &GpuContext, comm: &dyn Collective, buf: &mut CudaSlice<f32>) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let mut host = g.download(buf)?;
    comm.all_reduce_sum(&mut host)?;
    g.upload_into(&host, buf)?;
    Ok(())
}

/// One layer's attention inputs (see `attention.cu`): the step's fused QKV rows, its index
/// arrays, the layer's paged KV region and room for a split launch's partial results.
pub(crate) struct AttentionArgs<'a> {
    /// `f32` or `f16`: the KV cache's element type (the kernel name's first suffix).
    pub kv_suffix: &'a str,
    pub qkv: &'a CudaSlice<f32>,
    pub qkv_w: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub token_seq: &'a CudaSlice<i32>,
    pub positions: &'a CudaSlice<i32>,
    pub seq_bt_start: &'a CudaSlice<i32>,
    pub block_tables: &'a CudaSlice<i32>,
    pub block_size: usize,
    pub num_blocks: usize,
    /// The layer's KV region.
    pub cache: KArg<'a>,
    pub scale: f32,
    /// At least [`launch::AttentionLaunch::partial_floats`] elements.
    pub partials: &'a CudaSlice<f32>,
}

/// Runs one layer's attention as `l` says: `paged_attention_*`, then `attention_combine_*`
/// when the launch is split; writes `out` (the matmul input type).
///
/// # Errors
/// [`DeviceError`] from a launch.
pub(crate) fn attend(
    g: &GpuContext,
    l: &launch::AttentionLaunch,
    a: &AttentionArgs<'_>,
    out: &TypedBuffer,
) -> std::result::Result<(), DeviceError> {
    use KArg::{F32s, I32s, Typed, F32};
    let ty = out.dtype().suffix();
    g.launch(
        &format!("paged_attention_{}_{ty}", a.kv_suffix),
        l.main,
        &[
            F32s(a.qkv),
            karg_i32(a.qkv_w),
            karg_i32(a.q_heads),
            karg_i32(a.kv_heads),
            karg_i32(a.head_dim),
            I32s(a.token_seq),
            I32s(a.positions),
            I32s(a.seq_bt_start),
            I32s(a.block_tables),
            karg_i32(a.block_size),
            karg_i32(a.num_blocks),
            a.cache,
            F32(a.scale),
            F32s(a.partials),
            Typed(out),
        ],
    )?;
    if let Some(combine) = l.combine {
        g.launch(
            &format!("attention_combine_{ty}"),
            combine,
            &[
                F32s(a.partials),
                karg_i32(a.q_heads),
                karg_i32(a.head_dim),
                karg_i32(l.parts),
                I32s(a.positions),
                Typed(out),
            ],
        )?;
    }
    Ok(())
}
