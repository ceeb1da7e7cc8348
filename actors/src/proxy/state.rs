//! [`ProxyState`]: what the proxy's handlers, its poller and its control plane share.

use super::registry::{Registry, Upstream};
use super::routing::{kv_pick, least_loaded, round_robin, KvView, Reason, RoundRobin};
use crate::kv_events::{KvIndex, PromptHashes};
use pdserve_runtime::config::RouterKind;
use pdserve_runtime::telemetry as m;
use pdserve_runtime::Role;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Tokens per block assumed for the load of an instance that does not report its scheme.
const DEFAULT_BLOCK_SIZE: usize = 16;

/// The tokenizer and chat template the KV router turns text and chat prompts into token ids
/// with (`proxy.model`).
#[derive(Clone)]
pub struct PromptTokenizer {
    /// The model's tokenizer.
    pub tokenizer: pdserve_gpu::Tokenizer,
    /// Its chat template.
    pub template: pdserve_gpu::ChatTemplate,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PromptTokenizer")
    }
}

/// Blocks of the requests this proxy sent to one instance and has not seen end.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outstanding {
    /// Prompt blocks sent to it for prefill.
    pub prefill_blocks: usize,
    /// Prompt and output blocks of requests it decodes.
    pub decode_blocks: usize,
}

/// One request's share of an instance's [`Outstanding`] load; given back when dropped.
pub struct Charge {
    state: Arc<ProxyState>,
    url: String,
    load: Outstanding,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut all = self
            .state
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(o) = all.get_mut(&self.url) {
            o.prefill_blocks = o.prefill_blocks.saturating_sub(self.load.prefill_blocks);
            o.decode_blocks = o.decode_blocks.saturating_sub(self.load.decode_blocks);
            if *o == Outstanding::default() {
                all.remove(&self.url);
            }
        }
    }
}

/// What the router knows of one request's prompt.
#[derive(Debug, Clone)]
pub struct PromptInfo {
    /// Its token ids, when the proxy could compute them.
    pub tokens: Option<Arc<Vec<u32>>>,
    /// `max_tokens` asked for (the decode footprint's estimate).
    pub max_tokens: usize,
}

/// Shared by the proxy's handlers, its poller and its control plane.
pub struct ProxyState {
    pub(super) registry: Mutex<Registry>,
    pub(super) rr: RoundRobin,
    pub(super) http: reqwest::Client,
    pub(super) timeout: Duration,
    pub(super) max_prefill_queue: Option<usize>,
    /// Requests forwarded at once (`proxy.max_concurrent_requests`); one more gets 503.
    pub(super) admission: Arc<tokio::sync::Semaphore>,
    pub(super) max_concurrent_requests: usize,
    pub(super) api_key: Option<String>,
    /// Times one request may move to another decode instance mid-generation.
    pub(super) migration_limit: u32,
    /// What happens when a prefill instance fails before the hand-off.
    pub(super) prefill_retry: pdserve_runtime::config::PrefillRetry,
    pub(super) metrics: pdserve_runtime::telemetry::MetricsHandle,
    /// How instances are picked.
    pub(super) router: RouterKind,
    /// Weight of prefill work in the KV router's cost.
    pub(super) prefill_load_scale: f64,
    /// Which cached blocks each registered instance holds (from its KV events).
    pub(super) kv_index: Mutex<KvIndex>,
    /// What a prefix block held in a KV tier is worth to the KV router.
    pub(super) kv_tier_credit: pdserve_runtime::config::TierCredit,
    /// Turns text and chat prompts into token ids for the KV router.
    pub(super) tokenizer: Option<Arc<PromptTokenizer>>,
    /// Load this proxy put on each instance (instance URL → blocks), fresher than heartbeats.
    pub(super) outstanding: Mutex<HashMap<String, Outstanding>>,
    /// Router decisions by (role, reason), for `pdserve inspect`.
    pub(super) decisions: Mutex<HashMap<(Role, Reason), u64>>,
    /// The proxy is draining (it was asked to stop): `/health` answers 503 so load balancers
    /// send no more, and what is in flight finishes.
    pub(super) draining: std::sync::atomic::AtomicBool,
}

