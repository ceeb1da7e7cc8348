//! The scheduler's logic, free of actors and I/O: queues, block accounting, continuous
//! batching with chunked prefill under a token budget, preemption by recompute, sampling and
//! stop conditions. The [`Scheduler`](super::Scheduler) actor feeds it messages.

use crate::block_manager::{extend_hashes, BlockAllocation, BlockHash, BlockManager};
use crate::error::RequestError;
use pdserve_gpu::generation::{Generation, TokenOutcome};
use pdserve_gpu::grammar::Constraint;
use pdserve_gpu::model::{Batch, EmbedSpan, SeqChunk};
use pdserve_gpu::sampling::{FinishReason, SamplingParams, TokenLogprobs};
use pdserve_gpu::tokenizer::Tokenizer;
use pdserve_gpu::vision::ImageEmbeds;
use pdserve_runtime::ids::{RequestId, TransferId};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most prompt tokens one step computes for a request that wants prompt logprobs: each of
/// them returns a full-vocabulary logits row (128 × a 152k vocabulary is 78 MB).
pub const PROMPT_LOGPROBS_CHUNK: usize = 128;

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens in one forward step.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Blocks kept free when admitting new sequences.
    pub watermark_blocks: usize,
    /// Longest sequence (prompt + output).
    pub max_model_len: usize,
    /// How long a prefill instance keeps a finished request's blocks for a decode instance to
    /// read, unless released or renewed first.
    pub kv_lease: Duration,
    /// Keep computed full blocks in a prefix cache and reuse them (`--no-prefix-cache` turns
    /// it off).
    pub prefix_cache: bool,
    /// Salt of the block hashes: the instance's compatibility key hashed (model, KV dtype,
    /// layout, block size), so instances with different KV layouts never match.
    pub cache_salt: u64,
    /// Decode side of P/D: a request whose uncached prompt suffix is shorter than this is
    /// prefilled here instead of remotely (`transfer.min_remote_prompt_tokens`). A request
    /// whose whole prompt is cached (all but the last partial block) always is.
    pub min_remote_prompt_tokens: usize,
}

/// A request entering the scheduler.
#[derive(Clone, Debug)]
pub struct NewRequest {
    /// Its id.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling and stop settings (`max_tokens` already resolved).
    pub params: SamplingParams,
    /// Prefill side of P/D: keep the prompt's blocks after finishing, under a lease, for a
    /// decode instance to read (`kv_transfer_params.do_remote_decode`).
    pub hold_for: Option<TransferId>,
    /// Push mode of P/D: the KvSender writes each chunk's KV to a decode instance as the
    /// forward pass computes it (see [`SchedulerCore::push_chunks`]). Needs `hold_for`.
    pub push: bool,
    /// Tokens an earlier attempt of this request already generated (request migration): the
    /// request is computed over prompt + these and continues after them (see
    /// [`Generation::resume`]); empty for a new request.
    pub resume: Vec<u32>,
    /// The request's grammar, compiled off the Scheduler (by the HTTP handler, or the peer
    /// service through [`SchedulerHandle::with_tokenizer`](super::SchedulerHandle::with_tokenizer));
    /// `None` with [`SamplingParams::grammar`] set compiles it here, on the Scheduler's task.
    pub constraint: Option<Constraint>,
    /// The prompt's images (vision-language models), in prompt order: each one's rows
    /// replace the placeholder tokens it covers. Empty for text.
    pub images: Vec<PromptImage>,
}

/// One image of a prompt: its embeddings' rows replace the prompt's tokens
/// `at .. at + embeds.rows` (one position per row).
///
/// In the prefix cache those positions count as the image's [`ImageDigest`] words
/// ([`image_key_token`]), not as the placeholder tokens, so two prompts that differ only in
/// their images never share the KV of the blocks the images touch, nor of any block after.
///
/// [`ImageDigest`]: pdserve_gpu::vision::ImageDigest
#[derive(Clone, Debug)]
pub struct PromptImage {
    /// Prompt position of the image's first row.
    pub at: usize,
    /// The image's rows (and digest).
    pub embeds: Arc<ImageEmbeds>,
}

/// What the prefix cache's key holds at row `k` of an image with `digest` instead of the
/// placeholder token: one of the digest's eight 32-bit words, top bit set. Token ids are below
/// 2³¹, so no text prompt can present the key of an image's block; and each block of an
/// image's rows compares its own slice of the digest on a hit, on top of the chained hash.
pub fn image_key_token(digest: &pdserve_gpu::vision::ImageDigest, k: usize) -> u32 {
    digest.words()[k % 8] | 0x8000_0000
}

/// Tokens as the prefix cache (and the KV tiers below it) key them: the rows of `images`
/// as their image's digest words ([`image_key_token`]), every other token as itself. Two
/// prompts whose placeholder tokens agree but whose images differ never share a key.
pub fn key_tokens(mut tokens: Vec<u32>, images: &[PromptImage]) -> Vec<u32> {
    for img in images {
        for k in 0..img.embeds.rows {
            match tokens.get_mut(img.at + k) {
                Some(t) => *t = image_key_token(&img.embeds.digest, k),
                None => break,
            }
        }
    }
    tokens
}

/// What the scheduler tells a request's owner.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// A new token and the text it completed (possibly empty).
    Token {
        /// Request.
        id: RequestId,
        /// Token id.
        token: u32,
        /// Text that became final with it.
        text: String,
        /// Its logprobs, when the request asked ([`SamplingParams::logprobs`]).
        logprobs: Option<TokenLogprobs>,
    },
    /// The prompt's logprobs, once the whole prompt was computed (before the first token),
    /// when the request asked ([`SamplingParams::prompt_logprobs`]): entry `i` is prompt
    /// token `i + 1`'s (the first token has none).
    PromptLogprobs {
        /// Request.
        id: RequestId,
        /// One per prompt token after the first.
        logprobs: Vec<TokenLogprobs>,
    },
    /// The request finished normally.
    Finished {
        /// Request.
        id: RequestId,
        /// Why.
        reason: FinishReason,
        /// Text released at the end (held back for a stop string that did not complete).
        text: String,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
        /// Prompt tokens taken from the prefix cache at the request's first admission.
        cached_tokens: usize,
        /// Blocks kept for a decode instance (see [`NewRequest::hold_for`]).
        held_blocks: Option<Vec<u32>>,
    },
    /// The request failed.
    Failed {
        /// Request.
        id: RequestId,
        /// Why.
        error: RequestError,
    },
}

/// Queue and pool figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SchedulerStats {
    /// Requests waiting (new or preempted).
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// Free KV blocks.
    pub blocks_free: usize,
    /// All KV blocks.
    pub blocks_total: usize,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Hand-offs whose blocks are held for a decode instance to read (prefill, pull mode).
    pub held: usize,
    /// Blocks held by requests or hand-offs (`blocks_total - blocks_free`).
    pub blocks_in_use: usize,
    /// Cached blocks nobody holds (counted in `blocks_free`: evicted when space is needed).
    pub blocks_cached: usize,
    /// Cached blocks evicted so far.
    pub cache_evictions: u64,
    /// Prompt tokens of admitted requests (each counted once, at first admission).
    pub prompt_tokens: u64,
    /// Of those, tokens served from the prefix cache (not computed, not transferred).
    pub prompt_tokens_cached: u64,
    /// Decode side: requests prefilled here rather than remotely because their uncached
    /// suffix was short (prefix-aware conditional disaggregation).
    pub local_prefills: u64,
}

