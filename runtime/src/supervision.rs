//! Supervision's pure core: restart budgets ([`RestartTracker`]), the [`Epoch`] fence for
//! stale reports, and the supervision-tree snapshots that `pdserve inspect` draws
//! ([`InstanceSnapshot`] and [`render_tree`] for one instance, [`ClusterSnapshot`] and
//! [`render_cluster`] for a proxy and every instance registered with it).
//!
//! Nothing here touches tokio or ractor: a supervisor actor feeds the tracker the time of each
//! child failure and acts on the returned [`RestartDecision`]; the snapshot types are plain
//! data the actors fill in and the CLI renders: serde for `pdserve inspect --json`, rkyv for
//! the control plane's typed inspect answer (`wire::ControlMessage::Inspect`), where an actor
//! tree travels flattened ([`ActorTree`]).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How many times a child may be restarted within a sliding window before its supervisor
/// gives up and escalates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartPolicy {
    /// Restarts allowed within `within`; `0` means never restart.
    pub max_restarts: u32,
    /// The sliding window.
    pub within: Duration,
}

impl Default for RestartPolicy {
    /// 3 restarts within 60 s.
    fn default() -> Self {
        Self {
            max_restarts: 3,
            within: Duration::from_secs(60),
        }
    }
}

/// What a supervisor should do about a failed child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartDecision {
    /// Restart it; `attempt` counts restarts within the current window, from 1.
    Restart {
        /// 1-based restart number within the window.
        attempt: u32,
    },
    /// The budget is spent: stop restarting and fail upwards.
    Escalate {
        /// Restarts already granted within the window.
        restarts_in_window: u32,
    },
}

/// Counts one child's failures against a [`RestartPolicy`] over a sliding window.
///
/// Memory is bounded: only the times of restarts still inside the window are kept, at most
/// `max_restarts` of them.
#[derive(Debug, Clone)]
pub struct RestartTracker {
    policy: RestartPolicy,
    /// Times of granted restarts within the window, oldest first.
    recent: VecDeque<Instant>,
    total: u32,
}

impl RestartTracker {
    /// A tracker with no failures yet.
    pub fn new(policy: RestartPolicy) -> Self {
        let cap = policy.max_restarts.min(1024) as usize;
        Self {
            policy,
            recent: VecDeque::with_capacity(cap),
            total: 0,
        }
    }

    /// The policy this tracker enforces.
    pub fn policy(&self) -> RestartPolicy {
        self.policy
    }

    /// Records a failure at `now` and decides: restart while fewer than `max_restarts`
    /// restarts happened in the last `within`, escalate otherwise. Restarts older than the
    /// window are forgotten. An escalated failure is not counted as a restart.
    pub fn on_failure(&mut self, now: Instant) -> RestartDecision {
        self.forget_before(now);
        let in_window = self.recent.len() as u32;
        if in_window >= self.policy.max_restarts {
            return RestartDecision::Escalate {
                restarts_in_window: in_window,
            };
        }
        self.recent.push_back(now);
        self.total = self.total.saturating_add(1);
        RestartDecision::Restart {
            attempt: in_window + 1,
        }
    }

    /// Restarts granted within the window ending at `now`.
    pub fn restarts_in_window(&mut self, now: Instant) -> u32 {
        self.forget_before(now);
        self.recent.len() as u32
    }

    /// Restarts granted over the tracker's life (what `inspect` shows).
    pub fn total_restarts(&self) -> u32 {
        self.total
    }

    fn forget_before(&mut self, now: Instant) {
        while let Some(&oldest) = self.recent.front() {
            if now.saturating_duration_since(oldest) >= self.policy.within {
                self.recent.pop_front();
            } else {
                break;
            }
        }
    }
}

/// The generation of an actor: its supervisor gives each restart a new, larger epoch, and
/// every report an actor sends (and every executor job it submits) carries the epoch it was
/// started with. A receiver drops reports whose epoch is not the current one, which fences
/// out stale completions from the instance of the actor that crashed.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch of an actor's first start.
    pub const INITIAL: Epoch = Epoch(0);

    /// The epoch after this one (for the next restart).
    #[must_use]
    pub fn next(self) -> Epoch {
        Epoch(self.0 + 1)
    }

    /// Whether a report stamped `report` may be acted on by a receiver whose current epoch
    /// is `self`: only reports of exactly the current epoch are.
    pub fn accepts(self, report: Epoch) -> bool {
        report == self
    }
}

impl std::fmt::Display for Epoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "epoch-{}", self.0)
    }
}

/// The lifecycle state of an actor as `inspect` shows it.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ActorState {
    /// Spawned, `pre_start` not finished.
    Starting,
    /// Handling messages.
    Running,
    /// Crashed; its supervisor is starting a new instance.
    Restarting,
    /// Stopped normally.
    Stopped,
    /// Crashed and not restarted (budget spent or not restartable).
    Failed,
}

/// The kinds of pdserve's actors: what an [`ActorSnapshot`] names in `kind`, what
/// `faults.actor_panic_target` and the restart metrics label (`actor`) take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActorKind {
    /// An instance's root: starts its actors and keeps them alive.
    InstanceSupervisor,
    /// One tensor-parallel rank.
    TpWorker,
    /// Batches requests and plans steps.
    Scheduler,
    /// Gathers every rank's reports of a KV hand-off.
    Aggregator,
    /// The prefill side's KV writes (push hand-offs).
    KvSender,
    /// The decode side's KV fetches.
    KvReceiver,
    /// The instance's HTTP server.
    HttpFrontend,
    /// The cluster's router.
    Proxy,
    /// A vision-language model's image encoder (on an executor thread of its own).
    VisionEncoder,
}

/// A name that is no [`ActorKind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown actor kind {0:?} (one of {kinds})", kinds = ActorKind::names())]
pub struct UnknownActorKind(pub String);

