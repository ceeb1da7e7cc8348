//! Backend-independent pieces of a P/D hand-off and of greedy comparisons, used by the GPU
//! verification (`verify.rs`) and unit-tested here on CPU groups: greedy loops over any
//! [`StepGroup`], the span-by-span copy of a request's KV between two caches of one layout
//! (what a transfer does with the bytes), reads/writes of host KV regions, and the synthetic
//! model the verification runs by default.

use crate::batch::{Batch, SeqChunk};
use crate::engine::StepGroup;
use crate::kv::{KvKind, KvLayout, KvSpan};
use crate::{ModelError, Result};
use pdserve_runtime::memory::HostMemory;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The synthetic model `pdserve cuda verify` runs by default: SmolLM2-135M-Instruct's shape
/// (30 layers, 9 heads, 3 KV heads, dim 576, FFN 1536, vocabulary 49152) with seeded weights,
/// so a GPU machine that cannot fetch the real model still checks the same shapes.
pub const SYNTHETIC_SMOLLM: &str =
    "tiny,layers=30,heads=9,kv_heads=3,head_dim=64,hidden=576,ffn=1536,vocab=49152,context=8192";

/// Writes [`SYNTHETIC_SMOLLM`] as a Q4_1 GGUF in `dir` (llama architecture: interleaved RoPE,
/// quantized weights dequantized by the loader, as the real default model) and, when
/// `export_hf` is given, as an HF checkpoint there (half-split RoPE, f32) for HF transformers.
/// Returns the GGUF's path.
///
/// # Errors
/// I/O and tensor-library failures.
pub fn write_synthetic_smollm(dir: &Path, export_hf: Option<&Path>) -> Result<PathBuf> {
    use crate::synthetic::{write_gguf, write_safetensors_dir, SyntheticSpec};
    let spec = SyntheticSpec::parse(SYNTHETIC_SMOLLM)?;
    if let Some(hf) = export_hf {
        write_safetensors_dir(&spec, hf, false)?;
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join("synthetic-smollm.Q4_1.gguf");
    write_gguf(&spec, &path, candle_core::quantized::GgmlDType::Q4_1)?;
    Ok(path)
}

/// The largest and second-largest logit and the argmax (lowest id on ties).
pub fn top2(logits: &[f32]) -> (u32, f32, f32) {
    let best = crate::sampling::argmax(logits);
    let v1 = logits[best as usize];
    let v2 = logits
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != best as usize)
        .map(|(_, &v)| v)
        .fold(f32::NEG_INFINITY, f32::max);
    (best, v1, v2)
}

/// Logits of the last token of `tokens`, prefilled in one step into `table`.
///
/// # Errors
/// Forward-pass failures.
pub fn prefill_logits(group: &impl StepGroup, tokens: &[u32], table: &[u32]) -> Result<Vec<f32>> {
    let mut out = group.step(Batch {
        seqs: vec![SeqChunk {
            tokens: tokens.to_vec(),
            start_pos: 0,
            block_table: table.to_vec(),
            want_logits: true,
            all_logits: false,
            embeds: Vec::new(),
        }],
    })?;
    out.pop()
        .ok_or_else(|| ModelError::InvalidBatch("no logits returned".into()))
}

/// Greedy decode of `n` tokens starting by feeding `first` at position `pos` (the cache holds
/// positions `0..pos` in `table`); returns the `n` tokens chosen after `first`.
///
/// # Errors
/// Forward-pass failures.
pub fn decode_greedy(
    group: &impl StepGroup,
    pos: usize,
    first: u32,
    n: usize,
    table: &[u32],
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(n);
    let mut last = first;
    for i in 0..n {
        let logits = group.step(Batch {
            seqs: vec![SeqChunk {
                tokens: vec![last],
                start_pos: pos + i,
                block_table: table.to_vec(),
                want_logits: true,
                all_logits: false,
                embeds: Vec::new(),
            }],
        })?;
        last = crate::sampling::argmax(&logits[0]);
        out.push(last);
    }
    Ok(out)
}

/// `n` greedy tokens after `prompt` (the first from the prefill, then `n - 1` decode steps).
///
/// # Errors
/// Forward-pass failures.
pub fn greedy(group: &impl StepGroup, prompt: &[u32], n: usize, table: &[u32]) -> Result<Vec<u32>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let t0 = crate::sampling::argmax(&prefill_logits(group, prompt, table)?);
    let mut out = vec![t0];
    out.extend(decode_greedy(group, prompt.len(), t0, n - 1, table)?);
    Ok(out)
}