/// One planned forward step.
#[derive(Debug)]
pub struct StepPlan {
    /// Monotonic id.
    pub step_id: u64,
    /// The batch for the workers.
    pub batch: Batch,
    /// `(request, tokens in this step, samples a token)` in batch order.
    pub members: Vec<(RequestId, usize, bool)>,
    /// Members whose prefix is being restored from the KV tiers layer by layer, with the
    /// pool blocks the restore writes: the step must carry their streams (the actor's
    /// `KvFeed`) and each must be settled ([`SchedulerCore::restore_settled`]) before
    /// [`SchedulerCore::complete`].
    pub restores: Vec<(RequestId, Vec<u32>)>,
}

/// Where a request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestState {
    /// Queued (new, or preempted and to be recomputed).
    Waiting,
    /// Scheduled: prefilling in chunks or decoding.
    Running,
    /// Decode side of P/D: destination blocks are allocated, the prompt's KV is expected from
    /// a prefill instance; not scheduled until it arrives.
    WaitingForRemoteKv,
    /// Decode side of P/D: KV bytes are landing in the blocks.
    Transferring,
}

struct Seq {
    hold_for: Option<TransferId>,
    push: bool,
    state: RequestState,
    prompt: Vec<u32>,
    gen: Generation,
    blocks: BlockAllocation,
    computed: usize,
    /// Chained hashes of the sequence's full blocks computed so far (extended lazily).
    hashes: Vec<BlockHash>,
    /// Leading blocks registered in (or taken from) the prefix cache.
    registered: usize,
    /// Tokens taken from the prefix cache at the last admission.
    cached_tokens: usize,
    /// Decode side: leading blocks of the prompt this instance already had (push: the
    /// prefill side writes only the others).
    skip_blocks: usize,
    /// Counted in the prompt figures.
    counted: bool,
    /// Prompt tokens taken from the prefix cache when it was counted (its first admission).
    prompt_cached: usize,
    /// Prompt logprobs computed so far (entry `i`: prompt token `i + 1`), while the request
    /// wants them and they were not sent yet.
    prompt_lp: Option<Vec<TokenLogprobs>>,
    /// The prompt's images, in prompt order (vision-language models).
    images: Vec<PromptImage>,
    /// A prefix being restored from the KV tiers layer by layer (until settled).
    restore: Option<Restore>,
}

/// Blocks `first .. first + hits.len()` of a sequence hold a prefix whose KV a streamed KV
/// tier restore writes during its first step; registered once verified.
#[derive(Debug)]
struct Restore {
    first: usize,
    /// Each restored block's prefix-cache hits (kept for the tiers' `selective` policy).
    hits: Vec<u32>,
}

impl Seq {
    /// Back to waiting with nothing computed: its blocks (an unsettled restore's with them)
    /// return to the pool, to be recomputed from its tokens.
    fn start_over(&mut self) {
        self.restore = None;
        self.blocks.release();
        self.computed = 0;
        self.registered = 0;
        self.cached_tokens = 0;
        self.state = RequestState::Waiting;
    }

    fn len(&self) -> usize {
        self.prompt.len() + self.gen.output().len()
    }

    /// Hashes of the first `n` full blocks of the sequence (fewer when it has fewer).
    fn hashes_upto(&mut self, salt: u64, bs: usize, n: usize) -> &[BlockHash] {
        if self.hashes.len() < n {
            let tokens = self.key_tokens(n * bs);
            extend_hashes(salt, &mut self.hashes, &tokens, bs);
        }
        &self.hashes[..n.min(self.hashes.len())]
    }

    /// The first `n` tokens as the prefix cache keys them ([`key_tokens`]).
    fn key_tokens(&self, n: usize) -> Vec<u32> {
        key_tokens(self.tokens(n), &self.images)
    }

    /// The image rows a chunk of the prompt at positions `start .. start + n` replaces.
    fn embeds(&self, start: usize, n: usize) -> Vec<EmbedSpan> {
        let end = start + n;
        self.images
            .iter()
            .filter_map(|img| {
                let (lo, hi) = (img.at.max(start), (img.at + img.embeds.rows).min(end));
                (lo < hi).then(|| EmbedSpan {
                    at: lo - start,
                    image: img.embeds.clone(),
                    from: lo - img.at,
                    len: hi - lo,
                })
            })
            .collect()
    }

    /// Records the prompt logprobs of a chunk computed from `start` whose logits rows are
    /// `rows` (the sampling row already taken off); returns them all once the prompt is
    /// complete (they are sent once: a recompute after a preemption computes none).
    fn prompt_logprobs(&mut self, start: usize, rows: &[Vec<f32>]) -> Option<Vec<TokenLogprobs>> {
        let top = self.gen.params().prompt_logprobs? as usize;
        let acc = self.prompt_lp.as_mut()?;
        // A recompute (preemption) starts over from `start`.
        acc.truncate(start);
        if acc.len() != start {
            return None;
        }
        for (i, row) in rows.iter().enumerate() {
            match self.prompt.get(start + i + 1) {
                Some(&next) => acc.push(TokenLogprobs::compute(row, next, top)),
                None => break,
            }
        }
        (acc.len() + 1 >= self.prompt.len()).then(|| self.prompt_lp.take().unwrap_or_default())
    }

    /// Tokens the next step computes for this sequence within `budget`: the rest, capped at
    /// [`PROMPT_LOGPROBS_CHUNK`] while its prompt's logits are returned.
    fn next_chunk(&self, budget: usize) -> usize {
        let n = (self.len() - self.computed).min(budget);
        if self.prompt_lp.is_some() && self.computed < self.prompt.len() {
            n.min(PROMPT_LOGPROBS_CHUNK)
        } else {
            n
        }
    }

    fn tokens(&self, n: usize) -> Vec<u32> {
        self.prompt
            .iter()
            .chain(self.gen.output())
            .take(n)
            .copied()
            .collect()
    }
}

/// Where a decode-side request's prompt KV comes from ([`SchedulerCore::add_remote`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteAdmission {
    /// From the prefill instance into `blocks`; the first `cached_blocks` of them were
    /// already here (prefix cache): only the others move.
    Remote {
        /// Destination blocks, the whole prompt's.
        blocks: Vec<u32>,
        /// Leading blocks taken from the prefix cache.
        cached_blocks: usize,
    },
    /// Prefilled here: the prefix cache holds all but a suffix shorter than the threshold.
    Local {
        /// Leading blocks taken from the prefix cache.
        cached_blocks: usize,
    },
}

/// The scheduler state machine.
pub struct SchedulerCore {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    tokenizer: Tokenizer,
    seqs: HashMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    next_step: u64,
    preemptions: u64,
    held: HashMap<TransferId, (BlockAllocation, Instant)>,
    prompt_tokens: u64,
    prompt_tokens_cached: u64,
    local_prefills: u64,
}

impl SchedulerCore {
    /// An idle scheduler over a fresh block pool.
    pub fn new(cfg: SchedulerConfig, tokenizer: Tokenizer) -> Self {
        let blocks =
            BlockManager::with_cache(cfg.num_blocks, cfg.watermark_blocks, cfg.prefix_cache);
        Self {
            cfg,
            blocks,
            tokenizer,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_step: 0,
            preemptions: 0,
            held: HashMap::new(),
            prompt_tokens: 0,
            prompt_tokens_cached: 0,
            local_prefills: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queue and pool figures.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            blocks_free: self.blocks.num_free(),
            blocks_total: self.blocks.total(),
            preemptions: self.preemptions,
            held: self.held.len(),
            blocks_in_use: self.blocks.num_in_use(),
            blocks_cached: self.blocks.cache_figures().cached_blocks,
            cache_evictions: self.blocks.cache_figures().evictions,
            prompt_tokens: self.prompt_tokens,
            prompt_tokens_cached: self.prompt_tokens_cached,
            local_prefills: self.local_prefills,
        }
    }