impl ActorKind {
    /// Every kind.
    pub const ALL: [ActorKind; 9] = [
        ActorKind::InstanceSupervisor,
        ActorKind::TpWorker,
        ActorKind::Scheduler,
        ActorKind::Aggregator,
        ActorKind::KvSender,
        ActorKind::KvReceiver,
        ActorKind::HttpFrontend,
        ActorKind::Proxy,
        ActorKind::VisionEncoder,
    ];

    /// The kinds an instance's supervisor restarts or escalates, and so the kinds
    /// `faults.actor_panic_target` may name.
    pub const SUPERVISED: [ActorKind; 7] = [
        ActorKind::TpWorker,
        ActorKind::Scheduler,
        ActorKind::KvSender,
        ActorKind::KvReceiver,
        ActorKind::Aggregator,
        ActorKind::HttpFrontend,
        ActorKind::VisionEncoder,
    ];

    /// Its name (`TpWorker`, ...), as snapshots and metrics show it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InstanceSupervisor => "InstanceSupervisor",
            Self::TpWorker => "TpWorker",
            Self::Scheduler => "Scheduler",
            Self::Aggregator => "Aggregator",
            Self::KvSender => "KvSender",
            Self::KvReceiver => "KvReceiver",
            Self::HttpFrontend => "HttpFrontend",
            Self::Proxy => "Proxy",
            Self::VisionEncoder => "VisionEncoder",
        }
    }

    fn names() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }
}

impl std::fmt::Display for ActorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ActorKind {
    type Err = UnknownActorKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownActorKind(s.chars().take(64).collect()))
    }
}

impl ActorState {
    /// The lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Restarting => "restarting",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }

    fn ansi_color(self) -> &'static str {
        match self {
            Self::Running => "\x1b[32m",                     // green
            Self::Starting | Self::Restarting => "\x1b[33m", // yellow
            Self::Stopped => "\x1b[2m",                      // dim
            Self::Failed => "\x1b[31m",                      // red
        }
    }
}

/// One actor in the supervision tree.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ActorSnapshot {
    /// Registered name (`scheduler`, `tp-worker-0`, ...).
    pub name: String,
    /// What kind of actor (`Scheduler`, `TpWorker`, ...).
    pub kind: String,
    /// Lifecycle state.
    pub state: ActorState,
    /// Times its supervisor restarted it.
    pub restarts: u32,
    /// Messages waiting in its mailbox.
    pub mailbox_depth: usize,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// Seconds since its current instance started.
    pub uptime_s: f64,
    /// The actors it supervises.
    pub children: Vec<ActorSnapshot>,
}

/// One instance's live picture: identity, queue and KV figures, and its actor tree.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct InstanceSnapshot {
    /// Instance name (`instance.name`).
    pub instance: String,
    /// `prefill`, `decode` or `colocated`.
    pub role: String,
    /// Served model name.
    pub model: String,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Requests waiting to be scheduled.
    pub waiting: usize,
    /// Requests running.
    pub running: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// KV blocks free.
    pub kv_blocks_free: usize,
    /// KV blocks held by requests (`kv_blocks_total - kv_blocks_free`).
    #[serde(default)]
    pub kv_blocks_used: usize,
    /// Running requests preempted (and queued for recompute) since the instance started.
    #[serde(default)]
    pub preemptions: u64,
    /// KV hand-offs under way now (prefill: held for a decode instance; decode: being read).
    #[serde(default)]
    pub transfers_in_flight: u64,
    /// KV bytes this instance sent to peers since it started.
    #[serde(default)]
    pub bytes_sent: u64,
    /// KV bytes this instance received from peers since it started.
    #[serde(default)]
    pub bytes_received: u64,
    /// KV hand-offs that failed since the instance started.
    #[serde(default)]
    pub transfer_failures: u64,
    /// Cached KV blocks nobody holds (prefix cache; counted in `kv_blocks_free`).
    #[serde(default)]
    pub kv_blocks_cached: usize,
    /// Prompt tokens of admitted requests.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Of those, tokens served from the prefix cache (not computed, not transferred).
    #[serde(default)]
    pub prompt_tokens_cached: u64,
    /// Cached blocks evicted to make room.
    #[serde(default)]
    pub cache_evictions: u64,
    /// Decode: requests prefilled here because the prefix cache held all but a short suffix.
    #[serde(default)]
    pub local_prefills: u64,
    /// Decode: completed hand-offs.
    #[serde(default)]
    pub handoffs_done: u64,
    /// Decode: KV bytes those hand-offs moved in (blocks moved × bytes per block).
    #[serde(default)]
    pub handoff_bytes: u64,
    /// Decode: KV bytes those hand-offs did not move: the prefix cache held them.
    #[serde(default)]
    pub handoff_bytes_skipped: u64,
    /// The KV cache tiers below the block pool (empty: off).
    #[serde(default)]
    pub kv_tiers: Vec<TierSnapshot>,
    /// Decode: the KV path negotiated with each prefill peer at the handshake (host or CUDA
    /// IPC, with the reason for the host path); empty: none yet, not a decode instance, or
    /// one without device KV (always the host path).
    #[serde(default)]
    pub kv_paths: Vec<KvPathSnapshot>,
    /// An encode instance's encoder (E/P/D): its cache and hold slots.
    #[serde(default)]
    pub encoder: Option<EncoderSnapshot>,
    /// The root of the supervision tree.
    #[rkyv(with = ActorTree)]
    pub actors: ActorSnapshot,
}

/// An encode instance's encoder, as `pdserve inspect` shows it.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct EncoderSnapshot {
    /// Images in its encoder cache.
    pub cache_images: u64,
    /// Bytes of their embeddings.
    pub cache_bytes: u64,
    /// Hold slots (`multimodal.encoder_hold_slots`).
    pub hold_slots: u64,
    /// Of those, held for readers now.
    pub hold_slots_used: u64,
    /// Holds handed out since the instance started (each one request's images, read by the
    /// instance computing its prompt).
    pub holds_served: u64,
}

