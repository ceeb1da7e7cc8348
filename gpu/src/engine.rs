//! A self-contained generation loop over a [`TpGroup`]: what `pdserve generate`, the model
//! benchmark and the model tests run. It batches every request of a call together — chunked
//! prefill under a token budget, then batched decode — with block tables from a
//! [`BlockAllocator`]. The serving scheduler (actors crate) replaces this loop with continuous
//! batching, admission and preemption, on the same [`TpGroup`].

use crate::batch::{Batch, SeqChunk};
use crate::chat::{ChatMessage, ChatTemplate};
use crate::config::ModelConfig;
use crate::generation::{Generation, TokenOutcome};
use crate::kv::{BlockAllocator, DEFAULT_BLOCK_SIZE};
use crate::loader::LoadedModel;
use crate::sampling::{FinishReason, SamplingParams};
use crate::tokenizer::Tokenizer;
use crate::tp::{TpGroup, TpOptions};
use crate::weights::WeightFormat;
use crate::{ModelError, Result};
use pdserve_runtime::memory::AnonAllocator;

/// How to build an [`Engine`].
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// KV blocks per rank; `None` sizes the pool for `max_seqs` full contexts (at most 8192
    /// tokens each).
    pub num_blocks: Option<usize>,
    /// Tokens per block.
    pub block_size: usize,
    /// In-memory weight format.
    pub format: WeightFormat,
    /// Most tokens in one forward step (prefill chunk budget).
    pub max_batch_tokens: usize,
    /// Sequences the default pool is sized for.
    pub max_seqs: usize,
    /// Element type of the KV cache.
    pub kv_dtype: crate::kv::KvDtype,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            tp: 1,
            num_blocks: None,
            block_size: DEFAULT_BLOCK_SIZE,
            format: WeightFormat::Auto,
            max_batch_tokens: 512,
            max_seqs: 8,
            kv_dtype: crate::kv::KvDtype::F32,
        }
    }
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling and stop settings.
    pub params: SamplingParams,
}

/// What one request produced.
#[derive(Clone, Debug, PartialEq)]
pub struct GenOutput {
    /// Generated token ids (a stop token included, as the model produced it).
    pub tokens: Vec<u32>,
    /// Generated text, stop strings and stop tokens excluded.
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
}

struct Seq {
    prompt: Vec<u32>,
    gen: Generation,
    blocks: Vec<u32>,
    /// Tokens already in the cache.
    computed: usize,
    text: String,
    finish: Option<FinishReason>,
}

impl Seq {
    fn all_tokens(&self) -> usize {
        self.prompt.len() + self.gen.output().len()
    }
}

/// The TP ranks an [`Engine`] steps: the CPU [`TpGroup`] or a device backend's group.
pub trait StepGroup: std::fmt::Debug {
    /// The model configuration.
    fn config(&self) -> &ModelConfig;
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// Runs one forward step on every rank; logits of the sequences that asked for them.
    ///
    /// # Errors
    /// Invalid batches, rank failures.
    fn step(&self, batch: Batch) -> Result<Vec<Vec<f32>>>;
}

impl StepGroup for TpGroup {
    fn config(&self) -> &ModelConfig {
        TpGroup::config(self)
    }
    fn block_size(&self) -> usize {
        self.layouts()[0].block_size
    }
    fn step(&self, batch: Batch) -> Result<Vec<Vec<f32>>> {
        TpGroup::step(self, batch)
    }
}

impl EngineOptions {
    /// KV blocks per rank: `num_blocks`, or enough for `max_seqs` full contexts (at most 8192
    /// tokens each) of `cfg`.
    pub fn pool_blocks(&self, cfg: &ModelConfig) -> usize {
        self.num_blocks.unwrap_or_else(|| {
            self.max_seqs * cfg.context_length.min(8192).div_ceil(self.block_size)
        })
    }

    /// The [`TpOptions`] of a group built for these options.
    pub fn tp_options(&self, cfg: &ModelConfig) -> TpOptions {
        TpOptions {
            tp: self.tp,
            num_blocks: self.pool_blocks(cfg),
            block_size: self.block_size,
            format: self.format,
            kv_dtype: self.kv_dtype,
        }
    }
}

/// A model, its TP ranks and a block pool, generating for batches of requests.
#[derive(Debug)]
pub struct Engine<G: StepGroup = TpGroup> {
    name: String,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate,
    group: G,
    blocks: BlockAllocator,
    opts: EngineOptions,
}

impl Engine {
    /// Cuts the model into `opts.tp` shards and starts the rank threads.
    ///
    /// # Errors
    /// [`ModelError::BadTpSize`], weight and memory errors.
    pub fn new(model: LoadedModel, opts: EngineOptions) -> Result<Self> {
        let tp_opts = opts.tp_options(&model.config);
        let group = TpGroup::new(&model.config, &model.store, &tp_opts, &AnonAllocator)?;
        Ok(Engine::with_group(model, group, opts))
    }
}

impl<G: StepGroup> Engine<G> {
    /// An engine over an already started `group` (built from `model` with
    /// `opts.tp_options`); the model's weights are dropped here.
    pub fn with_group(model: LoadedModel, group: G, opts: EngineOptions) -> Self {
        Self {
            name: model.name,
            tokenizer: model.tokenizer,
            chat_template: model.chat_template,
            blocks: BlockAllocator::new(opts.pool_blocks(&model.config)),
            group,
            opts,
        }
    }

