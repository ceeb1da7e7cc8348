//! Layer-by-layer load-back: a restore whose compute starts before its last layer arrives.
//!
//! A blocking task first *opens* every block of the run ([`KvTiers::open_stream`]: the host
//! region's and the Redis store's blocks read and verified whole, each disk or
//! shared-directory file opened with its header — key, parent, token ids, compatibility key
//! and length — checked and its checksum read), then reads the files **layer by layer**
//! ([`StreamLoad::run`]: layer 0 of every block, then layer 1, ..., a file's layers in at
//! most [`READS_PER_FILE`] reads) and publishes each layer to the [`RestoreStream`] as it
//! lands. The request is admitted as soon as the layers still to read would land within
//! the time its first step computes before reaching them (the Scheduler's recent prefill
//! pace × the tokens left to compute, less a margin): right after the first layer from a
//! fast store, near the end of the load from one slower than the compute — so the step is
//! never left waiting on a slow store for long. That step computes the rest of the prompt
//! while the layers land: every rank, at each layer, waits for the layer (before attention
//! reads it) and writes it into the request's fresh pool blocks ([`RestoreStream::feed`]).
//!
//! **Verified all the same.** Once the last layer landed, each file's XXH3-64 is checked over
//! the bytes read; at the last layer the ranks wait for that verdict. A checksum mismatch, a
//! short read or a load past `kv_tiers.load_timeout_ms` fails the stream: the step still
//! ends (other requests in it are untouched: attention never crosses sequences), but the
//! Scheduler discards what it computed for this request, which is recomputed from its
//! tokens without the tiers; its restored blocks are never registered in the prefix cache.
//! A timeout pauses the disk tier and the shared store as a whole load's does.
//!
//! Every request whose prompt is computed here streams, a prefill instance's for a decode
//! peer included (the peer reads its blocks once the request ended, after the restore was
//! settled). Loaded whole: a decode instance's P/D request (its prompt KV then comes from a
//! prefill instance; nothing computes meanwhile), a pushed hand-off (its layers go to the
//! peer as the step computes them, so they must be final), and requests that ask for prompt
//! logprobs (no tier lookup at all); `kv_tiers.stream_layers = false` loads every request
//! whole.

use super::{BlockStore, KvTiers, TierBlock, TierError};
use crate::block_manager::BlockHash;
use pdserve_gpu::kv::KvCache;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

/// Reads of one block file a streamed restore makes at most (its layers in this many
/// groups).
const READS_PER_FILE: usize = 8;

/// Why a stream failed (each a miss: the request is recomputed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFailure {
    /// A layer or the verdict did not arrive before the load's deadline.
    Timeout,
    /// A file failed verification or a read (counted per tier as a miss).
    Miss,
    /// A rank's cache has another layout, or a block id is out of its range.
    Layout,
    /// The Scheduler gave the stream up (the request left, or was admitted otherwise).
    Abandoned,
}

impl StreamFailure {
    /// A stable label for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Miss => "miss",
            Self::Layout => "layout",
            Self::Abandoned => "abandoned",
        }
    }
}

#[derive(Debug, Default)]
struct Progress {
    /// Layers published (`0..landed` may be read).
    landed: usize,
    /// `Some(Ok(()))` once every block verified; `Some(Err(_))` once the stream failed.
    verdict: Option<Result<(), StreamFailure>>,
    /// Layers ranks took before the last layer had landed (what streaming buys).
    early: usize,
}

/// The layers of one restore as they land, shared by the loader and every rank.
pub struct RestoreStream {
    layers: usize,
    tp: usize,
    blocks: usize,
    /// Bytes of one block's layer on one rank (its heads' K, then V).
    layer_bytes: usize,
    /// Layer `l`: block `i`'s share of rank `r` at `(i * tp + r) * layer_bytes`.
    data: Vec<OnceLock<Vec<u8>>>,
    progress: Mutex<Progress>,
    changed: Condvar,
    deadline: Instant,
}

impl std::fmt::Debug for RestoreStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreStream")
            .field("layers", &self.layers)
            .field("blocks", &self.blocks)
            .finish()
    }
}