/// One KV cache tier of an instance, as `pdserve inspect` shows it.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct TierSnapshot {
    /// `host` or `disk`.
    pub tier: String,
    /// Blocks it holds.
    pub blocks: u64,
    /// Bytes it holds.
    pub bytes: u64,
    /// Its capacity in bytes.
    pub capacity_bytes: u64,
    /// Blocks restored from it.
    pub hits: u64,
    /// Restores that failed verification (recomputed).
    pub misses: u64,
    /// Bytes stored into it.
    pub bytes_written: u64,
    /// Bytes restored from it.
    pub bytes_read: u64,
}

/// The KV path a decode instance negotiated with one prefill peer
/// (`pdserve_core::handoff::kv_path`).
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct KvPathSnapshot {
    /// The peer (its address as the hand-off names it).
    pub peer: String,
    /// `host` or `cuda_ipc`.
    pub path: String,
    /// Why the host path (`other_gpu (rank 0)`, `not_advertised`, ...); empty for CUDA IPC.
    pub reason: String,
}

/// The proxy's own part of a [`ClusterSnapshot`].
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct ProxySnapshot {
    /// The proxy's node name (its member certificate's name).
    pub node: String,
    /// The cluster name every member shares.
    pub cluster: String,
    /// The proxy's HTTP API (`http://host:port`).
    pub url: String,
    /// Where its control plane listens (`pdserve inspect` connects here).
    pub control_addr: String,
    /// Instances registered over the control plane (routable or not).
    pub registered: usize,
    /// Prefill instances requests can be routed to now.
    pub routable_prefill: usize,
    /// Decode instances requests can be routed to now.
    pub routable_decode: usize,
    /// Control connections refused since the proxy started (no or foreign credentials).
    pub refused_connections: u64,
    /// The router: its kind, decisions so far and what its KV index holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterSnapshot>,
    /// The proxy's actors.
    #[rkyv(with = ActorTree)]
    pub actors: ActorSnapshot,
}

/// The proxy's router as `pdserve inspect` shows it.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct RouterSnapshot {
    /// `kv`, `least-loaded` or `round-robin`.
    pub kind: String,
    /// Picks so far by role and reason (`kv_overlap`, `load`, `no_overlap`, ...).
    pub decisions: Vec<RouterDecisions>,
    /// Cached block hashes indexed per instance URL (from its KV events).
    pub kv_index: Vec<IndexedInstance>,
}

/// Router picks of one role for one reason.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct RouterDecisions {
    /// `prefill` or `decode`.
    pub role: String,
    /// Why.
    pub reason: String,
    /// How many.
    pub count: u64,
}

/// What the router's KV index holds of one instance.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    Eq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct IndexedInstance {
    /// The instance's URL.
    pub url: String,
    /// Block hashes indexed.
    pub blocks: usize,
    /// Hashes not indexed because of `proxy.kv_index_max_blocks`.
    pub dropped: u64,
    /// Hashes held at each medium that holds any (`pool`, `host`, `disk`, `shared`; a block
    /// in two counts in both), top down.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_medium: Vec<(String, usize)>,
}

/// What the proxy could learn of one registered instance.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum MemberStatus {
    /// Its live snapshot, fetched over its control connection.
    Snapshot(Box<InstanceSnapshot>),
    /// Why no snapshot could be fetched (connection closed, timeout, bad answer).
    Unreachable(String),
}

/// One registered instance as the proxy sees it. In JSON the status is flattened: a member
/// carries either `"snapshot": {..}` or `"unreachable": "<reason>"`.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct ClusterMember {
    /// Node name it registered under.
    pub node: String,
    /// `prefill`, `decode` or `colocated`.
    pub role: String,
    /// Its HTTP API.
    pub url: String,
    /// Its control-plane address.
    pub control_addr: String,
    /// Whether the proxy routes requests to it now (connected, heartbeats on time, not
    /// draining).
    pub routable: bool,
    /// It is draining: finishing what it runs, taking nothing new (older proxies omit it).
    #[serde(default)]
    pub draining: bool,
    /// Seconds since its last heartbeat (or registration).
    pub last_heartbeat_s: f64,
    /// Its snapshot, or why there is none.
    #[serde(flatten)]
    pub status: MemberStatus,
}

/// A whole cluster as its proxy sees it: the proxy and every registered instance.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Debug,
    PartialEq,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct ClusterSnapshot {
    /// The proxy.
    pub proxy: ProxySnapshot,
    /// Registered instances, in registration order.
    pub instances: Vec<ClusterMember>,
}

/// One actor of a supervision tree flattened for the control plane's wire (see
/// [`ActorTree`]): the tree in pre-order, each node with its depth below the root.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ActorNode {
    /// 0 for the root; a node's children follow it at its depth + 1.
    pub depth: u32,
    /// [`ActorSnapshot::name`].
    pub name: String,
    /// [`ActorSnapshot::kind`].
    pub kind: String,
    /// [`ActorSnapshot::state`].
    pub state: ActorState,
    /// [`ActorSnapshot::restarts`].
    pub restarts: u32,
    /// [`ActorSnapshot::mailbox_depth`].
    pub mailbox_depth: u64,
    /// [`ActorSnapshot::last_error`].
    pub last_error: Option<String>,
    /// [`ActorSnapshot::uptime_s`].
    pub uptime_s: f64,
}

/// Why a flattened actor tree does not describe a tree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorTreeError {
    /// No node at all (a tree has a root).
    #[error("an actor tree without a root")]
    Empty,
    /// Node `at` is at `depth`, which is not the root's 0 for the first node, not below the
    /// root for a later one, or more than one level below the node before it.
    #[error("actor node {at} at depth {depth} does not continue the tree")]
    BadDepth {
        /// Index of the node in pre-order.
        at: usize,
        /// Its depth.
        depth: u32,
    },
}

