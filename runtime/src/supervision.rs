//! Supervision's pure core: restart budgets ([`RestartTracker`]), the [`Epoch`] fence for
//! stale reports, and the supervision-tree snapshot that `pdserve inspect` draws
//! ([`InstanceSnapshot`], [`render_tree`]).
//!
//! Nothing here touches tokio or ractor: a supervisor actor feeds the tracker the time of each
//! child failure and acts on the returned [`RestartDecision`]; the snapshot types are plain
//! serde data the actors fill in and the CLI renders.

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
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
    /// The root of the supervision tree.
    pub actors: ActorSnapshot,
}

const ANSI_RESET: &str = "\x1b[0m";
const ANSI_BOLD: &str = "\x1b[1m";
const ANSI_RED: &str = "\x1b[31m";

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
        "{bold}{}{reset} role={} model={} tp={} waiting={} running={} kv_blocks={}/{} free",
        snap.instance,
        snap.role,
        snap.model,
        snap.tp,
        snap.waiting,
        snap.running,
        snap.kv_blocks_free,
        snap.kv_blocks_total,
    );
    render_actor(&mut out, &snap.actors, "", None, color);
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
            actors: root,
        }
    }

    #[test]
    fn render_tree_golden_without_color() {
        let expected = "\
instance-0 role=prefill model=smollm2-135m tp=2 waiting=4 running=7 kv_blocks=300/512 free
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