    /// The block pool (tests and figures).
    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    /// Takes the longest cached prefix of a waiting request with no blocks: all but at least
    /// its last token (whose logits must be computed), in whole blocks. Returns the blocks
    /// taken.
    fn take_cached_prefix(&mut self, id: RequestId, keep_last: bool) -> usize {
        let (bs, salt) = (self.cfg.block_size, self.cfg.cache_salt);
        let Some(s) = self.seqs.get_mut(&id) else {
            return 0;
        };
        if !s.blocks.is_empty() || s.computed != 0 {
            return 0;
        }
        let len = s.len();
        let max = if keep_last { (len - 1) / bs } else { len / bs };
        // Prompt logprobs need every prompt token's logits: no cached prefix.
        let hit = if self.blocks.caching() && max > 0 && s.prompt_lp.is_none() {
            let tokens = s.key_tokens(max * bs);
            let hashes = s.hashes_upto(salt, bs, max).to_vec();
            self.blocks.take_prefix(&mut s.blocks, &hashes, &tokens, bs)
        } else {
            0
        };
        s.computed = hit * bs;
        s.cached_tokens = hit * bs;
        s.registered = hit;
        if !s.counted {
            s.counted = true;
            s.prompt_cached = (hit * bs).min(s.prompt.len());
            self.prompt_tokens += s.prompt.len() as u64;
            self.prompt_tokens_cached += s.prompt_cached as u64;
        }
        hit
    }

    /// Registers the request's full blocks whose KV is final (computed, or landed) in the
    /// prefix cache.
    fn register_computed(&mut self, id: RequestId) {
        let (bs, salt) = (self.cfg.block_size, self.cfg.cache_salt);
        if !self.blocks.caching() {
            return;
        }
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let full = (s.computed / bs).min(s.blocks.len());
        if full <= s.registered {
            return;
        }
        let tokens = s.key_tokens(full * bs);
        let hashes = s.hashes_upto(salt, bs, full).to_vec();
        self.blocks
            .register(&s.blocks, s.registered, &hashes, &tokens, bs);
        s.registered = full;
    }

    /// Whether any request is queued or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Accepts a request.
    ///
    /// # Errors
    /// [`RequestError::ContextOverflow`] when prompt plus `max_tokens` exceed the model's
    /// length; [`RequestError::BadRequest`] for an empty prompt, a duplicate id, or a request
    /// the whole pool could never hold.
    pub fn add(&mut self, req: NewRequest) -> Result<(), RequestError> {
        if req.prompt.is_empty() {
            return Err(RequestError::BadRequest("the prompt is empty".into()));
        }
        // Saturating: a remote `max_tokens` near usize::MAX must not wrap past the check.
        let total = req.prompt.len().saturating_add(req.params.max_tokens);
        if total > self.cfg.max_model_len {
            return Err(RequestError::ContextOverflow {
                max: self.cfg.max_model_len,
                requested: total,
                prompt: req.prompt.len(),
                completion: req.params.max_tokens,
            });
        }
        if total.div_ceil(self.cfg.block_size) > self.blocks.total() {
            return Err(RequestError::BadRequest(format!(
                "{total} tokens need more KV blocks than this instance has ({})",
                self.blocks.total()
            )));
        }
        if self.seqs.contains_key(&req.id) {
            return Err(RequestError::BadRequest(format!(
                "duplicate request id {}",
                req.id
            )));
        }
        // Images in prompt order, inside the prompt, not overlapping.
        let mut next_free = 0;
        for (i, img) in req.images.iter().enumerate() {
            let end = img.at.checked_add(img.embeds.rows);
            if img.at < next_free || end.is_none_or(|e| e > req.prompt.len()) {
                return Err(RequestError::BadRequest(format!(
                    "image {i} (prompt positions {}..+{}) is out of order or outside the prompt of {} tokens",
                    img.at,
                    img.embeds.rows,
                    req.prompt.len()
                )));
            }
            next_free = img.at + img.embeds.rows;
        }
        let gen = Generation::constrained(&req.params, &self.tokenizer, req.constraint)
            .map_err(|e| RequestError::BadRequest(e.to_string()))?;
        let gen = if req.resume.is_empty() {
            gen
        } else {
            // A grammar advances over the resumed tokens too (request migration).
            Generation::resume_constrained(gen, &req.resume)
                .map_err(|e| RequestError::BadRequest(format!("resume_tokens: {e}")))?
        };
        let seq = Seq {
            hold_for: req.hold_for,
            push: req.push && req.hold_for.is_some(),
            state: RequestState::Waiting,
            gen,
            prompt: req.prompt,
            blocks: self.blocks.empty(),
            computed: 0,
            hashes: Vec::new(),
            registered: 0,
            cached_tokens: 0,
            skip_blocks: 0,
            prompt_cached: 0,
            counted: false,
            prompt_lp: req.params.prompt_logprobs.map(|_| Vec::new()),
            images: req.images,
            restore: None,
        };
        self.seqs.insert(req.id, seq);
        self.waiting.push_back(req.id);
        Ok(())
    }

    /// Accepts a request whose prompt prefix is in `prefix`: its first `first` blocks are
    /// cached pool blocks, the next `hits.len()` fresh blocks that a streamed KV tier restore
    /// writes during the request's first step (each with its stored hit count). Until the
    /// restore is settled ([`SchedulerCore::restore_settled`]) nothing registers those
    /// blocks, so no other request can take them.
    ///
    /// # Errors
    /// As [`SchedulerCore::add`], and [`RequestError::BadRequest`] when the prefix is not
    /// whole blocks of the prompt short of its last token.
    pub fn add_restored(
        &mut self,
        req: NewRequest,
        prefix: BlockAllocation,
        first: usize,
        hits: Vec<u32>,
    ) -> Result<(), RequestError> {
        let bs = self.cfg.block_size;
        let id = req.id;
        let blocks = first + hits.len();
        if prefix.len() != blocks || blocks * bs >= req.prompt.len() + req.resume.len() {
            return Err(RequestError::BadRequest(format!(
                "a restored prefix of {} blocks ({blocks} expected) does not fit a prompt of {} tokens",
                prefix.len(),
                req.prompt.len()
            )));
        }
        self.add(req)?;
        let s = self.seqs.get_mut(&id).expect("just added");
        s.blocks = prefix;
        s.computed = blocks * bs;
        s.cached_tokens = blocks * bs;
        s.registered = first;
        s.counted = true;
        s.prompt_cached = (blocks * bs).min(s.prompt.len());
        s.restore = Some(Restore { first, hits });
        self.prompt_tokens += s.prompt.len() as u64;
        self.prompt_tokens_cached += s.prompt_cached as u64;
        Ok(())
    }

    /// Settles the streamed restore of request `id` after the step that carried it: when
    /// `verified`, its blocks are registered in the prefix cache (then the step completes as
    /// usual); else the request starts over, without the restored prefix, and what the step
    /// computed for it is dropped by [`SchedulerCore::complete`]. Returns whether a restore
    /// was pending.
    pub fn restore_settled(&mut self, id: RequestId, verified: bool) -> bool {
        let (bs, salt) = (self.cfg.block_size, self.cfg.cache_salt);
        let Some(s) = self.seqs.get_mut(&id) else {
            return false;
        };
        let Some(r) = s.restore.take() else {
            return false;
        };
        let end = r.first + r.hits.len();
        if verified {
            let tokens = s.key_tokens(end * bs);
            let hashes = s.hashes_upto(salt, bs, end).to_vec();
            self.blocks
                .register_hits(&s.blocks, r.first, &hashes, &tokens, bs, &r.hits);
            s.registered = s.registered.max(end);
            return true;
        }
        // Counted again when it is admitted anew (its prompt is computed this time).
        self.prompt_tokens -= s.prompt.len() as u64;
        self.prompt_tokens_cached -= s.prompt_cached as u64;
        s.counted = false;
        s.start_over();
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.waiting.push_front(id);
        true
    }