/// The wire form of an [`ActorSnapshot`] tree (`#[rkyv(with = ActorTree)]`): a flat list of
/// [`ActorNode`]s in pre-order. A tree on the wire is never a recursive archive, so neither
/// validating nor rebuilding a hostile one recurses: its size and depth are checked on the
/// archive before anything is built (`wire::bounds`), and it is rebuilt with a loop.
#[derive(Debug, Clone, Copy)]
pub struct ActorTree;

impl ActorTree {
    /// `root` and everything below it, in pre-order.
    pub fn flatten(root: &ActorSnapshot) -> Vec<ActorNode> {
        let mut out = Vec::new();
        let mut stack = vec![(0u32, root)];
        while let Some((depth, a)) = stack.pop() {
            out.push(ActorNode {
                depth,
                name: a.name.clone(),
                kind: a.kind.clone(),
                state: a.state,
                restarts: a.restarts,
                mailbox_depth: a.mailbox_depth as u64,
                last_error: a.last_error.clone(),
                uptime_s: a.uptime_s,
            });
            stack.extend(a.children.iter().rev().map(|c| (depth + 1, c)));
        }
        out
    }

    /// The tree a pre-order list describes.
    ///
    /// # Errors
    /// [`ActorTreeError`] when the list is empty or its depths do not form one tree.
    pub fn build(
        nodes: impl IntoIterator<Item = ActorNode>,
    ) -> Result<ActorSnapshot, ActorTreeError> {
        // The path from the root to the node last added; a node closes every deeper one.
        let mut path: Vec<ActorSnapshot> = Vec::new();
        for (at, n) in nodes.into_iter().enumerate() {
            let depth = n.depth as usize;
            let fits = if at == 0 {
                depth == 0
            } else {
                depth >= 1 && depth <= path.len()
            };
            if !fits {
                return Err(ActorTreeError::BadDepth { at, depth: n.depth });
            }
            while path.len() > depth {
                close_last(&mut path);
            }
            path.push(ActorSnapshot {
                name: n.name,
                kind: n.kind,
                state: n.state,
                restarts: n.restarts,
                mailbox_depth: usize::try_from(n.mailbox_depth).unwrap_or(usize::MAX),
                last_error: n.last_error,
                uptime_s: n.uptime_s,
                children: Vec::new(),
            });
        }
        while path.len() > 1 {
            close_last(&mut path);
        }
        path.pop().ok_or(ActorTreeError::Empty)
    }
}

/// Moves the last node of `path` into its parent's children.
fn close_last(path: &mut Vec<ActorSnapshot>) {
    if let Some(done) = path.pop() {
        if let Some(parent) = path.last_mut() {
            parent.children.push(done);
        }
    }
}

impl rkyv::with::ArchiveWith<ActorSnapshot> for ActorTree {
    type Archived = rkyv::vec::ArchivedVec<ArchivedActorNode>;
    type Resolver = (usize, rkyv::vec::VecResolver);

    fn resolve_with(_: &ActorSnapshot, resolver: Self::Resolver, out: rkyv::Place<Self::Archived>) {
        rkyv::vec::ArchivedVec::resolve_from_len(resolver.0, resolver.1, out);
    }
}

impl<S> rkyv::with::SerializeWith<ActorSnapshot, S> for ActorTree
where
    S: rkyv::rancor::Fallible + rkyv::ser::Allocator + rkyv::ser::Writer + ?Sized,
    ActorNode: rkyv::Serialize<S, Archived = ArchivedActorNode>,
{
    fn serialize_with(
        field: &ActorSnapshot,
        serializer: &mut S,
    ) -> Result<Self::Resolver, S::Error> {
        let nodes = Self::flatten(field);
        let resolver = rkyv::vec::ArchivedVec::serialize_from_slice(&nodes, serializer)?;
        Ok((nodes.len(), resolver))
    }
}

impl<D> rkyv::with::DeserializeWith<rkyv::vec::ArchivedVec<ArchivedActorNode>, ActorSnapshot, D>
    for ActorTree
where
    D: rkyv::rancor::Fallible + ?Sized,
    D::Error: rkyv::rancor::Source,
    ArchivedActorNode: rkyv::Deserialize<ActorNode, D>,
{
    fn deserialize_with(
        field: &rkyv::vec::ArchivedVec<ArchivedActorNode>,
        deserializer: &mut D,
    ) -> Result<ActorSnapshot, D::Error> {
        let mut nodes = Vec::with_capacity(field.len());
        for n in field.iter() {
            nodes.push(rkyv::Deserialize::deserialize(n, deserializer)?);
        }
        Self::build(nodes).map_err(<D::Error as rkyv::rancor::Source>::new)
    }
}

const ANSI_RESET: &str = "\x1b[0m";
const ANSI_BOLD: &str = "\x1b[1m";
const ANSI_RED: &str = "\x1b[31m";
const ANSI_GREEN: &str = "\x1b[32m";
const ANSI_YELLOW: &str = "\x1b[33m";