    /// The rank group, the engine's other state dropped (to shut the ranks down in order).
    pub fn into_group(self) -> G {
        self.group
    }

    /// Model name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Model configuration.
    pub fn config(&self) -> &ModelConfig {
        self.group.config()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The TP group (for tests and tools that drive steps directly).
    pub fn group(&self) -> &G {
        &self.group
    }

    /// Free and total KV blocks.
    pub fn block_usage(&self) -> (usize, usize) {
        (self.blocks.num_free(), self.blocks.total())
    }

    /// Tokenizes a plain prompt.
    ///
    /// # Errors
    /// Tokenizer failures.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, true)
    }

    /// Renders a chat through the model's template and tokenizes it.
    ///
    /// # Errors
    /// Template or tokenizer failures.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.chat_template.render(messages, true)?;
        // The template already placed BOS where the model wants it.
        self.tokenizer.encode(&text, false)
    }

    /// Generates for every request together. `on_text(i, piece)` receives request `i`'s text
    /// as it becomes final (for streaming). Every block taken is returned before this returns,
    /// whether it succeeds or fails.
    ///
    /// # Errors
    /// [`ModelError::ContextOverflow`] when a prompt plus its `max_tokens` exceed the context,
    /// [`ModelError::OutOfBlocks`] when the pool cannot hold the batch, invalid sampling
    /// parameters, rank failures.
    pub fn generate(
        &mut self,
        requests: &[GenRequest],
        on_text: &mut dyn FnMut(usize, &str),
    ) -> Result<Vec<GenOutput>> {
        let ctx = self.config().context_length;
        let vocab = self.config().vocab_size;
        let mut seqs = Vec::with_capacity(requests.len());
        for r in requests {
            r.params.validate(vocab)?;
            if r.prompt.is_empty() {
                return Err(ModelError::InvalidBatch("empty prompt".into()));
            }
            let total = r.prompt.len() + r.params.max_tokens;
            if total > ctx {
                return Err(ModelError::ContextOverflow {
                    tokens: total,
                    context: ctx,
                });
            }
            seqs.push(Seq {
                prompt: r.prompt.clone(),
                gen: Generation::new(&r.params, &self.tokenizer),
                blocks: Vec::new(),
                computed: 0,
                text: String::new(),
                finish: if r.params.max_tokens == 0 {
                    Some(FinishReason::Length)
                } else {
                    None
                },
            });
        }
        let result = self.run(&mut seqs, on_text);
        for s in &mut seqs {
            self.blocks.free(&std::mem::take(&mut s.blocks));
        }
        result?;
        Ok(seqs
            .into_iter()
            .map(|s| GenOutput {
                tokens: s.gen.into_output(),
                text: s.text,
                finish: s.finish.unwrap_or(FinishReason::Length),
            })
            .collect())
    }

    fn run(&mut self, seqs: &mut [Seq], on_text: &mut dyn FnMut(usize, &str)) -> Result<()> {
        let bs = self.opts.block_size;
        loop {
            // Decodes first (one token each), then prefill chunks in the remaining budget.
            let mut budget = self.opts.max_batch_tokens.max(1);
            let mut batch = Batch::default();
            let mut members = Vec::new();
            let mut order: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].finish.is_none())
                .collect();
            if order.is_empty() {
                return Ok(());
            }
            order.sort_by_key(|&i| seqs[i].computed < seqs[i].prompt.len());
            for i in order {
                if budget == 0 {
                    break;
                }
                let s = &mut seqs[i];
                let all: Vec<u32> = s.prompt.iter().chain(s.gen.output()).copied().collect();
                let remaining = s.all_tokens() - s.computed;
                let n = remaining.min(budget);
                let end = s.computed + n;
                let need = end.div_ceil(bs);
                if need > s.blocks.len() {
                    let more = self.blocks.allocate(need - s.blocks.len())?;
                    s.blocks.extend(more);
                }
                batch.seqs.push(SeqChunk {
                    tokens: all[s.computed..end].to_vec(),
                    start_pos: s.computed,
                    block_table: s.blocks.clone(),
                    want_logits: end == s.all_tokens(),
                    all_logits: false,
                    embeds: Vec::new(),
                });
                members.push((i, n));
                budget -= n;
            }
            let logits = self.group.step(batch)?;
            let mut next_logits = logits.into_iter();
            for (i, n) in members {
                let s = &mut seqs[i];
                s.computed += n;
                if s.computed < s.all_tokens() {
                    continue;
                }
                let mut l = next_logits.next().ok_or_else(|| {
                    ModelError::InvalidBatch("forward returned fewer logits than asked".into())
                })?;
                let tok = s.gen.sample(&mut l, &s.prompt);
                let emitted = match s.gen.accept(tok)? {
                    TokenOutcome::Continue { text } => text,
                    TokenOutcome::Finished { reason, text } => {
                        s.finish = Some(reason);
                        self.blocks.free(&std::mem::take(&mut s.blocks));
                        text
                    }
                };
                if !emitted.is_empty() {
                    s.text.push_str(&emitted);
                    on_text(i, &emitted);
                }
            }
        }
    }
}