    /// Whether request `id` waits for a streamed restore to be settled.
    pub fn restore_pending(&self, id: RequestId) -> bool {
        self.seqs.get(&id).is_some_and(|s| s.restore.is_some())
    }

    /// Accepts a request whose prompt KV will come from a prefill instance: the longest
    /// prefix of its prompt in the prefix cache is taken by reference, blocks for the rest are
    /// allocated now (the transfer's destination) and it waits in
    /// [`RequestState::WaitingForRemoteKv`]. With `may_prefill_here` (decode drives the
    /// hand-off), a request whose uncached suffix is shorter than
    /// [`SchedulerConfig::min_remote_prompt_tokens`], or whose whole prompt is cached, is
    /// queued to be prefilled here instead ([`RemoteAdmission::Local`]).
    ///
    /// At most all but the prompt's last token are taken from the cache, in whole blocks: at
    /// least one block always moves (the prefill side computes the last token's logits).
    ///
    /// # Errors
    /// As [`SchedulerCore::add`], plus [`RequestError::Overloaded`] when the pool cannot hold
    /// the prompt now (nothing is kept).
    pub fn add_remote(
        &mut self,
        req: NewRequest,
        may_prefill_here: bool,
    ) -> Result<RemoteAdmission, RequestError> {
        let id = req.id;
        let bs = self.cfg.block_size;
        let prompt_len = req.prompt.len();
        let blocks = prompt_len.div_ceil(bs);
        self.add(req)?;
        self.waiting.retain(|&w| w != id);
        let hit = self.take_cached_prefix(id, true);
        let suffix = prompt_len - hit * bs;
        let whole = hit > 0 && hit == (prompt_len - 1) / bs;
        if may_prefill_here && (whole || suffix < self.cfg.min_remote_prompt_tokens) {
            self.waiting.push_back(id);
            self.local_prefills += 1;
            return Ok(RemoteAdmission::Local { cached_blocks: hit });
        }
        let s = self.seqs.get_mut(&id).expect("just added");
        // The cached prefix is not computed here: the transfer lands after it.
        s.computed = 0;
        let need = blocks - hit;
        if !self.blocks.can_admit(need) || !self.blocks.grow(&mut s.blocks, need) {
            self.seqs.remove(&id);
            return Err(RequestError::Overloaded(
                "no KV blocks free for a remote prefill".into(),
            ));
        }
        s.skip_blocks = hit;
        s.state = RequestState::WaitingForRemoteKv;
        Ok(RemoteAdmission::Remote {
            blocks: s.blocks.blocks().to_vec(),
            cached_blocks: hit,
        })
    }

    /// The transfer into a remote request's blocks has started.
    ///
    /// # Errors
    /// [`RequestError::BadRequest`] when the request is not waiting for remote KV.
    pub fn remote_kv_transferring(&mut self, id: RequestId) -> Result<(), RequestError> {
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or_else(|| RequestError::BadRequest(format!("unknown request {id}")))?;
        if s.state != RequestState::WaitingForRemoteKv {
            return Err(RequestError::BadRequest(format!(
                "{id} is {:?}, not waiting for remote KV",
                s.state
            )));
        }
        s.state = RequestState::Transferring;
        Ok(())
    }

    /// The prompt's KV is in place and the prefill side sampled `first_token` (with its
    /// logprobs, when the request asked for them): the request joins the running set and
    /// decodes from there, without recomputing the prompt. `prefill_cached` is how many
    /// leading prompt tokens the prefill instance took from its own prefix cache: the
    /// request's cached tokens are the larger of that and this instance's reuse (both count
    /// from the prompt's start; a prefix reused on both sides is counted once).
    ///
    /// # Errors
    /// [`RequestError::BadRequest`] when the request is not waiting for or receiving remote KV.
    pub fn remote_kv_ready(
        &mut self,
        id: RequestId,
        first_token: u32,
        first_logprobs: Option<TokenLogprobs>,
        prefill_cached: usize,
        now: Instant,
    ) -> Result<Vec<Output>, RequestError> {
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or_else(|| RequestError::BadRequest(format!("unknown request {id}")))?;
        if !matches!(
            s.state,
            RequestState::WaitingForRemoteKv | RequestState::Transferring
        ) {
            return Err(RequestError::BadRequest(format!(
                "{id} is {:?}, not expecting remote KV",
                s.state
            )));
        }
        s.computed = s.prompt.len();
        s.prompt_cached = s
            .prompt_cached
            .max(prefill_cached.min(s.prompt.len().saturating_sub(1)));
        s.state = RequestState::Running;
        // The prefill instance drew the first token's random number from the same seeded
        // stream: skip it here, so seeded sampling gives what one instance would (and a
        // request migrated elsewhere continues it exactly).
        s.gen.skip_samples(1);
        self.running.push(id);
        // The landed KV is final: later requests may share its full blocks.
        self.register_computed(id);
        Ok(self.accept_token(id, first_token, first_logprobs, now))
    }

    /// A decode instance read the blocks held for `transfer`: free them. Returns whether
    /// they were still held — `false` means the lease had expired (or never existed) and the
    /// blocks may have been reused, so the reader must not trust what it read.
    pub fn release_held(&mut self, transfer: TransferId) -> bool {
        self.held.remove(&transfer).is_some()
    }

    /// The blocks held for `transfer`, while its lease lives.
    pub fn held_blocks(&self, transfer: TransferId) -> Option<Vec<u32>> {
        self.held.get(&transfer).map(|(b, _)| b.blocks().to_vec())
    }

    /// Extends the lease on held blocks; `false` when they are no longer held.
    pub fn renew_held(&mut self, transfer: TransferId, now: Instant) -> bool {
        match self.held.get_mut(&transfer) {
            Some((_, deadline)) => {
                *deadline = now + self.cfg.kv_lease;
                true
            }
            None => false,
        }
    }

    /// Frees held blocks whose lease ran out; returns how many hand-offs expired.
    pub fn expire_held(&mut self, now: Instant) -> usize {
        let before = self.held.len();
        self.held.retain(|transfer, (_, deadline)| {
            let keep = *deadline > now;
            if !keep {
                tracing::warn!(%transfer, "KV lease expired before the decode side released it: blocks freed");
            }
            keep
        });
        before - self.held.len()
    }

    /// Renews the leases of several hand-offs at once; returns those no longer held.
    pub fn renew_many(&mut self, transfers: &[TransferId], now: Instant) -> Vec<TransferId> {
        transfers
            .iter()
            .copied()
            .filter(|&t| !self.renew_held(t, now))
            .collect()
    }

    /// The request working for hand-off `transfer` (prefill side), if it is still running.
    pub fn request_of(&self, transfer: TransferId) -> Option<RequestId> {
        self.seqs
            .iter()
            .find(|(_, s)| s.hold_for == Some(transfer))
            .map(|(&id, _)| id)
    }

    /// The prompt chunks of pushed requests that `plan` computes: `(transfer, a share of the
    /// request's blocks, first position, one past the last)`. Call before [`Self::complete`].
    pub fn push_chunks(&self, plan: &StepPlan) -> Vec<(TransferId, BlockAllocation, usize, usize)> {
        plan.members
            .iter()
            .filter_map(|&(id, n, _)| {
                let s = self.seqs.get(&id)?;
                let transfer = s.hold_for.filter(|_| s.push)?;
                let end = (s.computed + n).min(s.prompt.len());
                // The first chunk after a prefix-cache hit also carries the cached blocks
                // (the decode side may lack them; the writer skips those it has).
                let start = if s.computed == s.cached_tokens {
                    0
                } else {
                    s.computed
                };
                (s.computed < end).then(|| (transfer, s.blocks.share(), start, end))
            })
            .collect()
    }