/// Draws `snap` as a pstree-like tree: a header line with the instance's figures, then one
/// line per actor (`name [kind] state restarts=N mailbox=N up T`, plus `error: ...` when it
/// has a last error). With `color`, states and errors get ANSI colours.
pub fn render_tree(snap: &InstanceSnapshot, color: bool) -> String {
    let mut out = String::new();
    let (bold, reset) = if color {
        (ANSI_BOLD, ANSI_RESET)
    } else {
        ("", "")
    };
    let _ = writeln!(
        out,
        "{bold}{}{reset} role={} model={} tp={} waiting={} running={} kv_blocks={}/{} free \
         preemptions={} transfers_in_flight={} sent={} received={} transfer_failures={}",
        snap.instance,
        snap.role,
        snap.model,
        snap.tp,
        snap.waiting,
        snap.running,
        snap.kv_blocks_free,
        snap.kv_blocks_total,
        snap.preemptions,
        snap.transfers_in_flight,
        format_bytes(snap.bytes_sent),
        format_bytes(snap.bytes_received),
        snap.transfer_failures,
    );
    let pct = |a: u64, b: u64| {
        if b == 0 {
            0.0
        } else {
            100.0 * a as f64 / b as f64
        }
    };
    let _ = write!(
        out,
        "  prefix_cache hit_rate={:.1}% prompt_tokens={} computed={} cached={} cached_blocks={} evictions={} local_prefills={}",
        pct(snap.prompt_tokens_cached, snap.prompt_tokens),
        snap.prompt_tokens,
        snap.prompt_tokens.saturating_sub(snap.prompt_tokens_cached),
        snap.prompt_tokens_cached,
        snap.kv_blocks_cached,
        snap.cache_evictions,
        snap.local_prefills,
    );
    if snap.handoffs_done > 0 {
        let _ = write!(
            out,
            " handoffs={} kv_per_handoff={} skipped={:.1}%",
            snap.handoffs_done,
            format_bytes(snap.handoff_bytes / snap.handoffs_done),
            pct(
                snap.handoff_bytes_skipped,
                // Figures come from the instance: a sum that overflows must not panic.
                snap.handoff_bytes
                    .saturating_add(snap.handoff_bytes_skipped)
            ),
        );
    }
    out.push('\n');
    for p in &snap.kv_paths {
        let _ = write!(out, "  kv_path {} {}", p.peer, p.path);
        if !p.reason.is_empty() {
            let _ = write!(out, " ({})", p.reason);
        }
        out.push('\n');
    }
    if let Some(e) = &snap.encoder {
        let _ = writeln!(
            out,
            "  encoder cache_images={} cache={} hold_slots={}/{} holds_served={}",
            e.cache_images,
            format_bytes(e.cache_bytes),
            e.hold_slots_used,
            e.hold_slots,
            e.holds_served,
        );
    }
    for t in &snap.kv_tiers {
        let _ = writeln!(
            out,
            "  kv_tier {} blocks={} used={}/{} hits={} misses={} in={} out={}",
            t.tier,
            t.blocks,
            format_bytes(t.bytes),
            format_bytes(t.capacity_bytes),
            t.hits,
            t.misses,
            format_bytes(t.bytes_written),
            format_bytes(t.bytes_read),
        );
    }
    render_actor(&mut out, &snap.actors, "", None, color);
    out
}

/// Draws a whole cluster: a header line with the proxy's figures, the proxy's actor tree,
/// then one branch per registered instance (its registration line, then [`render_tree`] of
/// its snapshot, or `unreachable: <reason>`). With `color`, routing state, actor states and
/// errors get ANSI colours.
pub fn render_cluster(snap: &ClusterSnapshot, color: bool) -> String {
    let (bold, reset, green, red, yellow) = if color {
        (ANSI_BOLD, ANSI_RESET, ANSI_GREEN, ANSI_RED, ANSI_YELLOW)
    } else {
        ("", "", "", "", "")
    };
    let p = &snap.proxy;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cluster {bold}{}{reset} proxy={} http={} control={} registered={} \
         routable_prefill={} routable_decode={} refused_connections={}",
        p.cluster,
        p.node,
        p.url,
        p.control_addr,
        p.registered,
        p.routable_prefill,
        p.routable_decode,
        p.refused_connections,
    );
    if let Some(r) = &p.router {
        let mut line = format!("router {bold}{}{reset}", r.kind);
        if !r.decisions.is_empty() {
            line.push_str(" decisions");
            for d in &r.decisions {
                let _ = write!(line, " {}:{}={}", d.role, d.reason, d.count);
            }
        }
        if !r.kv_index.is_empty() {
            line.push_str(" kv_index_blocks");
            for ix in &r.kv_index {
                let _ = write!(line, " {}={}", ix.url, ix.blocks);
                if ix.by_medium.iter().any(|(m, _)| m != "pool") {
                    let media: Vec<String> = ix
                        .by_medium
                        .iter()
                        .map(|(m, n)| format!("{m}:{n}"))
                        .collect();
                    let _ = write!(line, "[{}]", media.join(" "));
                }
                if ix.dropped > 0 {
                    let _ = write!(line, "(+{} over the bound)", ix.dropped);
                }
            }
        }
        let _ = writeln!(out, "{line}");
    }
    render_actor(&mut out, &p.actors, "", None, color);
    let n = snap.instances.len();
    for (i, m) in snap.instances.iter().enumerate() {
        let last = i + 1 == n;
        let (branch, indent) = if last {
            ("└── ", "    ")
        } else {
            ("├── ", "│   ")
        };
        let routing = if m.routable {
            format!("{green}routable{reset}")
        } else if m.draining {
            format!("{yellow}draining{reset}")
        } else {
            format!("{red}not routable{reset}")
        };
        let _ = writeln!(
            out,
            "{branch}{bold}{}{reset} ({}) {routing} heartbeat {} ago http={} control={}",
            m.node,
            m.role,
            format_uptime(m.last_heartbeat_s),
            m.url,
            m.control_addr,
        );
        match &m.status {
            MemberStatus::Snapshot(s) => {
                for line in render_tree(s, color).lines() {
                    let _ = writeln!(out, "{indent}{line}");
                }
            }
            MemberStatus::Unreachable(reason) => {
                let one_line = reason.replace(['\n', '\r'], " ");
                let _ = writeln!(out, "{indent}{red}unreachable: {one_line}{reset}");
            }
        }
    }
    out
}

