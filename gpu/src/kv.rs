//! The paged KV cache: plain, page-aligned host regions with an explicit byte layout.
//!
//! # Layout
//! One region per layer. Inside a layer's region, all K blocks come first, then all V blocks:
//!
//! ```text
//! layer region = [K|V][block][kv_head][slot_in_block][head_dim]   (KvDtype, little endian)
//! ```
//!
//! so the bytes of `(layer, K or V, block, kv-head range)` are one contiguous span, computable
//! with [`KvLayout::span`] without touching any tensor API. A transport copies blocks in and out
//! by those spans; a decode rank that owns a subset of the heads (heterogeneous TP) reads the
//! matching head sub-range of each block.
//!
//! The heads of a layout are the heads *of one TP rank*: rank `r` of `tp` owns KV heads
//! `[r * kv_heads / tp, (r + 1) * kv_heads / tp)` of the model.

use crate::{ModelError, Result};
use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;

/// Default tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvKind {
    /// The key half of a layer.
    Key = 0,
    /// The value half of a layer.
    Value = 1,
}

/// Element type of the cache: `f32`, or `f16`/`bf16` (half the bytes to store and hand off;
/// K and V are rounded once when written, attention reads them widened to f32). Part of the
/// layout (and so of the compat key): peers with another dtype refuse each other.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub enum KvDtype {
    /// 32-bit float.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl From<pdserve_runtime::config::KvCacheDtype> for KvDtype {
    fn from(d: pdserve_runtime::config::KvCacheDtype) -> Self {
        use pdserve_runtime::config::KvCacheDtype;
        match d {
            KvCacheDtype::F32 => Self::F32,
            KvCacheDtype::F16 => Self::F16,
            KvCacheDtype::Bf16 => Self::Bf16,
        }
    }
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// The config spelling (`f32`, `f16`, `bf16`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::Bf16),
            other => Err(ModelError::InvalidBatch(format!(
                "unknown KV cache dtype `{other}` (expected f32, f16 or bf16)"
            ))),
        }
    }
}

/// One head's slots of one block as stored (`block_size * head_dim` elements).
#[derive(Clone, Copy, Debug)]
pub enum HeadBlock<'a> {
    /// An f32 cache: read in place.
    F32(&'a [f32]),
    /// An f16 cache.
    F16(&'a [half::f16]),
    /// A bf16 cache.
    Bf16(&'a [half::bf16]),
}

impl<'a> HeadBlock<'a> {
    /// Values in the block.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::F16(s) => s.len(),
            Self::Bf16(s) => s.len(),
        }
    }

    /// Whether the block holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32: borrowed from an f32 cache, widened otherwise.
    pub fn widen(self) -> std::borrow::Cow<'a, [f32]> {
        match self {
            Self::F32(s) => std::borrow::Cow::Borrowed(s),
            Self::F16(s) => std::borrow::Cow::Owned(s.iter().map(|x| x.to_f32()).collect()),
            Self::Bf16(s) => std::borrow::Cow::Owned(s.iter().map(|x| x.to_f32()).collect()),
        }
    }

    /// The values as f32: borrowed from an f32 cache, else widened into `buf` (reused, so
    /// a loop over blocks allocates nothing).
    pub fn as_f32<'b>(self, buf: &'b mut Vec<f32>) -> &'b [f32]
    where
        'a: 'b,
    {
        use half::slice::HalfFloatSliceExt;
        match self {
            Self::F32(s) => s,
            Self::F16(s) => {
                buf.resize(s.len(), 0.0);
                s.convert_to_f32_slice(buf);
                buf
            }
            Self::Bf16(s) => {
                buf.resize(s.len(), 0.0);
                s.convert_to_f32_slice(buf);
                buf
            }
        }
    }

    /// Writes the first `out.len()` values, as f32, into `out`.
    pub fn copy_to(self, out: &mut [f32]) {
        let n = out.len();
        match self {
            Self::F32(s) => out.copy_from_slice(&s[..n]),
            Self::F16(s) => out
                .iter_mut()
                .zip(&s[..n])
                .for_each(|(o, x)| *o = x.to_f32()),
            Self::Bf16(s) => out
                .iter_mut()
                .zip(&s[..n])
                .for_each(|(o, x)| *o = x.to_f32()),
        }
    }
}