/// Copies the KV of the first `tokens` positions of a sequence — every layer, K and V, all of
/// the rank's heads — from blocks `src` of one cache to blocks `dst` of another of the same
/// layout, span by span: what a transfer does with the bytes of a hand-off.
///
/// # Errors
/// Whatever `read` or `write` return; [`ModelError::InvalidBatch`] for short block tables.
pub fn copy_kv(
    layout: &KvLayout,
    src: &[u32],
    dst: &[u32],
    tokens: usize,
    mut read: impl FnMut(KvSpan) -> Result<Vec<u8>>,
    mut write: impl FnMut(KvSpan, &[u8]) -> Result<()>,
) -> Result<()> {
    let n = layout.blocks_for(tokens);
    if src.len() < n || dst.len() < n {
        return Err(ModelError::InvalidBatch(format!(
            "{tokens} tokens need {n} blocks on each side"
        )));
    }
    for layer in 0..layout.num_layers {
        for kind in [KvKind::Key, KvKind::Value] {
            for (&s, &d) in src[..n].iter().zip(&dst[..n]) {
                let heads = 0..layout.num_kv_heads;
                let bytes = read(layout.span(layer, kind, s as usize, heads.clone()))?;
                write(layout.span(layer, kind, d as usize, heads), &bytes)?;
            }
        }
    }
    Ok(())
}

/// Reads a span out of host memory regions (a KV host mirror).
pub fn read_host_span(regions: &[Arc<dyn HostMemory>], span: KvSpan) -> Vec<u8> {
    let r = &regions[span.region];
    assert!(span.offset + span.len <= r.len());
    // SAFETY: in bounds (asserted); the region lives while `regions` is borrowed, and the
    // caller reads it only after the step that wrote it completed.
    unsafe { std::slice::from_raw_parts(r.as_ptr().add(span.offset), span.len).to_vec() }
}

/// Writes a span into host memory regions (a KV host mirror).
pub fn write_host_span(regions: &[Arc<dyn HostMemory>], span: KvSpan, bytes: &[u8]) {
    let r = &regions[span.region];
    assert!(span.offset + span.len <= r.len() && bytes.len() == span.len);
    // SAFETY: in bounds (asserted); no step reads these blocks until they are uploaded.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), r.as_ptr().add(span.offset), span.len) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::SyntheticSpec;
    use crate::tp::{TpGroup, TpOptions};
    use crate::weights::WeightFormat;
    use pdserve_runtime::memory::{AnonAllocator, HostMemoryAllocator};

    #[test]
    fn top2_finds_the_margin_and_breaks_ties_low() {
        assert_eq!(top2(&[1.0, 5.0, 3.0, 5.0]), (1, 5.0, 5.0));
        assert_eq!(top2(&[0.5, -1.0, 2.5]), (2, 2.5, 0.5));
    }

    #[test]
    fn a_handoff_by_kv_spans_decodes_the_colocated_tokens() {
        // The hand-off path of `run`, CPU to CPU: prefill on one group, copy the request's KV
        // span by span into other blocks of another group, decode there.
        let spec = SyntheticSpec::parse("tiny,layers=2").unwrap();
        let store = spec.build().unwrap();
        let opts = TpOptions {
            tp: 2,
            num_blocks: 16,
            block_size: 4,
            format: WeightFormat::F32,
            kv_dtype: crate::kv::KvDtype::F32,
        };
        let a = TpGroup::new(&spec.config, &store, &opts, &AnonAllocator).unwrap();
        let b = TpGroup::new(&spec.config, &store, &opts, &AnonAllocator).unwrap();
        let prompt: Vec<u32> = (0..10).map(|i| 20 + 7 * i).collect();
        let table: Vec<u32> = (0..5).collect();
        let other: Vec<u32> = (9..14).collect();
        let colocated = greedy(&b, &prompt, 6, &table).unwrap();

        let t0 = crate::sampling::argmax(&prefill_logits(&a, &prompt, &table).unwrap());
        assert_eq!(t0, colocated[0]);
        for (rank, layout) in a.layouts().into_iter().enumerate() {
            copy_kv(
                &layout,
                &table,
                &other,
                prompt.len(),
                |s| a.with_kv(rank, move |kv| kv.read_span(s)),
                |s, bytes| {
                    let bytes = bytes.to_vec();
                    b.with_kv(rank, move |kv| kv.write_span(s, &bytes))
                },
            )
            .unwrap();
        }
        let handed = decode_greedy(&b, prompt.len(), t0, 5, &other).unwrap();
        assert_eq!(handed, colocated[1..]);

        // Block tables too short for the tokens are refused, not copied in part.
        let short = copy_kv(
            &a.layouts()[0],
            &table[..2],
            &other,
            prompt.len(),
            |_| Ok(Vec::new()),
            |_, _| Ok(()),
        );
        assert_eq!(short.unwrap_err().kind(), "invalid_batch");
    }

    #[test]
    fn host_spans_round_trip() {
        let regions: Vec<Arc<dyn HostMemory>> = vec![AnonAllocator.allocate(4096).unwrap()];
        let span = KvSpan {
            region: 0,
            offset: 100,
            len: 5,
        };
        write_host_span(&regions, span, &[1, 2, 3, 4, 5]);
        assert_eq!(read_host_span(&regions, span), vec![1, 2, 3, 4, 5]);
    }
}
