//! A discrete-event simulator of a P/D cluster, to evaluate the [`crate::planner`] at
//! hundreds of instances on one machine. Pure and deterministic: a trace, engine curves and a
//! configuration in, a report out; no clock, no threads, no I/O.
//!
//! **The cluster model** (from measured [`EngineCurves`]):
//! - A request arrives and the router sends it to the prefill instance with the least
//!   outstanding work, counting the prefix cache: an instance holding the request's session
//!   (it served the previous turn) computes only the new tokens. Each prefill instance serves
//!   its queue in order, one prompt at a time, for `T(ISL) − T(cached)` seconds (the prefill
//!   curve). The prefix cache is not bounded; a drained instance's cache is lost.
//! - The KV then moves to the decode instance with the fewest requests (running + waiting),
//!   taking the hand-off curve's time for the prompt's bytes.
//! - A decode instance admits waiting requests at step boundaries while its batch is under
//!   `max_batch` and their whole KV (prompt + output) fits its capacity; the first token
//!   reaches the client on admission (it came with the prefill): **TTFT** = admission −
//!   arrival. Each step takes the decode fit's time for its batch and context, and every
//!   sequence in it produces a token whose **ITL** is that step time.
//! - Scaling up starts an instance that serves after `startup_s`; scaling down drains: the
//!   instance takes no new request and leaves once it has finished what it holds (an instance
//!   still starting is cancelled at once). No request is ever cut.
//! - Instance-seconds count every instance from its start to its leaving (or the end of the
//!   trace's last window).
//!
//! **Windows.** Time is cut into windows of `window_s`. A window meets the SLA when the p90
//! TTFT of the requests that arrived in it and the p90 ITL of the tokens produced in it are
//! within the targets (a window without requests or tokens meets that part). With a planner,
//! each window's end hands it a [`WindowObservation`](crate::planner::WindowObservation) and
//! applies its decision.

mod cluster;
mod rng;
mod search;
mod stats;
mod trace;

pub use rng::Rng;
pub use search::{best_fixed_split, FixedSearch, SearchRange};
pub use stats::{quantile, LogHistogram};
pub use trace::{
    decode_share, multi_turn, shifting_mix, Mix, MultiTurn, ShiftingMix, TokenRange, Trace,
    TraceError, TraceRequest,
};

use crate::planner::{EngineCurves, PlannerConfig, PlannerError, SlaTargets, Split};

/// How to run one simulation.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Targets each window is judged by.
    pub sla: SlaTargets,
    /// Window length in seconds (also the planner's interval).
    pub window_s: f64,
    /// Seconds a new instance takes to serve (defaults to the curves').
    pub startup_s: Option<f64>,
    /// The planner, or `None` for a fixed split.
    pub planner: Option<PlannerConfig>,
    /// Instances at time 0 (all serving). `None`: with a planner, what throughput mode
    /// plans for the trace's first window; without one, 1P1D.
    pub initial: Option<Split>,
    /// Stop early once more than this many windows are known to miss (a search probing a
    /// split that cannot pass); `None` runs to the end.
    pub give_up_after_missed: Option<usize>,
    /// Which parts of the SLA count for a window (both, or one for the search's probes).
    pub judge: Judge,
    /// Most events processed before the run is cut (a guard, far above any real trace).
    pub max_events: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            sla: SlaTargets::default(),
            window_s: 10.0,
            startup_s: None,
            planner: None,
            initial: None,
            give_up_after_missed: None,
            judge: Judge::Both,
            max_events: 2_000_000_000,
        }
    }
}

/// Which targets a window is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judge {
    /// TTFT and ITL.
    Both,
    /// TTFT only.
    Ttft,
    /// ITL only.
    Itl,
}

/// One window's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowReport {
    /// Its start, seconds.
    pub start_s: f64,
    /// Requests that arrived in it.
    pub arrivals: u64,
    /// p90 TTFT of those requests.
    pub ttft_p90_s: Option<f64>,
    /// p90 ITL of the tokens produced in it.
    pub itl_p90_s: Option<f64>,
    /// Whether it met the SLA (as judged).
    pub meets: bool,
    /// Instances (serving or starting, not draining) at its end, after the planner's
    /// decision.
    pub split: Split,
    /// The planner's reason, if one ran.
    pub reason: String,
}

/// A simulation's result.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// Every window up to the trace's last arrival.
    pub windows: Vec<WindowReport>,
    /// Windows meeting the SLA.
    pub windows_meeting: usize,
    /// Instance-seconds over the windows (both roles).
    pub instance_seconds: f64,
    /// Of which prefill.
    pub prefill_instance_seconds: f64,
    /// Of which decode.
    pub decode_instance_seconds: f64,
    /// p90 TTFT over every request.
    pub ttft_p90_s: Option<f64>,
    /// p90 ITL over every token.
    pub itl_p90_s: Option<f64>,
    /// Requests in the trace.
    pub requests: u64,
    /// Requests that finished.
    pub completed: u64,
    /// Most instances of each role at once (not draining).
    pub peak: Split,
    /// Fraction of prompt tokens served from the prefix cache.
    pub prefix_hit_rate: f64,
    /// Whether the run stopped early (`give_up_after_missed`).
    pub gave_up: bool,
    /// Events processed.
    pub events: u64,
}

impl SimReport {
    /// Fraction of windows meeting the SLA.
    #[must_use]
    pub fn fraction_meeting(&self) -> f64 {
        if self.windows.is_empty() {
            1.0
        } else {
            self.windows_meeting as f64 / self.windows.len() as f64
        }
    }
}

/// An error of a simulation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// The planner's configuration or the curves.
    #[error(transparent)]
    Planner(#[from] PlannerError),
    /// A simulation setting out of range.
    #[error("simulation: {0}")]
    Config(String),
    /// The run processed `max_events` events without finishing.
    #[error("simulation: stopped after {0} events without finishing")]
    TooManyEvents(u64),
}

impl SimError {
    /// A stable name for logs.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Planner(e) => e.kind(),
            Self::Config(_) => "sim_config",
            Self::TooManyEvents(_) => "sim_too_many_events",
        }
    }
}

/// Replays `trace` on a cluster built from `curves` (see the module's doc).
///
/// # Errors
/// [`SimError`] for a bad configuration, or a run past `max_events`.
pub fn simulate(
    trace: &Trace,
    curves: &EngineCurves,
    cfg: &SimConfig,
) -> Result<SimReport, SimError> {
    cluster::run(trace, curves, cfg)
}