/// The byte layout of one TP rank's KV cache.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct KvLayout {
    /// Decoder layers (one region each).
    pub num_layers: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads held by this rank.
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Element type.
    pub dtype: KvDtype,
}

/// A contiguous byte span inside one layer's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpan {
    /// Index of the region (= the layer).
    pub region: usize,
    /// Byte offset inside the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl KvLayout {
    /// Bytes of one head's slots in one block: `block_size * head_dim * dtype`.
    pub fn head_bytes(&self) -> usize {
        self.block_size * self.head_dim * self.dtype.size()
    }

    /// Bytes of one block of K (or V) of one layer, all heads of this rank.
    pub fn block_bytes(&self) -> usize {
        self.num_kv_heads * self.head_bytes()
    }

    /// Bytes of one layer's region (K and V of every block).
    pub fn region_bytes(&self) -> usize {
        2 * self.num_blocks * self.block_bytes()
    }

    /// Total bytes over all layers.
    pub fn total_bytes(&self) -> usize {
        self.num_layers * self.region_bytes()
    }

    /// Bytes one token occupies over all layers, K and V.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size()
    }

    /// The byte span of `(layer, kind, block, heads)`.
    ///
    /// # Panics
    /// When any index is out of range: callers validate block ids before asking.
    pub fn span(&self, layer: usize, kind: KvKind, block: usize, heads: Range<usize>) -> KvSpan {
        assert!(layer < self.num_layers, "layer {layer} out of range");
        assert!(block < self.num_blocks, "block {block} out of range");
        assert!(
            heads.start <= heads.end && heads.end <= self.num_kv_heads,
            "heads {heads:?} out of range"
        );
        let kind_base = kind as usize * self.num_blocks * self.block_bytes();
        KvSpan {
            region: layer,
            offset: kind_base + block * self.block_bytes() + heads.start * self.head_bytes(),
            len: heads.len() * self.head_bytes(),
        }
    }

    /// Byte offset of one token slot of one head (`head_dim` elements follow).
    pub fn slot_offset(&self, kind: KvKind, block: usize, head: usize, slot: usize) -> usize {
        let kind_base = kind as usize * self.num_blocks * self.block_bytes();
        kind_base
            + block * self.block_bytes()
            + head * self.head_bytes()
            + slot * self.head_dim * self.dtype.size()
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// One rank's paged KV cache: a region per layer, allocated through a [`HostMemoryAllocator`]
/// (anonymous memory by default; shared memory when a transport must reach it).
pub struct KvCache {
    layout: KvLayout,
    regions: Vec<Arc<dyn HostMemory>>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layout", &self.layout)
            .finish()
    }
}

impl KvCache {
    /// Allocates one region per layer.
    ///
    /// # Errors
    /// [`ModelError::Io`] when the memory cannot be mapped; [`ModelError::InvalidBatch`] for a
    /// layout with no blocks.
    pub fn new(layout: KvLayout, alloc: &dyn HostMemoryAllocator) -> Result<Self> {
        if layout.num_blocks == 0 || layout.block_size == 0 {
            return Err(ModelError::InvalidBatch(
                "a KV cache needs at least one block".into(),
            ));
        }
        let regions = (0..layout.num_layers)
            .map(|_| alloc.allocate(layout.region_bytes()))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self { layout, regions })
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The regions, one per layer, for registration with a transfer engine.
    pub fn regions(&self) -> &[Arc<dyn HostMemory>] {
        &self.regions
    }