    /// Requests whose prompt KV is arriving from a prefill instance.
    pub fn receiving(&self) -> Vec<RequestId> {
        self.seqs
            .iter()
            .filter(|(_, s)| {
                matches!(
                    s.state,
                    RequestState::WaitingForRemoteKv | RequestState::Transferring
                )
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// A TP worker restarted with a fresh KV cache: every computed KV is gone. Running
    /// requests go back to the waiting queue to be recomputed from their tokens (as after a
    /// preemption, keeping their order); blocks held for decode instances are dropped (a late
    /// release then fails loudly). Requests receiving KV are the caller's to fail.
    pub fn cache_lost(&mut self) {
        for id in self.running.clone().into_iter().rev() {
            self.preempt(id);
        }
        // Cached blocks name KV that is gone; blocks taken from it by waiting requests too.
        self.blocks.clear_cache();
        for s in self.seqs.values_mut() {
            if s.state == RequestState::Waiting {
                s.start_over();
            }
        }
        let dropped = self.held.len();
        self.held.clear();
        if dropped > 0 {
            tracing::warn!(
                dropped,
                "KV held for decode instances was lost with a worker restart"
            );
        }
    }

    /// Hand-offs currently held.
    pub fn num_held(&self) -> usize {
        self.held.len()
    }

    /// A second holder of a request's blocks (the KV receiver keeps the destination blocks
    /// until its reads finished, even if the request is aborted meanwhile).
    pub fn share_blocks(&self, id: RequestId) -> Option<BlockAllocation> {
        self.seqs.get(&id).map(|s| s.blocks.share())
    }

    /// The state of a request.
    pub fn state(&self, id: RequestId) -> Option<RequestState> {
        self.seqs.get(&id).map(|s| s.state)
    }

    /// Drops a request wherever it is; its blocks return to the pool. Returns whether it
    /// existed.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        self.seqs.remove(&id).is_some()
    }

    fn preempt(&mut self, id: RequestId) {
        self.running.retain(|&r| r != id);
        if let Some(s) = self.seqs.get_mut(&id) {
            s.start_over();
        }
        self.waiting.push_front(id);
        self.preemptions += 1;
    }

    /// Plans the next step: running sequences first (a decode token or the next prefill
    /// chunk), then admissions from the waiting queue, within the token budget. When a running
    /// sequence needs a block and none is free, the newest running sequence is preempted (its
    /// blocks freed; it is recomputed from its tokens later).
    pub fn schedule(&mut self) -> Option<StepPlan> {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens.max(1);
        let mut plan: Vec<(RequestId, usize)> = Vec::new();

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let s = &self.seqs[&id];
            let n = s.next_chunk(budget);
            let need = (s.computed + n).div_ceil(bs).saturating_sub(s.blocks.len());
            let mut ok = need == 0 || self.grow(id, need);
            while !ok {
                // Preempt the newest other running sequence not yet in this step's plan.
                let victim = self
                    .running
                    .iter()
                    .rev()
                    .copied()
                    .find(|&r| r != id && !plan.iter().any(|(p, _)| *p == r));
                match victim {
                    Some(v) => {
                        self.preempt(v);
                        ok = self.grow(id, need);
                    }
                    None => break,
                }
            }
            if !ok {
                // Nothing left to take from: this one waits for blocks itself.
                self.preempt(id);
                continue;
            }
            plan.push((id, n));
            budget -= n;
            i += 1;
        }

        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let hit = self.take_cached_prefix(id, true);
            let s = &self.seqs[&id];
            let n = s.next_chunk(budget);
            let need = (s.computed + n).div_ceil(bs).saturating_sub(s.blocks.len());
            if !self.blocks.can_admit(need) || !self.grow(id, need) {
                if hit > 0 {
                    // Not admitted: give the prefix back (it stays cached).
                    let s = self.seqs.get_mut(&id).expect("queued");
                    s.blocks.release();
                    s.computed = 0;
                    s.registered = 0;
                    s.cached_tokens = 0;
                }
                break;
            }
            self.waiting.pop_front();
            self.running.push(id);
            if let Some(s) = self.seqs.get_mut(&id) {
                s.state = RequestState::Running;
            }
            plan.push((id, n));
            budget -= n;
        }

        if plan.is_empty() {
            return None;
        }
        let mut batch = Batch::default();
        let mut members = Vec::with_capacity(plan.len());
        let mut restores = Vec::new();
        for (id, n) in plan {
            let s = &self.seqs[&id];
            if let Some(r) = &s.restore {
                let end = r.first + r.hits.len();
                restores.push((id, s.blocks.blocks()[r.first..end].to_vec()));
            }
            let all_logits = s.prompt_lp.is_some() && s.computed < s.prompt.len();
            let tokens: Vec<u32> = s
                .prompt
                .iter()
                .chain(s.gen.output())
                .skip(s.computed)
                .take(n)
                .copied()
                .collect();
            let samples = s.computed + n == s.len();
            batch.seqs.push(SeqChunk {
                tokens,
                start_pos: s.computed,
                block_table: s.blocks.blocks().to_vec(),
                want_logits: samples,
                all_logits,
                embeds: s.embeds(s.computed, n),
            });
            members.push((id, n, samples));
        }
        self.next_step += 1;
        Some(StepPlan {
            step_id: self.next_step,
            batch,
            members,
            restores,
        })
    }

    fn grow(&mut self, id: RequestId, n: usize) -> bool {
        let s = self.seqs.get_mut(&id).expect("scheduled sequence exists");
        self.blocks.grow(&mut s.blocks, n)
    }

    /// Applies a finished step at `now`: advances positions, samples, checks stops (a finished
    /// request whose blocks are held for a transfer gets its lease from `now`). Requests
    /// aborted while the step ran are skipped.
    pub fn complete(&mut self, plan: StepPlan, logits: Vec<Vec<f32>>, now: Instant) -> Vec<Output> {
        let mut out = Vec::new();
        let mut logits = logits.into_iter();
        for ((id, n, samples), chunk) in plan.members.into_iter().zip(&plan.batch.seqs) {
            let mut rows: Vec<Vec<f32>> = logits.by_ref().take(chunk.logit_rows().len()).collect();
            let row = if samples { rows.pop() } else { None };
            let Some(s) = self.seqs.get_mut(&id) else {
                continue;
            };
            if s.state != RequestState::Running || s.computed + n > s.len() {
                continue; // preempted (or its restore failed) meanwhile: stale
            }
            if chunk.all_logits {
                if let Some(done) = s.prompt_logprobs(chunk.start_pos, &rows) {
                    out.push(Output::PromptLogprobs { id, logprobs: done });
                }
            }
            s.computed += n;
            self.register_computed(id);
            let Some(s) = self.seqs.get_mut(&id) else {
                continue;
            };
            if !samples {
                continue;
            }
            let Some(mut row) = row else {
                out.push(Output::Failed {
                    id,
                    error: RequestError::Internal("missing logits".into()),
                });
                self.abort(id);
                continue;
            };
            match s.gen.sample_with_logprobs(&mut row, &s.prompt) {
                Ok((token, logprobs)) => out.extend(self.accept_token(id, token, logprobs, now)),
                Err(e) => {
                    out.push(Output::Failed {
                        id,
                        error: RequestError::Internal(e.to_string()),
                    });
                    self.abort(id);
                }
            }
        }
        out
    }