impl RestoreStream {
    /// An empty stream of `blocks` blocks of `layers` layers over `tp` ranks, each rank's
    /// layer of a block `layer_bytes` long; waits end at `deadline`.
    pub fn new(
        blocks: usize,
        layers: usize,
        tp: usize,
        layer_bytes: usize,
        deadline: Instant,
    ) -> Self {
        Self {
            layers,
            tp,
            blocks,
            layer_bytes,
            data: (0..layers).map(|_| OnceLock::new()).collect(),
            progress: Mutex::default(),
            changed: Condvar::new(),
            deadline,
        }
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks in the stream.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Publishes layer `layer` (laid out as [`RestoreStream::data`] says). Layers land in
    /// order; a layer of the wrong length fails the stream.
    fn land(&self, layer: usize, bytes: Vec<u8>) {
        if bytes.len() != self.blocks * self.tp * self.layer_bytes {
            return self.fail(StreamFailure::Layout);
        }
        let mut p = self.progress();
        if p.verdict.is_some() || p.landed != layer || self.data[layer].set(bytes).is_err() {
            return;
        }
        p.landed = layer + 1;
        drop(p);
        self.changed.notify_all();
    }

    /// Every block verified: the ranks' last layer may end.
    fn verified(&self) {
        let mut p = self.progress();
        if p.verdict.is_none() && p.landed == self.layers {
            p.verdict = Some(Ok(()));
        }
        drop(p);
        self.changed.notify_all();
    }

    /// Fails the stream (the first failure stays); every waiting rank goes on.
    pub fn fail(&self, why: StreamFailure) {
        let mut p = self.progress();
        if p.verdict.is_none() {
            p.verdict = Some(Err(why));
        }
        drop(p);
        self.changed.notify_all();
    }

    /// The outcome once known: `Some(Ok(()))` when every layer landed verified.
    pub fn verdict(&self) -> Option<Result<(), StreamFailure>> {
        self.progress().verdict
    }

    /// Layers ranks took before the whole restore had landed.
    pub fn early_layers(&self) -> usize {
        self.progress().early
    }

    /// Waits until `ready` holds or the stream failed; a wait past the deadline fails it.
    /// Returns the progress, still locked (`None` once failed).
    fn wait(
        &self,
        ready: impl Fn(&Progress) -> bool,
    ) -> Option<std::sync::MutexGuard<'_, Progress>> {
        let mut p = self.progress();
        loop {
            if matches!(p.verdict, Some(Err(_))) {
                return None;
            }
            if ready(&p) {
                return Some(p);
            }
            let now = Instant::now();
            if now >= self.deadline {
                p.verdict = Some(Err(StreamFailure::Timeout));
                drop(p);
                self.changed.notify_all();
                return None;
            }
            p = self
                .changed
                .wait_timeout(p, self.deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Rank `rank`'s part of the step at `layer`: waits for the layer, writes its share of
    /// every block into `blocks` (pool ids, in stream order) of `kv`; at the last layer also
    /// waits for the verdict. A failed stream writes nothing more (the Scheduler discards
    /// what the step computed for its request).
    pub fn feed(&self, rank: usize, layer: usize, kv: &mut KvCache, blocks: &[u32]) {
        if layer >= self.layers {
            return;
        }
        let Some(mut p) = self.wait(|p| p.landed > layer) else {
            return;
        };
        if p.landed < self.layers {
            p.early += 1;
            drop(p);
            self.changed.notify_all(); // a held last layer waits for this
        } else {
            drop(p);
        }
        let lb = self.layer_bytes;
        if blocks.len() != self.blocks
            || rank >= self.tp
            || kv.block_layer_bytes() != lb
            || blocks.iter().any(|&b| b as usize >= kv.layout().num_blocks)
        {
            return self.fail(StreamFailure::Layout);
        }
        let Some(data) = self.data[layer].get() else {
            return self.fail(StreamFailure::Layout);
        };
        for (i, &b) in blocks.iter().enumerate() {
            let at = (i * self.tp + rank) * lb;
            kv.write_block_layer(b as usize, layer, &data[at..at + lb]);
        }
        if layer + 1 == self.layers {
            self.wait(|p| p.verdict.is_some());
        }
    }
}

/// A disk or shared-directory block file opened for a streamed restore: its header checked,
/// its payload still to read.
pub(super) struct BlockFile {
    pub(super) file: std::fs::File,
    /// Every byte before the payload (the checksum covers them).
    pub(super) header: Vec<u8>,
    /// Where the payload starts.
    pub(super) payload_at: u64,
    /// The stored XXH3-64 of header and payload.
    pub(super) sum: u64,
    /// Its prefix-cache hits when stored.
    pub(super) hits: u32,
}

/// Where one block of a run comes from.
pub(super) enum Source {
    /// Read and verified whole (the host region, the Redis store; a whole load's disk reads).
    Whole(Arc<TierBlock>),
    /// An opened file of the disk tier (`shared`: of the shared directory).
    File {
        hash: BlockHash,
        shared: bool,
        file: BlockFile,
    },
}

impl Source {
    pub(super) fn hits(&self) -> u32 {
        match self {
            Source::Whole(b) => b.hits,
            Source::File { file, .. } => file.hits,
        }
    }
}

/// A streamed restore whose blocks are opened: [`StreamLoad::run`] reads their layers.
pub struct StreamLoad {
    pub(super) tiers: Arc<KvTiers>,
    pub(super) sources: Vec<Source>,
    pub(super) stream: Arc<RestoreStream>,
    /// Test-only (`faults.tier_stream_hold`): the last layer lands only once a rank took an
    /// earlier one (or at the deadline), which proves compute starts before it arrives.
    pub(super) hold_last: bool,
}

impl StreamLoad {
    /// The stream the ranks read (empty when no block could be opened).
    pub fn stream(&self) -> &Arc<RestoreStream> {
        &self.stream
    }

    /// The stored hit counts of the blocks, in order.
    pub fn hits(&self) -> Vec<u32> {
        self.sources.iter().map(Source::hits).collect()
    }

    /// Reads every layer of every block in layer order, publishing each as it lands, then
    /// verifies each file's checksum over what was read (a mismatch or a failed read is a
    /// miss: counted, logged, the file discarded, the stream failed). Blocking: run it off
    /// the async threads. Stops early once the stream failed (the Scheduler gave it up).
    ///
    /// `admit` (the request may start computing) is called once, as soon as the layers
    /// still to read would take no longer than `budget` at the pace so far — the time the
    /// request's step is expected to compute before it reaches its last layer — so a slow
    /// store never leaves a step waiting on it for long: with a fast store that is right
    /// after the first layer; with one slower than the compute, the request waits for most
    /// of its load before it is admitted, as a whole load would. At the latest it is called
    /// once every layer landed, or when the stream failed (the Scheduler then goes on
    /// without the tiers).
    pub fn run(self, budget: std::time::Duration, admit: impl FnOnce()) {
        let mut admit = Some(admit);
        let mut admit_now = || {
            if let Some(f) = admit.take() {
                f();
            }
        };
        self.read(budget, &mut admit_now);
        admit_now();
    }

    fn read(self, budget: std::time::Duration, admit: &mut dyn FnMut()) {
        let StreamLoad {
            tiers,
            sources,
            stream,
            hold_last,
        } = self;
        let (tp, lb, rb) = (stream.tp, stream.layer_bytes, tiers.shape.rank_bytes());
        let started = Instant::now();
        // Layers are read in groups (a few reads per file rather than one per layer: small
        // reads cost more than their bytes on a slow disk) and published one by one.
        let group = stream.layers.div_ceil(READS_PER_FILE).max(1);
        let mut layer = 0;
        while layer < stream.layers {
            if stream.verdict().is_some() {
                return;
            }
            if layer > 0 {
                // Admit once the rest would land within the step's compute at this pace.
                let pace = started.elapsed() / layer as u32;
                if pace * (stream.layers - layer) as u32 <= budget {
                    admit();
                }
            }
            let end = (layer + group).min(stream.layers);
            if hold_last && end == stream.layers && layer > 0 {
                admit();
                // Dropped at once: only the wait matters (a timeout fails the stream).
                drop(stream.wait(|p| p.early > 0));
            }
            let n = end - layer;
            let mut layers: Vec<Vec<u8>> = vec![vec![0u8; sources.len() * tp * lb]; n];
            let mut chunk = vec![0u8; n * lb];
            for (i, src) in sources.iter().enumerate() {
                for r in 0..tp {
                    let from = r * rb + layer * lb;
                    match src {
                        Source::Whole(b) => chunk.copy_from_slice(&b.bytes[from..from + n * lb]),
                        Source::File { hash, shared, file } => {
                            let off = file.payload_at + from as u64;
                            if let Err(e) = file.file.read_exact_at(&mut chunk, off) {
                                tiers.stream_miss(*hash, *shared, &e.into());
                                return stream.fail(StreamFailure::Miss);
                            }
                        }
                    }
                    // A rank's layers are contiguous in its share: scatter them by layer.
                    let at = (i * tp + r) * lb;
                    for (k, dst) in layers.iter_mut().enumerate() {
                        dst[at..at + lb].copy_from_slice(&chunk[k * lb..(k + 1) * lb]);
                    }
                }
            }
            for (k, bytes) in layers.into_iter().enumerate() {
                stream.land(layer + k, bytes);
            }
            layer = end;
        }
        admit();
        // Every layer landed: verify each file over the bytes read, in file order.
        for (i, src) in sources.iter().enumerate() {
            let Source::File { hash, shared, file } = src else {
                continue;
            };
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            h.update(&file.header);
            for r in 0..tp {
                for layer in 0..stream.layers {
                    let Some(data) = stream.data[layer].get() else {
                        return stream.fail(StreamFailure::Layout);
                    };
                    let at = (i * tp + r) * lb;
                    h.update(&data[at..at + lb]);
                }
            }
            if h.digest() != file.sum {
                tiers.stream_miss(*hash, *shared, &TierError::Checksum);
                return stream.fail(StreamFailure::Miss);
            }
        }
        for src in &sources {
            if let Source::File { hash, shared, .. } = src {
                tiers.stream_hit(*hash, *shared);
            }
        }
        stream.verified();
    }
}

impl KvTiers {
    /// The disk-backed store a streamed file came from.
    fn file_store(&self, shared: bool) -> Option<&super::DiskTier> {
        if shared {
            self.shared.as_ref().and_then(super::SharedStore::as_dir)
        } else {
            self.disk.as_ref()
        }
    }

    /// A streamed file verified: counted as a hit, most recently used now.
    fn stream_hit(&self, h: BlockHash, shared: bool) {
        if let Some(d) = self.file_store(shared) {
            d.touched(h);
            d.counters().hit(d.tier(), self.shape.payload_bytes);
        }
    }

    /// A streamed file failed: a miss, counted, logged, the file discarded.
    fn stream_miss(&self, h: BlockHash, shared: bool, e: &TierError) {
        if let Some(d) = self.file_store(shared) {
            d.counters().miss(BlockStore::tier(d), h, e);
            BlockStore::discard(d, h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_layer_is_taken_only_once_it_landed_and_a_late_one_times_out() {
        let s = RestoreStream::new(1, 2, 1, 4, Instant::now() + Duration::from_millis(50));
        s.land(0, vec![1; 4]);
        assert_eq!(s.wait(|p| p.landed > 0).map(|p| p.landed), Some(1));
        // Layer 1 never lands: the wait ends at the deadline and fails the stream.
        assert!(s.wait(|p| p.landed > 1).is_none());
        assert_eq!(s.verdict(), Some(Err(StreamFailure::Timeout)));
    }

    #[test]
    fn layers_land_in_order_and_a_failure_stays() {
        let s = RestoreStream::new(2, 2, 1, 4, Instant::now() + Duration::from_secs(5));
        s.land(1, vec![0; 8]);
        assert_eq!(s.progress().landed, 0, "layer 1 before layer 0 is ignored");
        s.land(0, vec![0; 7]);
        assert_eq!(
            s.verdict(),
            Some(Err(StreamFailure::Layout)),
            "a short layer fails"
        );
        s.verified();
        assert_eq!(s.verdict(), Some(Err(StreamFailure::Layout)));
    }
}