    /// Reads a span as bytes (a copy).
    pub fn read_span(&self, span: KvSpan) -> Vec<u8> {
        let region = &self.regions[span.region];
        assert!(span.offset + span.len <= region.len());
        // SAFETY: the span lies inside the region, which lives as long as `self`.
        unsafe { std::slice::from_raw_parts(region.as_ptr().add(span.offset), span.len).to_vec() }
    }

    /// Writes bytes into a span.
    pub fn write_span(&mut self, span: KvSpan, bytes: &[u8]) {
        let region = &self.regions[span.region];
        assert!(span.offset + span.len <= region.len() && bytes.len() == span.len);
        // SAFETY: bounds checked above; `&mut self` excludes other writers in this process.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                region.as_ptr().add(span.offset),
                span.len,
            );
        }
    }

    /// Bytes of one block over every layer, K and V, all of this rank's heads: what
    /// [`KvCache::read_block`] returns and [`KvCache::write_block`] takes.
    pub fn block_bytes_all_layers(&self) -> usize {
        2 * self.layout.num_layers * self.layout.block_bytes()
    }

    /// Appends one block's KV over every layer to `out`: for each layer, its K block then its
    /// V block (this rank's heads), as stored.
    ///
    /// # Panics
    /// When `block` is out of range.
    pub fn read_block(&self, block: usize, out: &mut Vec<u8>) {
        let heads = 0..self.layout.num_kv_heads;
        for layer in 0..self.layout.num_layers {
            for kind in [KvKind::Key, KvKind::Value] {
                let span = self.layout.span(layer, kind, block, heads.clone());
                let region = &self.regions[span.region];
                assert!(span.offset + span.len <= region.len());
                // SAFETY: the span lies inside the region, which lives as long as `self`.
                out.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(region.as_ptr().add(span.offset), span.len)
                });
            }
        }
    }

    /// Writes one block's KV over every layer from `bytes`, laid out as
    /// [`KvCache::read_block`] returns it.
    ///
    /// # Panics
    /// When `block` is out of range or `bytes` is not [`KvCache::block_bytes_all_layers`]
    /// long.
    pub fn write_block(&mut self, block: usize, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.block_bytes_all_layers(), "block bytes");
        let heads = 0..self.layout.num_kv_heads;
        let mut at = 0;
        for layer in 0..self.layout.num_layers {
            for kind in [KvKind::Key, KvKind::Value] {
                let span = self.layout.span(layer, kind, block, heads.clone());
                self.write_span(span, &bytes[at..at + span.len]);
                at += span.len;
            }
        }
    }

    /// Bytes of one block's K and V in one layer (this rank's heads): a layer's share of
    /// [`KvCache::read_block`], which lays layer `l` at `l * block_layer_bytes()`.
    pub fn block_layer_bytes(&self) -> usize {
        2 * self.layout.block_bytes()
    }

    /// Writes one block's K and V of `layer` from `bytes`, laid out as that layer's share
    /// of [`KvCache::read_block`] (K then V).
    ///
    /// # Panics
    /// When `block` or `layer` is out of range or `bytes` is not
    /// [`KvCache::block_layer_bytes`] long.
    pub fn write_block_layer(&mut self, block: usize, layer: usize, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.block_layer_bytes(), "block layer bytes");
        let heads = 0..self.layout.num_kv_heads;
        let mut at = 0;
        for kind in [KvKind::Key, KvKind::Value] {
            let span = self.layout.span(layer, kind, block, heads.clone());
            self.write_span(span, &bytes[at..at + span.len]);
            at += span.len;
        }
    }

    /// Writes one token's K or V for one head (rounded to the cache's dtype).
    pub fn write_slot(
        &mut self,
        layer: usize,
        kind: KvKind,
        block: usize,
        head: usize,
        slot: usize,
        data: &[f32],
    ) {
        debug_assert_eq!(data.len(), self.layout.head_dim);
        let off = self.layout.slot_offset(kind, block, head, slot);
        let region = &self.regions[layer];
        let n = data.len();
        assert!(off + n * self.layout.dtype.size() <= region.len());
        // SAFETY: in bounds (asserted); the region is aligned for every dtype (page aligned,
        // offsets are multiples of the element size); `&mut self` excludes concurrent writers
        // in this process.
        unsafe {
            let dst = region.as_ptr().add(off);
            match self.layout.dtype {
                KvDtype::F32 => std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut f32, n),
                KvDtype::F16 => std::slice::from_raw_parts_mut(dst as *mut half::f16, n)
                    .iter_mut()
                    .zip(data)
                    .for_each(|(d, &x)| *d = half::f16::from_f32(x)),
                KvDtype::Bf16 => std::slice::from_raw_parts_mut(dst as *mut half::bf16, n)
                    .iter_mut()
                    .zip(data)
                    .for_each(|(d, &x)| *d = half::bf16::from_f32(x)),
            }
        }
    }

    /// One head's slots of one block as stored (`block_size * head_dim` elements).
    pub fn head_block(
        &self,
        layer: usize,
        kind: KvKind,
        block: usize,
        head: usize,
    ) -> HeadBlock<'_> {
        let off = self.layout.slot_offset(kind, block, head, 0);
        let n = self.layout.block_size * self.layout.head_dim;
        let region = &self.regions[layer];
        assert!(off + n * self.layout.dtype.size() <= region.len());
        // SAFETY: in bounds (asserted), aligned for the element type, and the region outlives
        // the borrow of `self`.
        unsafe {
            let p = region.as_ptr().add(off);
            match self.layout.dtype {
                KvDtype::F32 => HeadBlock::F32(std::slice::from_raw_parts(p as *const f32, n)),
                KvDtype::F16 => {
                    HeadBlock::F16(std::slice::from_raw_parts(p as *const half::f16, n))
                }
                KvDtype::Bf16 => {
                    HeadBlock::Bf16(std::slice::from_raw_parts(p as *const half::bf16, n))
                }
            }
        }
    }
}