    /// Computes the grammar masks the sequences of `plan` need for the tokens it samples,
    /// where not ready yet: the actor calls it after sending the step to the workers, so the
    /// masks are computed while the forward pass runs and sampling only applies them. A
    /// grammar that fails here fails its request in [`SchedulerCore::complete`].
    pub fn prepare_masks(&mut self, plan: &StepPlan) {
        for (id, _, samples) in &plan.members {
            if let (true, Some(s)) = (*samples, self.seqs.get_mut(id)) {
                // An error is kept for `complete`, which reports it with the request.
                let _ = s.gen.prepare_mask();
            }
        }
    }

    /// Appends a sampled token to a running request and applies its stop conditions at `now`.
    fn accept_token(
        &mut self,
        id: RequestId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        now: Instant,
    ) -> Vec<Output> {
        let Some(s) = self.seqs.get_mut(&id) else {
            return Vec::new();
        };
        match s.gen.accept(token) {
            Err(e) => {
                self.abort(id);
                vec![Output::Failed {
                    id,
                    error: RequestError::Internal(e.to_string()),
                }]
            }
            Ok(TokenOutcome::Continue { text }) => vec![Output::Token {
                id,
                token,
                text,
                logprobs,
            }],
            Ok(TokenOutcome::Finished { reason, text }) => {
                let (prompt_tokens, completion_tokens, cached_tokens) =
                    (s.prompt.len(), s.gen.output().len(), s.prompt_cached);
                let held_blocks = s.hold_for.map(|transfer| {
                    let blocks = std::mem::replace(&mut s.blocks, self.blocks.empty());
                    let ids = blocks.blocks().to_vec();
                    self.held
                        .insert(transfer, (blocks, now + self.cfg.kv_lease));
                    ids
                });
                self.abort(id);
                vec![
                    Output::Token {
                        id,
                        token,
                        text: String::new(),
                        logprobs,
                    },
                    Output::Finished {
                        id,
                        reason,
                        text,
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                        held_blocks,
                    },
                ]
            }
        }
    }

    /// A step failed on a worker: every request in it fails with `error` and frees its
    /// blocks.
    pub fn fail_step(&mut self, plan: StepPlan, error: RequestError) -> Vec<Output> {
        let mut out = Vec::new();
        for (id, _, _) in plan.members {
            if self.abort(id) {
                out.push(Output::Failed {
                    id,
                    error: error.clone(),
                });
            }
        }
        out
    }