impl ProxyState {
    pub(super) fn kv_index(&self) -> std::sync::MutexGuard<'_, KvIndex> {
        self.kv_index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Picks one of `candidates` (routable instances of `role`) for `prompt` with the
    /// configured router, and counts the decision.
    pub(super) fn choose(
        &self,
        role: Role,
        candidates: &[Upstream],
        prompt: &PromptInfo,
    ) -> Option<Upstream> {
        let (picked, reason) = match (self.router, prompt.tokens.as_deref()) {
            (RouterKind::RoundRobin, _) => {
                (round_robin(candidates, role, &self.rr)?, Reason::RoundRobin)
            }
            (RouterKind::LeastLoaded, _) => (
                least_loaded(candidates, role, &self.rr)?,
                Reason::LeastLoaded,
            ),
            (RouterKind::Kv, None) => (
                least_loaded(candidates, role, &self.rr)?,
                Reason::Untokenized,
            ),
            (RouterKind::Kv, Some(tokens)) => {
                let views = self.kv_views(role, candidates, tokens);
                let scale = if role == Role::Prefill {
                    self.prefill_load_scale
                } else {
                    1.0
                };
                kv_pick(candidates, &views, scale, role, &self.rr)?
            }
        };
        metrics::counter!(m::ROUTER_DECISIONS_TOTAL, "role" => role.as_str(), m::LABEL_REASON => reason.as_str())
            .increment(1);
        *self
            .decisions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((role, reason))
            .or_default() += 1;
        Some(picked.clone())
    }

    fn kv_views(&self, role: Role, candidates: &[Upstream], tokens: &[u32]) -> Vec<KvView> {
        let index = self.kv_index();
        let outstanding = self.outstanding.lock().unwrap_or_else(|e| e.into_inner());
        let mut hashes = PromptHashes::new(tokens);
        candidates
            .iter()
            .map(|u| {
                let scheme = index.scheme(&u.url);
                let block_size = scheme.map_or(DEFAULT_BLOCK_SIZE, |s| s.block_size).max(1);
                let (overlap, credit) = scheme.map_or((0, 0.0), |s| {
                    index.credit(&u.url, hashes.hashes(s), &self.kv_tier_credit)
                });
                let load = outstanding.get(&u.url).copied().unwrap_or_default();
                KvView {
                    overlap,
                    credit,
                    prompt_blocks: tokens.len() / block_size,
                    active_prefill_blocks: if role == Role::Prefill {
                        load.prefill_blocks
                    } else {
                        0
                    },
                    active_decode_blocks: if role == Role::Decode {
                        load.decode_blocks
                    } else {
                        0
                    },
                }
            })
            .collect()
    }

    /// Counts a request's load on `url` (prefill or decode) until the returned guard drops.
    pub(super) fn charge(self: &Arc<Self>, url: &str, role: Role, prompt: &PromptInfo) -> Charge {
        let block_size = self
            .kv_index()
            .scheme(url)
            .map_or(DEFAULT_BLOCK_SIZE, |s| s.block_size)
            .max(1);
        let prompt_tokens = prompt.tokens.as_ref().map_or(0, |t| t.len());
        let load = if role == Role::Prefill {
            Outstanding {
                prefill_blocks: prompt_tokens.div_ceil(block_size),
                decode_blocks: 0,
            }
        } else {
            Outstanding {
                prefill_blocks: 0,
                decode_blocks: (prompt_tokens + prompt.max_tokens).div_ceil(block_size),
            }
        };
        let mut all = self.outstanding.lock().unwrap_or_else(|e| e.into_inner());
        let o = all.entry(url.to_string()).or_default();
        o.prefill_blocks += load.prefill_blocks;
        o.decode_blocks += load.decode_blocks;
        Charge {
            state: self.clone(),
            url: url.to_string(),
            load,
        }
    }

    /// Router decisions so far, by role and reason.
    pub fn decisions(&self) -> Vec<(Role, &'static str, u64)> {
        let mut v: Vec<_> = self
            .decisions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|((role, reason), n)| (*role, reason.as_str(), *n))
            .collect();
        v.sort_by_key(|(role, reason, _)| (role.as_str(), *reason));
        v
    }

    pub(super) fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call to an instance, with the cluster's API key when the proxy has one (instances
    /// of a cluster share the proxy's key; one without a key ignores it).
    pub(super) fn upstream(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }
}