/// A free list of block ids: the minimal allocator `generate` and tests use. The serving
/// scheduler's `BlockManager` adds ref counts and watermarks on top.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<u32>,
    total: usize,
}

impl BlockAllocator {
    /// All `total` blocks free.
    pub fn new(total: usize) -> Self {
        Self {
            free: (0..total as u32).rev().collect(),
            total,
        }
    }

    /// Takes `n` blocks.
    ///
    /// # Errors
    /// [`ModelError::OutOfBlocks`] when fewer than `n` are free (nothing is taken).
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(ModelError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
            });
        }
        Ok(self
            .free
            .split_off(self.free.len() - n)
            .into_iter()
            .rev()
            .collect())
    }

    /// Returns blocks to the pool.
    pub fn free(&mut self, blocks: &[u32]) {
        self.free.extend(blocks.iter().rev());
        debug_assert!(self.free.len() <= self.total);
    }

    /// Free blocks.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Pool size.
    pub fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_runtime::memory::AnonAllocator;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 5,
            block_size: 4,
            num_kv_heads: 3,
            head_dim: 8,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn a_block_written_layer_by_layer_reads_back_as_a_whole_block() {
        let l = layout();
        let mut kv = KvCache::new(l, &AnonAllocator).unwrap();
        let whole: Vec<u8> = (0..kv.block_bytes_all_layers())
            .map(|i| (i % 251) as u8)
            .collect();
        let lb = kv.block_layer_bytes();
        assert_eq!(lb * l.num_layers, whole.len());
        for layer in (0..l.num_layers).rev() {
            kv.write_block_layer(3, layer, &whole[layer * lb..(layer + 1) * lb]);
        }
        let mut back = Vec::new();
        kv.read_block(3, &mut back);
        assert_eq!(back, whole);
        let mut other = Vec::new();
        kv.read_block(2, &mut other);
        assert!(other.iter().all(|&b| b == 0), "no other block is touched");
    }

    #[test]
    fn spans_tile_each_region_exactly() {
        let l = layout();
        let mut covered = vec![false; l.region_bytes()];
        for kind in [KvKind::Key, KvKind::Value] {
            for b in 0..l.num_blocks {
                for h in 0..l.num_kv_heads {
                    let s = l.span(1, kind, b, h..h + 1);
                    assert_eq!(s.region, 1);
                    for c in &mut covered[s.offset..s.offset + s.len] {
                        assert!(!*c, "overlap");
                        *c = true;
                    }
                }
            }
        }
        assert!(covered.iter().all(|&c| c));
        // A head range is contiguous and equals the concatenation of single heads.
        let s = l.span(0, KvKind::Value, 2, 1..3);
        assert_eq!(s.offset, l.span(0, KvKind::Value, 2, 1..2).offset);
        assert_eq!(s.len, 2 * l.head_bytes());
    }

    #[test]
    fn written_slots_land_in_the_computed_span() {
        let l = layout();
        let mut kv = KvCache::new(l, &AnonAllocator).unwrap();
        let data: Vec<f32> = (0..8).map(|i| i as f32 + 0.5).collect();
        kv.write_slot(1, KvKind::Value, 3, 2, 1, &data);
        let span = l.span(1, KvKind::Value, 3, 2..3);
        let bytes = kv.read_span(span);
        let slot_bytes = &bytes[8 * 4..16 * 4];
        let back: Vec<f32> = slot_bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(back, data);
        // Nothing else in the region was touched.
        let all = kv.read_span(KvSpan {
            region: 1,
            offset: 0,
            len: l.region_bytes(),
        });
        let nonzero = all.iter().filter(|&&b| b != 0).count();
        assert_eq!(nonzero, bytes.iter().filter(|&&b| b != 0).count());
    }

    #[test]
    fn half_caches_store_two_bytes_an_element_and_read_back_rounded() {
        let data: Vec<f32> = (0..8).map(|i| i as f32 * 0.1 - 0.3).collect();
        for (dtype, round) in [
            (
                KvDtype::F16,
                (|x: f32| half::f16::from_f32(x).to_f32()) as fn(f32) -> f32,
            ),
            (KvDtype::Bf16, |x: f32| half::bf16::from_f32(x).to_f32()),
        ] {
            let l = KvLayout { dtype, ..layout() };
            assert_eq!(l.region_bytes() * 2, layout().region_bytes());
            let mut kv = KvCache::new(l, &AnonAllocator).unwrap();
            kv.write_slot(1, KvKind::Value, 3, 2, 1, &data);
            let block = kv.head_block(1, KvKind::Value, 3, 2).widen();
            let want: Vec<f32> = data.iter().map(|&x| round(x)).collect();
            assert_eq!(&block[8..16], &want[..], "{dtype:?}");
            assert!(block[..8].iter().chain(&block[16..]).all(|&x| x == 0.0));
            let mut out = vec![0f32; 16];
            kv.head_block(1, KvKind::Value, 3, 2).copy_to(&mut out);
            assert_eq!(&out[8..16], &want[..]);
            // The slot's bytes are where the layout says, two per element.
            let span = l.span(1, KvKind::Value, 3, 2..3);
            let bytes = kv.read_span(span);
            assert!(bytes[..16].iter().all(|&b| b == 0));
            assert!(bytes[16..32].iter().any(|&b| b != 0));
            assert_eq!("bf16".parse::<KvDtype>().unwrap(), KvDtype::Bf16);
            assert!("f8".parse::<KvDtype>().is_err());
        }
    }

    #[test]
    fn allocator_refuses_without_taking() {
        let mut a = BlockAllocator::new(4);
        let got = a.allocate(3).unwrap();
        assert_eq!(got, vec![0, 1, 2]);
        assert!(matches!(
            a.allocate(2),
            Err(ModelError::OutOfBlocks { needed: 2, free: 1 })
        ));
        assert_eq!(a.num_free(), 1);
        a.free(&got);
        assert_eq!(a.num_free(), 4);
    }
}