/// Appends `actor` and its subtree. `prefix` is the indentation of its children's lines;
/// `is_last` is `None` for the root, else whether it is its parent's last child.
fn render_actor(
    out: &mut String,
    actor: &ActorSnapshot,
    prefix: &str,
    is_last: Option<bool>,
    color: bool,
) {
    let (branch, child_prefix) = match is_last {
        None => ("", String::new()),
        Some(true) => ("└── ", format!("{prefix}    ")),
        Some(false) => ("├── ", format!("{prefix}│   ")),
    };
    let state = if color {
        format!(
            "{}{}{ANSI_RESET}",
            actor.state.ansi_color(),
            actor.state.as_str()
        )
    } else {
        actor.state.as_str().to_string()
    };
    let _ = write!(
        out,
        "{prefix}{branch}{} [{}] {state} restarts={} mailbox={} up {}",
        actor.name,
        actor.kind,
        actor.restarts,
        actor.mailbox_depth,
        format_uptime(actor.uptime_s),
    );
    if let Some(error) = &actor.last_error {
        let one_line = error.replace(['\n', '\r'], " ");
        if color {
            let _ = write!(out, " {ANSI_RED}error: {one_line}{ANSI_RESET}");
        } else {
            let _ = write!(out, " error: {one_line}");
        }
    }
    out.push('\n');
    let n = actor.children.len();
    for (i, child) in actor.children.iter().enumerate() {
        render_actor(out, child, &child_prefix, Some(i + 1 == n), color);
    }
}

/// `512B`, `1.5KiB`, `20.0MiB`, `3.2GiB`.
fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes}B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1}{}", UNITS[unit])
}