    /// Fails everything (shutdown).
    pub fn fail_all(&mut self, error: RequestError) -> Vec<Output> {
        let ids: Vec<RequestId> = self.seqs.keys().copied().collect();
        ids.into_iter()
            .filter(|&id| self.abort(id))
            .map(|id| Output::Failed {
                id,
                error: error.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(num_blocks: usize, budget: usize) -> SchedulerCore {
        SchedulerCore::new(
            SchedulerConfig {
                max_num_seqs: 8,
                max_num_batched_tokens: budget,
                block_size: 4,
                num_blocks,
                watermark_blocks: 0,
                max_model_len: 64,
                kv_lease: Duration::from_secs(30),
                prefix_cache: true,
                cache_salt: 1,
                min_remote_prompt_tokens: 0,
            },
            Tokenizer::byte_level_synthetic(),
        )
    }

    fn req(id: u64, prompt_len: usize, max_tokens: usize) -> NewRequest {
        let mut params = SamplingParams::greedy(max_tokens);
        params.ignore_eos = true;
        NewRequest {
            id: RequestId(id),
            prompt: (0..prompt_len as u32).map(|t| 97 + t % 20).collect(),
            params,
            hold_for: None,
            push: false,
            resume: Vec::new(),
            constraint: None,
            images: Vec::new(),
        }
    }

    /// Logits that always pick token `b'a'`.
    fn logits(plan: &StepPlan) -> Vec<Vec<f32>> {
        let n = plan.members.iter().filter(|m| m.2).count();
        (0..n)
            .map(|_| {
                let mut l = vec![0.0; 259];
                l[97] = 1.0;
                l
            })
            .collect()
    }

    fn drive(c: &mut SchedulerCore) -> Vec<Output> {
        let mut all = Vec::new();
        for _ in 0..1000 {
            let Some(plan) = c.schedule() else { break };
            let l = logits(&plan);
            all.extend(c.complete(plan, l, Instant::now()));
        }
        all
    }

    #[test]
    fn prefill_is_chunked_under_the_token_budget() {
        let mut c = core(64, 5);
        c.add(req(1, 12, 2)).unwrap();
        let p = c.schedule().unwrap();
        assert_eq!(p.members, vec![(RequestId(1), 5, false)]);
        assert_eq!(p.batch.seqs[0].block_table.len(), 2);
        let l = logits(&p);
        assert!(c.complete(p, l, Instant::now()).is_empty());
        let p = c.schedule().unwrap();
        assert_eq!(p.batch.seqs[0].start_pos, 5);
        let out = drive_from(&mut c, p);
        assert!(matches!(
            out.last(),
            Some(Output::Finished {
                completion_tokens: 2,
                ..
            })
        ));
        assert_eq!(c.stats().blocks_free, 64);
    }

    fn drive_from(c: &mut SchedulerCore, first: StepPlan) -> Vec<Output> {
        let l = logits(&first);
        let mut out = c.complete(first, l, Instant::now());
        out.extend(drive(c));
        out
    }

    #[test]
    fn tiny_pool_preempts_and_still_finishes_everything() {
        // 6 blocks of 4 tokens; three requests needing 4 blocks each at the end.
        let mut c = core(6, 64);
        for id in 1..=3 {
            c.add(req(id, 6, 10)).unwrap();
        }
        let out = drive(&mut c);
        let finished: Vec<_> = out
            .iter()
            .filter_map(|o| match o {
                Output::Finished {
                    id,
                    completion_tokens,
                    ..
                } => Some((*id, *completion_tokens)),
                _ => None,
            })
            .collect();
        assert_eq!(finished.len(), 3);
        assert!(finished.iter().all(|&(_, n)| n == 10));
        assert!(
            c.stats().preemptions > 0,
            "the pool was too small to run all at once"
        );
        assert_eq!(c.stats().blocks_free, 6);
    }

    #[test]
    fn abort_and_failed_steps_free_blocks() {
        let mut c = core(16, 64);
        c.add(req(1, 8, 5)).unwrap();
        c.add(req(2, 8, 5)).unwrap();
        let p = c.schedule().unwrap();
        assert!(c.stats().blocks_free < 16);
        assert!(c.abort(RequestId(1)));
        let out = c.fail_step(p, RequestError::WorkerFailed("rank 0 panicked".into()));
        assert_eq!(
            out,
            vec![Output::Failed {
                id: RequestId(2),
                error: RequestError::WorkerFailed("rank 0 panicked".into())
            }]
        );
        assert_eq!(
            c.stats(),
            SchedulerStats {
                waiting: 0,
                running: 0,
                blocks_free: 16,
                blocks_total: 16,
                preemptions: 0,
                held: 0,
                blocks_in_use: 0,
                blocks_cached: 0,
                cache_evictions: 0,
                prompt_tokens: 16,
                prompt_tokens_cached: 0,
                local_prefills: 0,
            },
            "a step that never completed registers nothing"
        );
    }

    /// P/D usage: the request's cached tokens are the larger of the prefill instance's
    /// prefix-cache hit and this instance's own, never the whole prompt.
    #[test]
    fn remote_kv_usage_counts_the_prefill_sides_cache_hits() {
        let cached = |c: &mut SchedulerCore, id: u64, prefill_cached: usize| {
            let RemoteAdmission::Remote { .. } = c.add_remote(req(id, 9, 2), true).unwrap() else {
                panic!("a cold cache moves the whole prompt")
            };
            c.remote_kv_transferring(RequestId(id)).unwrap();
            c.remote_kv_ready(RequestId(id), 97, None, prefill_cached, Instant::now())
                .unwrap();
            let p = c.schedule().unwrap();
            match drive_from(c, p).last() {
                Some(Output::Finished { cached_tokens, .. }) => *cached_tokens,
                other => panic!("{other:?}"),
            }
        };
        let mut c = core(16, 64);
        assert_eq!(
            cached(&mut c, 1, 8),
            8,
            "prefill's hit counts when decode had none"
        );
        let mut c = core(16, 64);
        assert_eq!(cached(&mut c, 2, 0), 0);
        let mut c = core(16, 64);
        assert_eq!(
            cached(&mut c, 3, 50),
            8,
            "at most the prompt but its last token"
        );
        assert_eq!(c.stats().blocks_free, 16);
    }

    #[test]
    fn remote_kv_requests_wait_for_their_kv_then_decode_from_the_first_token() {
        let mut c = core(16, 64);
        let RemoteAdmission::Remote {
            blocks: dest,
            cached_blocks: 0,
        } = c.add_remote(req(1, 9, 3), true).unwrap()
        else {
            panic!("a cold cache moves the whole prompt")
        };
        assert_eq!(dest.len(), 3, "9 prompt tokens in blocks of 4");
        assert_eq!(
            c.state(RequestId(1)),
            Some(RequestState::WaitingForRemoteKv)
        );
        assert!(
            c.schedule().is_none(),
            "not scheduled before its KV arrives"
        );
        c.remote_kv_transferring(RequestId(1)).unwrap();
        assert_eq!(c.state(RequestId(1)), Some(RequestState::Transferring));
        let out = c
            .remote_kv_ready(RequestId(1), 97, None, 0, Instant::now())
            .unwrap();
        assert_eq!(
            out,
            vec![Output::Token {
                id: RequestId(1),
                token: 97,
                text: "a".into(),
                logprobs: None,
            }]
        );
        // The next step decodes from position 9 (prompt) with the first token as input.
        let p = c.schedule().unwrap();
        assert_eq!(
            (p.batch.seqs[0].start_pos, p.batch.seqs[0].tokens.clone()),
            (9, vec![97])
        );
        assert_eq!(p.batch.seqs[0].block_table[..3], dest[..]);
        let out = drive_from(&mut c, p);
        assert!(matches!(
            out.last(),
            Some(Output::Finished {
                completion_tokens: 3,
                ..
            })
        ));
        assert_eq!(c.stats().blocks_free, 16);
        // Aborting one that waits for KV frees its destination blocks.
        // The same prompt again: its two full blocks are cached here, the request is
        // prefilled locally (its whole prompt but the partial block is cached).
        assert_eq!(
            c.add_remote(req(2, 9, 3), true).unwrap(),
            RemoteAdmission::Local { cached_blocks: 2 }
        );
        assert!(c.abort(RequestId(2)));
        // Held-KV hand-offs (vLLM's proxy prefilled already) move only the missing block.
        assert!(matches!(
            c.add_remote(req(2, 9, 3), false).unwrap(),
            RemoteAdmission::Remote { cached_blocks: 2, ref blocks } if blocks.len() == 3
        ));
        assert!(c
            .remote_kv_ready(RequestId(3), 1, None, 0, Instant::now())
            .is_err());
        assert!(c.abort(RequestId(2)));
        assert_eq!(c.stats().blocks_free, 16);
    }

    #[test]
    fn prefill_holds_blocks_under_a_lease_until_released_or_expired() {
        let mut c = core(16, 64);
        let mut r = req(1, 9, 1);
        let t = TransferId(7);
        r.hold_for = Some(t);
        c.add(r).unwrap();
        let out = drive(&mut c);
        let held = out
            .iter()
            .find_map(|o| match o {
                Output::Finished { held_blocks, .. } => held_blocks.clone(),
                _ => None,
            })
            .unwrap();
        assert_eq!(held.len(), 3);
        assert_eq!(c.stats().blocks_free, 13, "held blocks stay taken");
        assert!(c.renew_held(t, Instant::now()));
        assert_eq!(c.held_blocks(t).map(|b| b.len()), Some(3));
        assert!(c.release_held(t));
        assert_eq!(c.held_blocks(t), None);
        assert!(!c.release_held(t), "a second release finds nothing");
        assert_eq!(c.stats().blocks_free, 16);
        // A lease that runs out frees the blocks; a late release is refused.
        let mut r = req(2, 9, 1);
        r.hold_for = Some(TransferId(8));
        c.add(r).unwrap();
        drive(&mut c);
        assert_eq!(c.expire_held(Instant::now() + Duration::from_secs(31)), 1);
        assert_eq!(c.stats().blocks_free, 16);
        assert!(!c.release_held(TransferId(8)));
    }

    #[test]
    fn prefix_hits_skip_compute_and_pinned_blocks_survive_eviction_pressure() {
        // 12 blocks of 4. Request 1 computes a 9-token prompt: its 2 full blocks get cached.
        let mut c = core(12, 64);
        c.add(req(1, 9, 1)).unwrap();
        let mut other = req(10, 8, 1);
        other.prompt = (0..8).map(|t| 150 + t).collect();
        c.add(other).unwrap();
        drive(&mut c);
        assert_eq!(c.stats().blocks_cached, 4, "the full prompt blocks of both");
        // The same prompt again computes only its last block's tokens.
        c.add(req(2, 9, 1)).unwrap();
        let p = c.schedule().unwrap();
        assert_eq!(
            (p.batch.seqs[0].start_pos, p.batch.seqs[0].tokens.len()),
            (8, 1)
        );
        let l = logits(&p);
        c.complete(p, l, Instant::now());
        assert_eq!(c.stats().prompt_tokens_cached, 8);
        // A decode-side request takes the cached prefix and waits for the rest; others then
        // need every unpinned block: the pinned prefix is never handed out.
        let RemoteAdmission::Remote {
            blocks: dest,
            cached_blocks: 2,
        } = c.add_remote(req(3, 9, 1), false).unwrap()
        else {
            panic!("the prefix is cached")
        };
        for id in 4..7 {
            let mut r = req(id, 12, 1);
            r.prompt = (0..12).map(|t| 200 + id as u32 * 13 + t).collect();
            c.add(r).unwrap();
        }
        let p = c.schedule().unwrap();
        for s in &p.batch.seqs {
            assert!(
                s.block_table.iter().all(|b| !dest.contains(b)),
                "{:?} reuses a pinned block of {dest:?}",
                s.block_table
            );
        }
        assert!(c.stats().cache_evictions > 0, "{:?}", c.stats());
        let l = logits(&p);
        c.complete(p, l, Instant::now());
        drive(&mut c);
        assert_eq!(
            c.block_manager().lookup(
                &crate::block_manager::block_hashes(1, &req(3, 9, 1).prompt, 4),
                &req(3, 9, 1).prompt,
                4
            ),
            2,
            "the pinned prefix is still cached"
        );
        assert!(c
            .remote_kv_ready(RequestId(3), 97, None, 0, Instant::now())
            .is_ok());
        drive(&mut c);
        assert_eq!(c.stats().blocks_in_use, 0, "{:?}", c.stats());
        assert_eq!(c.stats().blocks_free, 12);
    }

    /// A prefix restored layer by layer: the step that computes the rest carries the
    /// restored blocks; verified, they join the prefix cache with their hit counts; failed,
    /// the step's result for the request is dropped and it is recomputed from its tokens,
    /// with the same tokens and the pool full afterwards.
    #[test]
    fn a_streamed_restore_registers_when_verified_and_recomputes_when_not() {
        let bs = 4;
        let want = {
            let mut c = core(16, 64);
            c.add(req(1, 10, 3)).unwrap();
            drive(&mut c)
        };
        for verified in [true, false] {
            let mut c = core(16, 64);
            let bm = c.block_manager().clone();
            bm.spill_evictions(true);
            let mut prefix = bm.empty();
            assert!(bm.grow(&mut prefix, 2));
            let restored = prefix.blocks().to_vec();
            c.add_restored(req(1, 10, 3), prefix, 0, vec![4, 6])
                .unwrap();
            assert!(c.restore_pending(RequestId(1)));
            let p = c.schedule().unwrap();
            assert_eq!(p.restores, vec![(RequestId(1), restored.clone())]);
            assert_eq!(
                (p.batch.seqs[0].start_pos, p.batch.seqs[0].tokens.len()),
                (8, 2),
                "only the rest is computed"
            );
            assert!(c.restore_settled(RequestId(1), verified));
            assert!(!c.restore_pending(RequestId(1)));
            let l = logits(&p);
            let mut out = c.complete(p, l, Instant::now());
            let prompt = req(1, 10, 3).prompt;
            let hashes = crate::block_manager::block_hashes(1, &prompt[..8], bs);
            if verified {
                assert_eq!(bm.lookup(&hashes, &prompt[..8], bs), 2, "registered");
            } else {
                assert!(
                    out.is_empty(),
                    "the failed step's token is dropped: {out:?}"
                );
                assert_eq!(bm.lookup(&hashes, &prompt[..8], bs), 0, "never registered");
                assert_eq!(c.state(RequestId(1)), Some(RequestState::Waiting));
            }
            out.extend(drive(&mut c));
            let tokens = |o: &[Output]| -> Vec<u32> {
                o.iter()
                    .filter_map(|o| match o {
                        Output::Token { token, .. } => Some(*token),
                        _ => None,
                    })
                    .collect()
            };
            assert_eq!(tokens(&out), tokens(&want), "verified={verified}");
            let cached = out.iter().find_map(|o| match o {
                Output::Finished { cached_tokens, .. } => Some(*cached_tokens),
                _ => None,
            });
            assert_eq!(cached, Some(if verified { 8 } else { 0 }));
            assert_eq!(c.stats().blocks_in_use, 0, "{:?}", c.stats());
            if verified {
                // Evicting everything shows the restored blocks kept their hit counts.
                let mut all = bm.empty();
                assert!(bm.grow(&mut all, 16));
                let hits: Vec<(u64, u32)> =
                    bm.take_evicted().iter().map(|e| (e.hash, e.hits)).collect();
                assert!(
                    hits.contains(&(hashes[0], 4)) && hits.contains(&(hashes[1], 6)),
                    "{hits:?}"
                );
            }
        }
    }

    fn image(tag: u8, rows: usize) -> Arc<ImageEmbeds> {
        Arc::new(ImageEmbeds {
            digest: pdserve_gpu::vision::ImageDigest([tag; 32]),
            rows,
            width: 8,
            data: vec![f32::from(tag); rows * 8],
        })
    }

    /// 5 text tokens, 6 rows of `img` (placeholder token 259), 4 text tokens: blocks of 4 are
    /// [text], [text, 3 rows], [3 rows, text], [3 text] + a partial one.
    fn image_req(id: u64, img: &Arc<ImageEmbeds>) -> NewRequest {
        let mut r = req(id, 15, 1);
        r.prompt = (0..5).map(|t| 100 + t).collect();
        r.prompt.extend([259; 6]);
        r.prompt.extend((0..4).map(|t| 120 + t));
        r.images = vec![PromptImage {
            at: 5,
            embeds: img.clone(),
        }];
        r
    }

    #[test]
    fn image_rows_ride_their_chunks_and_key_the_prefix_cache_by_digest() {
        let (a, b) = (image(1, 6), image(2, 6));
        // Budget 4: chunks [0,4) [4,8) [8,12) [12,15); the image spans positions 5..11.
        let mut c = core(32, 4);
        c.add(image_req(1, &a)).unwrap();
        let mut spans = Vec::new();
        for _ in 0..100 {
            let Some(p) = c.schedule() else { break };
            let seq = &p.batch.seqs[0];
            spans.extend(
                seq.embeds
                    .iter()
                    .map(|e| (seq.start_pos, e.at, e.from, e.len)),
            );
            let l = logits(&p);
            c.complete(p, l, Instant::now());
        }
        // (chunk start, index in chunk, first row, rows): rows 0..3, 3..6.
        assert_eq!(spans, vec![(4, 1, 0, 3), (8, 0, 3, 3)]);
        assert_eq!(c.stats().blocks_cached, 3);

        // The same text with another image: only the block before the image is shared.
        c.add(image_req(2, &b)).unwrap();
        let p = c.schedule().unwrap();
        assert_eq!(
            p.batch.seqs[0].start_pos, 4,
            "one text block from the cache"
        );
        drive_from(&mut c, p);
        // The same image again: everything up to the last partial block.
        c.add(image_req(3, &a)).unwrap();
        let p = c.schedule().unwrap();
        assert_eq!(p.batch.seqs[0].start_pos, 12);
        assert!(p.batch.seqs[0].embeds.is_empty(), "the image is all cached");
        drive_from(&mut c, p);
        // A text prompt of the placeholder tokens themselves never matches an image's blocks.
        let mut text = image_req(4, &a);
        text.images.clear();
        c.add(text).unwrap();
        let p = c.schedule().unwrap();
        assert_eq!(p.batch.seqs[0].start_pos, 4);
        drive_from(&mut c, p);
        assert_eq!(c.stats().blocks_in_use, 0);
        assert_eq!(c.stats().blocks_free, 32);
    }

    #[test]
    fn images_outside_the_prompt_or_overlapping_are_refused() {
        let mut c = core(32, 64);
        let a = image(1, 6);
        let mut r = image_req(1, &a);
        r.images[0].at = 10; // 10 + 6 > 15
        assert!(matches!(c.add(r), Err(RequestError::BadRequest(_))));
        let mut r = image_req(2, &a);
        r.images.push(PromptImage {
            at: 7,
            embeds: image(2, 2),
        });
        assert!(matches!(c.add(r), Err(RequestError::BadRequest(_))));
        let mut r = image_req(3, &a);
        r.images[0].at = usize::MAX;
        assert!(matches!(c.add(r), Err(RequestError::BadRequest(_))));
        assert_eq!(c.stats().waiting, 0);
    }

    #[test]
    fn oversized_requests_are_refused_up_front() {
        let mut c = core(4, 64);
        assert!(matches!(
            c.add(req(1, 60, 10)),
            Err(RequestError::ContextOverflow { requested: 70, .. })
        ));
        assert!(
            matches!(c.add(req(2, 10, 10)), Err(RequestError::BadRequest(_))),
            "20 tokens > 4 blocks of 4"
        );
        assert!(matches!(
            c.add(req(3, 0, 1)),
            Err(RequestError::BadRequest(_))
        ));
        // A max_tokens whose sum with the prompt would wrap is refused, not admitted.
        for (id, n) in [(4, usize::MAX), (5, usize::MAX - 3)] {
            assert!(matches!(
                c.add(req(id, 5, n)),
                Err(RequestError::ContextOverflow {
                    requested: usize::MAX,
                    ..
                })
            ));
        }
        assert_eq!(c.stats().blocks_free, 4, "nothing refused holds a block");
    }
}