/// `12.3s`, `4m05s`, `2h03m`; non-finite or negative shows as `-`.
fn format_uptime(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".into();
    }
    if seconds < 60.0 {
        return format!("{seconds:.1}s");
    }
    let whole = seconds as u64;
    if whole < 3600 {
        format!("{}m{:02}s", whole / 60, whole % 60)
    } else {
        format!("{}h{:02}m", whole / 3600, (whole % 3600) / 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn tracker_restarts_then_escalates_then_forgets() {
        let t0 = Instant::now();
        let mut tracker = RestartTracker::new(RestartPolicy {
            max_restarts: 3,
            within: secs(60),
        });
        assert_eq!(
            tracker.on_failure(t0),
            RestartDecision::Restart { attempt: 1 }
        );
        assert_eq!(
            tracker.on_failure(t0 + secs(10)),
            RestartDecision::Restart { attempt: 2 }
        );
        assert_eq!(
            tracker.on_failure(t0 + secs(20)),
            RestartDecision::Restart { attempt: 3 }
        );
        assert_eq!(
            tracker.on_failure(t0 + secs(30)),
            RestartDecision::Escalate {
                restarts_in_window: 3
            }
        );
        assert_eq!(tracker.total_restarts(), 3);
        // At t0+60 the first restart leaves the window: one slot frees up.
        assert_eq!(
            tracker.on_failure(t0 + secs(60)),
            RestartDecision::Restart { attempt: 3 }
        );
        assert_eq!(
            tracker.on_failure(t0 + secs(61)),
            RestartDecision::Escalate {
                restarts_in_window: 3
            }
        );
        // Long after, everything is forgotten.
        assert_eq!(tracker.restarts_in_window(t0 + secs(1000)), 0);
        assert_eq!(
            tracker.on_failure(t0 + secs(1000)),
            RestartDecision::Restart { attempt: 1 }
        );
        assert_eq!(tracker.total_restarts(), 5);
    }

    #[test]
    fn zero_budget_always_escalates() {
        let mut tracker = RestartTracker::new(RestartPolicy {
            max_restarts: 0,
            within: secs(60),
        });
        assert_eq!(
            tracker.on_failure(Instant::now()),
            RestartDecision::Escalate {
                restarts_in_window: 0
            }
        );
        assert_eq!(tracker.total_restarts(), 0);
    }

    #[test]
    fn default_policy_is_three_in_sixty_seconds() {
        assert_eq!(
            RestartPolicy::default(),
            RestartPolicy {
                max_restarts: 3,
                within: secs(60)
            }
        );
    }

    proptest! {
        /// Against a brute-force model: a failure is restarted exactly when fewer than
        /// `max_restarts` restarts were granted in the preceding window; memory stays bounded.
        #[test]
        fn tracker_matches_sliding_window_model(
            max_restarts in 0u32..5,
            window in 1u64..100,
            gaps in proptest::collection::vec(0u64..60, 1..60),
        ) {
            let t0 = Instant::now();
            let policy = RestartPolicy { max_restarts, within: secs(window) };
            let mut tracker = RestartTracker::new(policy);
            let mut granted: Vec<u64> = Vec::new();
            let mut t = 0;
            for gap in gaps {
                t += gap;
                let in_window = granted.iter().filter(|&&g| t - g < window).count() as u32;
                let decision = tracker.on_failure(t0 + secs(t));
                if in_window < max_restarts {
                    prop_assert_eq!(decision, RestartDecision::Restart { attempt: in_window + 1 });
                    granted.push(t);
                } else {
                    prop_assert_eq!(decision, RestartDecision::Escalate { restarts_in_window: in_window });
                }
                prop_assert!(tracker.recent.len() <= max_restarts as usize);
            }
            prop_assert_eq!(tracker.total_restarts() as usize, granted.len());
        }
    }

    #[test]
    fn epoch_fences_stale_reports() {
        let first = Epoch::INITIAL;
        let second = first.next();
        assert!(second > first);
        assert!(second.accepts(second));
        assert!(!second.accepts(first));
        assert_eq!(second.to_string(), "epoch-1");
    }

    fn actor(
        name: &str,
        kind: &str,
        state: ActorState,
        children: Vec<ActorSnapshot>,
    ) -> ActorSnapshot {
        ActorSnapshot {
            name: name.into(),
            kind: kind.into(),
            state,
            restarts: 0,
            mailbox_depth: 0,
            last_error: None,
            uptime_s: 12.34,
            children,
        }
    }

    fn sample() -> InstanceSnapshot {
        let mut worker1 = actor("tp-worker-1", "TpWorker", ActorState::Restarting, vec![]);
        worker1.restarts = 2;
        worker1.last_error = Some("executor panicked:\nindex out of bounds".into());
        worker1.uptime_s = 0.31;
        let mut scheduler = actor(
            "scheduler",
            "Scheduler",
            ActorState::Running,
            vec![
                actor("tp-worker-0", "TpWorker", ActorState::Running, vec![]),
                worker1,
            ],
        );
        scheduler.mailbox_depth = 3;
        let mut sender = actor("kv-sender", "KvSender", ActorState::Stopped, vec![]);
        sender.uptime_s = 3725.0;
        let root = actor(
            "instance-0",
            "InstanceSupervisor",
            ActorState::Running,
            vec![
                scheduler,
                actor("aggregator", "Aggregator", ActorState::Starting, vec![]),
                sender,
            ],
        );
        InstanceSnapshot {
            instance: "instance-0".into(),
            role: "prefill".into(),
            model: "smollm2-135m".into(),
            tp: 2,
            waiting: 4,
            running: 7,
            kv_blocks_total: 512,
            kv_blocks_free: 300,
            kv_blocks_used: 212,
            preemptions: 1,
            transfers_in_flight: 2,
            bytes_sent: 3 << 20,
            bytes_received: 0,
            transfer_failures: 0,
            kv_blocks_cached: 40,
            prompt_tokens: 1000,
            prompt_tokens_cached: 250,
            cache_evictions: 3,
            local_prefills: 0,
            handoffs_done: 0,
            handoff_bytes: 0,
            handoff_bytes_skipped: 0,
            kv_paths: vec![KvPathSnapshot {
                peer: "http://127.0.0.1:8001".into(),
                path: "host".into(),
                reason: "other_gpu (rank 0)".into(),
            }],
            kv_tiers: vec![TierSnapshot {
                tier: "host".into(),
                blocks: 12,
                bytes: 3 << 20,
                capacity_bytes: 1 << 30,
                hits: 7,
                misses: 1,
                bytes_written: 4 << 20,
                bytes_read: 2 << 20,
            }],
            encoder: None,
            actors: root,
        }
    }

    fn cluster() -> ClusterSnapshot {
        let mut decode = sample();
        decode.instance = "decode-0".into();
        decode.role = "decode".into();
        decode.actors = actor(
            "decode-0",
            "InstanceSupervisor",
            ActorState::Running,
            vec![],
        );
        ClusterSnapshot {
            proxy: ProxySnapshot {
                node: "proxy".into(),
                cluster: "demo".into(),
                url: "http://127.0.0.1:8000".into(),
                control_addr: "127.0.0.1:7000".into(),
                registered: 2,
                routable_prefill: 0,
                routable_decode: 1,
                refused_connections: 3,
                router: Some(RouterSnapshot {
                    kind: "kv".into(),
                    decisions: vec![
                        RouterDecisions {
                            role: "decode".into(),
                            reason: "kv_overlap".into(),
                            count: 12,
                        },
                        RouterDecisions {
                            role: "decode".into(),
                            reason: "no_overlap".into(),
                            count: 3,
                        },
                    ],
                    kv_index: vec![IndexedInstance {
                        url: "http://127.0.0.1:8200".into(),
                        blocks: 40,
                        dropped: 0,
                        by_medium: vec![("pool".into(), 30), ("host".into(), 12)],
                    }],
                }),
                actors: actor("proxy", "Proxy", ActorState::Running, vec![]),
            },
            instances: vec![
                ClusterMember {
                    node: "decode-0".into(),
                    role: "decode".into(),
                    url: "http://127.0.0.1:8200".into(),
                    control_addr: "127.0.0.1:7002".into(),
                    routable: true,
                    draining: false,
                    last_heartbeat_s: 0.2,
                    status: MemberStatus::Snapshot(Box::new(decode)),
                },
                ClusterMember {
                    node: "prefill-0".into(),
                    role: "prefill".into(),
                    url: "http://127.0.0.1:8100".into(),
                    control_addr: "127.0.0.1:7001".into(),
                    routable: false,
                    draining: false,
                    last_heartbeat_s: 75.0,
                    status: MemberStatus::Unreachable("control connection closed\nby peer".into()),
                },
            ],
        }
    }

    #[test]
    fn render_cluster_golden_without_color() {
        let expected = "\
cluster demo proxy=proxy http=http://127.0.0.1:8000 control=127.0.0.1:7000 registered=2 routable_prefill=0 routable_decode=1 refused_connections=3
router kv decisions decode:kv_overlap=12 decode:no_overlap=3 kv_index_blocks http://127.0.0.1:8200=40[pool:30 host:12]
proxy [Proxy] running restarts=0 mailbox=0 up 12.3s
├── decode-0 (decode) routable heartbeat 0.2s ago http=http://127.0.0.1:8200 control=127.0.0.1:7002
│   decode-0 role=decode model=smollm2-135m tp=2 waiting=4 running=7 kv_blocks=300/512 free preemptions=1 transfers_in_flight=2 sent=3.0MiB received=0B transfer_failures=0
│     prefix_cache hit_rate=25.0% prompt_tokens=1000 computed=750 cached=250 cached_blocks=40 evictions=3 local_prefills=0
│     kv_path http://127.0.0.1:8001 host (other_gpu (rank 0))
│     kv_tier host blocks=12 used=3.0MiB/1.0GiB hits=7 misses=1 in=4.0MiB out=2.0MiB
│   decode-0 [InstanceSupervisor] running restarts=0 mailbox=0 up 12.3s
└── prefill-0 (prefill) not routable heartbeat 1m15s ago http=http://127.0.0.1:8100 control=127.0.0.1:7001
    unreachable: control connection closed by peer
";
        let got = render_cluster(&cluster(), false);
        assert_eq!(got, expected, "\n{got}");
        let colored = render_cluster(&cluster(), true);
        assert!(colored.contains("\x1b[32mroutable\x1b[0m"), "{colored}");
        assert!(colored.contains("\x1b[31mnot routable\x1b[0m"), "{colored}");
        assert!(
            colored.contains("\x1b[31munreachable: control"),
            "{colored}"
        );
        // A draining instance says so instead of "not routable".
        let mut draining = cluster();
        draining.instances[0].routable = false;
        draining.instances[0].draining = true;
        let got = render_cluster(&draining, false);
        assert!(
            got.contains("├── decode-0 (decode) draining heartbeat 0.2s ago"),
            "{got}"
        );
        assert!(render_cluster(&draining, true).contains("\x1b[33mdraining\x1b[0m"));
    }

    #[test]
    fn cluster_json_flattens_member_status_and_round_trips() {
        let snap = cluster();
        let v = serde_json::to_value(&snap).unwrap();
        assert_eq!(v["instances"][1]["node"], "prefill-0");
        assert_eq!(
            v["instances"][1]["unreachable"],
            "control connection closed\nby peer"
        );
        assert!(v["instances"][1].get("snapshot").is_none(), "{v}");
        assert_eq!(
            v["instances"][0]["snapshot"]["actors"]["kind"],
            "InstanceSupervisor"
        );
        assert!(v["instances"][0].get("unreachable").is_none(), "{v}");
        let back: ClusterSnapshot = serde_json::from_value(v).unwrap();
        assert_eq!(back, snap);
    }

    #[test]
    fn instance_snapshot_without_the_newer_figures_still_parses() {
        let mut v = serde_json::to_value(sample()).unwrap();
        for key in [
            "kv_blocks_used",
            "preemptions",
            "transfers_in_flight",
            "bytes_sent",
            "bytes_received",
            "transfer_failures",
            "kv_tiers",
        ] {
            v.as_object_mut().unwrap().remove(key);
        }
        let back: InstanceSnapshot = serde_json::from_value(v).unwrap();
        assert_eq!((back.preemptions, back.bytes_sent), (0, 0));
    }

    #[test]
    fn bytes_format() {
        assert_eq!(format_bytes(0), "0B");
        assert_eq!(format_bytes(1023), "1023B");
        assert_eq!(format_bytes(1536), "1.5KiB");
        assert_eq!(format_bytes(5 << 30), "5.0GiB");
    }

    #[test]
    fn render_tree_golden_without_color() {
        let expected = "\
instance-0 role=prefill model=smollm2-135m tp=2 waiting=4 running=7 kv_blocks=300/512 free preemptions=1 transfers_in_flight=2 sent=3.0MiB received=0B transfer_failures=0
  prefix_cache hit_rate=25.0% prompt_tokens=1000 computed=750 cached=250 cached_blocks=40 evictions=3 local_prefills=0
  kv_path http://127.0.0.1:8001 host (other_gpu (rank 0))
  kv_tier host blocks=12 used=3.0MiB/1.0GiB hits=7 misses=1 in=4.0MiB out=2.0MiB
instance-0 [InstanceSupervisor] running restarts=0 mailbox=0 up 12.3s
├── scheduler [Scheduler] running restarts=0 mailbox=3 up 12.3s
│   ├── tp-worker-0 [TpWorker] running restarts=0 mailbox=0 up 12.3s
│   └── tp-worker-1 [TpWorker] restarting restarts=2 mailbox=0 up 0.3s error: executor panicked: index out of bounds
├── aggregator [Aggregator] starting restarts=0 mailbox=0 up 12.3s
└── kv-sender [KvSender] stopped restarts=0 mailbox=0 up 1h02m
";
        let got = render_tree(&sample(), false);
        assert_eq!(got, expected, "\n{got}");
        assert!(!got.contains('\x1b'));
        // An encode instance adds its encoder's line after the KV paths.
        let mut encode = sample();
        encode.encoder = Some(EncoderSnapshot {
            cache_images: 3,
            cache_bytes: 3 << 20,
            hold_slots: 64,
            hold_slots_used: 2,
            holds_served: 9,
        });
        let got = render_tree(&encode, false);
        let line = "  encoder cache_images=3 cache=3.0MiB hold_slots=2/64 holds_served=9\n";
        assert!(
            got.contains(&format!("other_gpu (rank 0))\n{line}  kv_tier")),
            "\n{got}"
        );
    }

    #[test]
    fn render_tree_colors_states_when_asked() {
        let got = render_tree(&sample(), true);
        assert!(got.contains("\x1b[32mrunning\x1b[0m"), "{got}");
        assert!(got.contains("\x1b[33mrestarting\x1b[0m"), "{got}");
        assert!(got.contains("\x1b[31merror: executor panicked"), "{got}");
        // Stripping the escapes gives back the plain rendering.
        let mut stripped = String::new();
        let mut chars = got.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                for c in chars.by_ref() {
                    if c == 'm' {
                        break;
                    }
                }
            } else {
                stripped.push(c);
            }
        }
        assert_eq!(stripped, render_tree(&sample(), false));
    }

    #[test]
    fn snapshot_json_uses_lowercase_states_and_round_trips() {
        let snap = sample();
        let json = serde_json::to_string(&snap).unwrap();
        assert!(json.contains("\"state\":\"restarting\""), "{json}");
        let back: InstanceSnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back, snap);
    }

    #[test]
    fn uptime_formats() {
        assert_eq!(format_uptime(0.0), "0.0s");
        assert_eq!(format_uptime(59.94), "59.9s");
        assert_eq!(format_uptime(61.0), "1m01s");
        assert_eq!(format_uptime(7322.0), "2h02m");
        assert_eq!(format_uptime(f64::NAN), "-");
    }
}
