//! The SLA planner: how many prefill and decode instances the load needs so that time to
//! first token (TTFT) and inter-token latency (ITL) stay within their targets — the two
//! modes of NVIDIA Dynamo's Planner, as a pure core. Every window the driver (the
//! simulator, or `pdserve launch --planner`) hands [`Planner::observe`] what it saw (a
//! [`WindowObservation`]: arrivals, prompt and output lengths, prefix hits, each engine's
//! step figures and queue) and applies the [`Decision`] it returns. Nothing here waits,
//! spawns or reads a clock: time is the window's length, given.
//!
//! - **Throughput mode** ([`PlannerMode::Throughput`]): forecast the request rate, ISL and OSL
//!   of the window the decision takes effect in (Holt's linear smoothing, [`Holt`], `h` =
//!   one window plus the start-up delay ahead), then map them through the profiled
//!   [`EngineCurves`]: prefill instances = the fewest `c` for which an M/D/c queue of
//!   prompts (service time from the prefill curve, minus prefix hits) keeps the p90 TTFT
//!   (wait + compute + hand-off) under target; decode instances = the concurrency the load
//!   needs (Little's law: rate × output tokens × step time) over the largest batch whose step
//!   time (decode fit at the forecast context) stays under ITL × margin.
//! - **Load mode** ([`PlannerMode::Load`]): no forecast and no profile; each window, an
//!   online least-squares fit of step time on the engines' own forward-pass figures (prefill:
//!   tokens per step; decode: batch size and context tokens) predicts each engine's TTFT and
//!   ITL at its current load (and at least its observed p90 step); a role goes +1 when any
//!   engine's prediction exceeds target × `scale_up_at`, −1 only when every engine is below
//!   target × `sensitivity` and the fit says the load spread over one instance fewer stays
//!   under target × `scale_up_at`.
//!
//! Both modes pass through the same guard: scaling up is immediate; scaling down needs
//! `scale_down_windows` consecutive windows asking for fewer and `cooldown_windows` since
//! the role last changed (hysteresis, so it does not flap), and takes the largest count asked
//! for in those windows. Counts are then clamped to each role's `[min, max]` and the total
//! budget ([`Bounds`]).

mod curves;
mod forecast;
mod load;
mod regression;
mod throughput;

pub use curves::{CurvesFile, DecodePoint, EngineCurves, EngineLimits, HandoffPoint, PrefillPoint};
pub use forecast::Holt;
pub use regression::{fit as least_squares, LinearFit};

/// An error of the planner's configuration or curves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlannerError {
    /// A configuration value out of range (the message names it).
    #[error("planner configuration: {0}")]
    Config(String),
    /// A curves file that cannot describe an engine (the message says why).
    #[error("engine curves: {0}")]
    Curves(String),
}

impl PlannerError {
    /// A stable name for logs and metrics.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Config(_) => "planner_config",
            Self::Curves(_) => "planner_curves",
        }
    }
}

/// Latency targets, in seconds, met at the 90th percentile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlaTargets {
    /// Time to first token.
    pub ttft_s: f64,
    /// Inter-token latency.
    pub itl_s: f64,
}

impl Default for SlaTargets {
    /// Dynamo's defaults: TTFT 500 ms, ITL 50 ms.
    fn default() -> Self {
        Self {
            ttft_s: 0.5,
            itl_s: 0.05,
        }
    }
}

/// Instance counts of the two roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Split {
    /// Prefill instances.
    pub prefill: usize,
    /// Decode instances.
    pub decode: usize,
}

impl Split {
    /// A split of `prefill` and `decode` instances.
    #[must_use]
    pub fn new(prefill: usize, decode: usize) -> Self {
        Self { prefill, decode }
    }

    /// Both roles together.
    #[must_use]
    pub fn total(&self) -> usize {
        self.prefill + self.decode
    }
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}P{}D", self.prefill, self.decode)
    }
}

/// Fewest and most instances of one role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleBounds {
    /// At least this many (≥ 1: a role with no instance serves nothing).
    pub min: usize,
    /// At most this many.
    pub max: usize,
}

/// The counts the planner may choose from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Prefill instances.
    pub prefill: RoleBounds,
    /// Decode instances.
    pub decode: RoleBounds,
    /// Both roles together at most (the budget).
    pub total_max: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            prefill: RoleBounds { min: 1, max: 512 },
            decode: RoleBounds { min: 1, max: 512 },
            total_max: 1024,
        }
    }
}

impl Bounds {
    /// # Errors
    /// [`PlannerError::Config`] when a minimum is 0 or above its maximum, or the minimums
    /// together exceed the budget.
    pub fn validate(&self) -> Result<(), PlannerError> {
        for (name, r) in [("prefill", self.prefill), ("decode", self.decode)] {
            if r.min == 0 || r.min > r.max {
                return Err(PlannerError::Config(format!(
                    "{name} bounds: need 1 <= min <= max, got min {} max {}",
                    r.min, r.max
                )));
            }
        }
        if self.prefill.min + self.decode.min > self.total_max {
            return Err(PlannerError::Config(format!(
                "total budget {} is below the minimums ({} + {})",
                self.total_max, self.prefill.min, self.decode.min
            )));
        }
        Ok(())
    }

    /// `want` clamped into each role's bounds and the budget. Over the budget, the budget is
    /// shared in proportion to what each role asked for (each keeping its minimum).
    ///
    /// # Panics
    /// When a role's `min` exceeds its `max` ([`Bounds::validate`] refuses such bounds).
    #[must_use]
    pub fn clamp(&self, want: Split) -> Split {
        let p = want.prefill.clamp(self.prefill.min, self.prefill.max);
        let d = want.decode.clamp(self.decode.min, self.decode.max);
        if p + d <= self.total_max {
            return Split::new(p, d);
        }
        let share = (self.total_max as f64 * p as f64 / (p + d) as f64).floor() as usize;
        let p_hi = self
            .total_max
            .saturating_sub(self.decode.min)
            .max(self.prefill.min);
        let p = share.clamp(self.prefill.min, p_hi);
        let d = self
            .total_max
            .saturating_sub(p)
            .clamp(self.decode.min, self.decode.max);
        Split::new(
            p.min(self.total_max.saturating_sub(d))
                .max(self.prefill.min),
            d,
        )
    }
}

/// Which of Dynamo's two planners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannerMode {
    /// Forecast the load and map it through profiled curves.
    Throughput,
    /// Online regression on the engines' own figures, ±1 per window.
    Load,
}

impl PlannerMode {
    /// `throughput` or `load`.
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Throughput => "throughput",
            Self::Load => "load",
        }
    }
}

impl std::str::FromStr for PlannerMode {
    type Err = PlannerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "throughput" => Ok(Self::Throughput),
            "load" => Ok(Self::Load),
            other => Err(PlannerError::Config(format!(
                "mode `{other}`: expected throughput or load"
            ))),
        }
    }
}

/// How the planner decides.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannerConfig {
    /// Throughput or load mode.
    pub mode: PlannerMode,
    /// The targets.
    pub sla: SlaTargets,
    /// The counts it may choose from.
    pub bounds: Bounds,
    /// Seconds between decisions (one observation window).
    pub window_s: f64,
    /// Seconds a new instance takes to serve (throughput mode forecasts this far ahead).
    pub startup_s: f64,
    /// Forecaster level weight `α` (throughput mode).
    pub alpha: f64,
    /// Forecaster trend weight `β` (throughput mode, request rate only).
    pub beta: f64,
    /// Highest utilisation a prefill instance is planned at (throughput mode).
    pub prefill_max_utilisation: f64,
    /// Decode batches are planned so that their step time is at most ITL × this (throughput
    /// mode).
    pub itl_margin: f64,
    /// Load mode: scale down only when every engine's prediction is below target × this.
    pub sensitivity: f64,
    /// Load mode: scale up when an engine's prediction exceeds target × this.
    pub scale_up_at: f64,
    /// Consecutive windows asking for fewer instances of a role before it shrinks.
    pub scale_down_windows: u32,
    /// Windows after a role changed before it may shrink again.
    pub cooldown_windows: u32,
    /// Load mode: engine samples kept for the regression (the newest).
    pub regression_samples: usize,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            mode: PlannerMode::Throughput,
            sla: SlaTargets::default(),
            bounds: Bounds::default(),
            window_s: 10.0,
            startup_s: 1.0,
            alpha: 0.6,
            beta: 0.3,
            prefill_max_utilisation: 0.9,
            itl_margin: 0.85,
            sensitivity: 0.6,
            scale_up_at: 0.9,
            scale_down_windows: 2,
            cooldown_windows: 2,
            regression_samples: 256,
        }
    }
}

impl PlannerConfig {
    /// # Errors
    /// [`PlannerError::Config`] naming the first value out of range.
    pub fn validate(&self) -> Result<(), PlannerError> {
        let bad = |m: &str| Err(PlannerError::Config(m.into()));
        self.bounds.validate()?;
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !pos(self.sla.ttft_s) || !pos(self.sla.itl_s) {
            return bad("SLA targets must be > 0");
        }
        if !pos(self.window_s) {
            return bad("window_s must be > 0");
        }
        if !(self.startup_s.is_finite() && self.startup_s >= 0.0) {
            return bad("startup_s must be >= 0");
        }
        if !(0.0..=1.0).contains(&self.alpha) || !(0.0..=1.0).contains(&self.beta) {
            return bad("alpha and beta must be in [0, 1]");
        }
        if !(self.prefill_max_utilisation > 0.0 && self.prefill_max_utilisation < 1.0) {
            return bad("prefill_max_utilisation must be in (0, 1)");
        }
        if !(self.itl_margin > 0.0 && self.itl_margin <= 1.0) {
            return bad("itl_margin must be in (0, 1]");
        }
        if !(self.sensitivity > 0.0 && self.sensitivity <= 1.0) {
            return bad("sensitivity must be in (0, 1]");
        }
        if !(self.scale_up_at > self.sensitivity && self.scale_up_at <= 1.0) {
            return bad("scale_up_at must be in (sensitivity, 1]");
        }
        if self.scale_down_windows == 0 {
            return bad("scale_down_windows must be >= 1");
        }
        if self.regression_samples < 4 {
            return bad("regression_samples must be >= 4");
        }
        Ok(())
    }
}

/// One engine's figures over a window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineSample {
    /// Forward steps it ran (prefill: prompts or prompt chunks; decode: batch steps).
    pub steps: u64,
    /// Seconds those steps took, summed.
    pub busy_s: f64,
    /// Work in those steps, summed: prefill, prompt tokens computed; decode, sequences
    /// stepped (tokens generated).
    pub batch_tokens: f64,
    /// Decode: context tokens of the batch, summed over the steps (0 for prefill).
    pub context_tokens: f64,
    /// Requests waiting for it at the window's end.
    pub waiting: usize,
    /// Prompt tokens those waiting requests still need computed (prefill).
    pub waiting_tokens: f64,
    /// Requests running at the window's end (decode).
    pub running: usize,
    /// 90th percentile of its step times in the window (0 when unknown). For decode this is
    /// its ITL p90.
    pub p90_step_s: f64,
}

/// What the driver saw during one window.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WindowObservation {
    /// The window's length in seconds.
    pub duration_s: f64,
    /// Requests that arrived.
    pub arrivals: u64,
    /// Mean prompt length of those requests (tokens).
    pub mean_isl: f64,
    /// 90th percentile of those prompt lengths.
    pub p90_isl: f64,
    /// Mean output length (tokens) of the requests that finished.
    pub mean_osl: f64,
    /// Prompt tokens served from the prefix cache / prompt tokens, over prefills started.
    pub prefix_hit_rate: f64,
    /// One sample per serving prefill instance.
    pub prefill: Vec<EngineSample>,
    /// One sample per serving decode instance.
    pub decode: Vec<EngineSample>,
    /// Instances of each role now (serving or starting; draining ones excluded).
    pub current: Split,
    /// Of those, instances still starting.
    pub starting: Split,
}

/// The planner's answer for the next window.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The counts to run.
    pub split: Split,
    /// What the mode asked for before hysteresis and bounds.
    pub wanted: Split,
    /// One line on why, for logs.
    pub reason: String,
}

/// Hysteresis of one role.
#[derive(Debug, Clone, Default)]
struct Hysteresis {
    down_streak: u32,
    /// The largest count asked for during the current down streak.
    streak_max: usize,
    since_change: u32,
}

impl Hysteresis {
    fn apply(&mut self, current: usize, wanted: usize, cfg: &PlannerConfig) -> usize {
        self.since_change = self.since_change.saturating_add(1);
        if wanted > current {
            self.down_streak = 0;
            self.since_change = 0;
            return wanted;
        }
        if wanted == current {
            self.down_streak = 0;
            return current;
        }
        self.streak_max = if self.down_streak == 0 {
            wanted
        } else {
            self.streak_max.max(wanted)
        };
        self.down_streak += 1;
        if self.down_streak >= cfg.scale_down_windows && self.since_change >= cfg.cooldown_windows {
            self.down_streak = 0;
            self.since_change = 0;
            return self.streak_max;
        }
        current
    }
}

/// The planner: configuration, forecasters, regression samples and hysteresis state.
#[derive(Debug, Clone)]
pub struct Planner {
    cfg: PlannerConfig,
    curves: Option<EngineCurves>,
    forecast: throughput::Forecasts,
    load: load::LoadState,
    hysteresis: [Hysteresis; 2],
}

impl Planner {
    /// A planner; throughput mode needs `curves`.
    ///
    /// # Errors
    /// [`PlannerError::Config`] for a configuration out of range, or throughput mode
    /// without curves.
    pub fn new(cfg: PlannerConfig, curves: Option<EngineCurves>) -> Result<Self, PlannerError> {
        cfg.validate()?;
        if cfg.mode == PlannerMode::Throughput && curves.is_none() {
            return Err(PlannerError::Config(
                "throughput mode needs engine curves".into(),
            ));
        }
        Ok(Self {
            forecast: throughput::Forecasts::new(&cfg),
            load: load::LoadState::new(cfg.regression_samples),
            cfg,
            curves,
            hysteresis: Default::default(),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// Takes one window's observation and returns the counts for the next.
    pub fn observe(&mut self, obs: &WindowObservation) -> Decision {
        let (wanted, reason) = match (self.cfg.mode, &self.curves) {
            (PlannerMode::Throughput, Some(curves)) => {
                self.forecast.observe(obs);
                throughput::target(&self.cfg, curves, &self.forecast, obs)
            }
            _ => self.load.target(&self.cfg, obs),
        };
        let current = self.cfg.bounds.clamp(obs.current);
        let wanted_b = self.cfg.bounds.clamp(wanted);
        let split = Split::new(
            self.hysteresis[0].apply(current.prefill, wanted_b.prefill, &self.cfg),
            self.hysteresis[1].apply(current.decode, wanted_b.decode, &self.cfg),
        );
        Decision {
            split: self.cfg.bounds.clamp(split),
            wanted,
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bounds(pmin: usize, pmax: usize, dmin: usize, dmax: usize, total: usize) -> Bounds {
        Bounds {
            prefill: RoleBounds {
                min: pmin,
                max: pmax,
            },
            decode: RoleBounds {
                min: dmin,
                max: dmax,
            },
            total_max: total,
        }
    }

    #[test]
    fn bad_bounds_and_config_are_refused_by_name() {
        assert!(bounds(0, 4, 1, 4, 8).validate().is_err());
        assert!(bounds(5, 4, 1, 4, 8).validate().is_err());
        let e = bounds(3, 4, 3, 4, 5).validate().unwrap_err();
        assert!(e.to_string().contains("budget"), "{e}");
        let cfg = PlannerConfig {
            sensitivity: 1.5,
            ..Default::default()
        };
        assert_eq!(cfg.validate().unwrap_err().kind(), "planner_config");
        let e = Planner::new(PlannerConfig::default(), None).unwrap_err();
        assert!(e.to_string().contains("curves"), "{e}");
        assert_eq!("load".parse::<PlannerMode>(), Ok(PlannerMode::Load));
        assert!("fast".parse::<PlannerMode>().is_err());
    }

    #[test]
    fn hysteresis_scales_up_at_once_and_down_after_a_streak() {
        let cfg = PlannerConfig {
            scale_down_windows: 3,
            cooldown_windows: 0,
            ..Default::default()
        };
        let mut h = Hysteresis::default();
        assert_eq!(h.apply(2, 5, &cfg), 5);
        assert_eq!(h.apply(5, 3, &cfg), 5);
        assert_eq!(h.apply(5, 2, &cfg), 5);
        // Third window asking for fewer: the largest of the streak (3).
        assert_eq!(h.apply(5, 2, &cfg), 3);
        // A window at the current count resets the streak.
        assert_eq!(h.apply(3, 1, &cfg), 3);
        assert_eq!(h.apply(3, 3, &cfg), 3);
        assert_eq!(h.apply(3, 1, &cfg), 3);
        assert_eq!(h.apply(3, 1, &cfg), 3);
        assert_eq!(h.apply(3, 1, &cfg), 1);
    }

    #[test]
    fn cooldown_holds_a_role_after_a_change() {
        let cfg = PlannerConfig {
            scale_down_windows: 1,
            cooldown_windows: 3,
            ..Default::default()
        };
        let mut h = Hysteresis::default();
        assert_eq!(h.apply(1, 4, &cfg), 4);
        assert_eq!(h.apply(4, 1, &cfg), 4);
        assert_eq!(h.apply(4, 1, &cfg), 4);
        assert_eq!(h.apply(4, 1, &cfg), 1);
    }

    proptest! {
        #[test]
        fn clamp_respects_every_bound(pmin in 1usize..5, pspan in 0usize..10, dmin in 1usize..5,
                                      dspan in 0usize..10, extra in 0usize..20,
                                      p in 0usize..40, d in 0usize..40) {
            let b = bounds(pmin, pmin + pspan, dmin, dmin + dspan, pmin + dmin + extra);
            let s = b.clamp(Split::new(p, d));
            prop_assert!(s.prefill >= pmin && s.prefill <= pmin + pspan, "{s:?}");
            prop_assert!(s.decode >= dmin && s.decode <= dmin + dspan, "{s:?}");
            prop_assert!(s.total() <= b.total_max, "{s:?}");
            // Within bounds and budget already: unchanged.
            if (pmin..=pmin + pspan).contains(&p) && (dmin..=dmin + dspan).contains(&d)
                && p + d <= b.total_max {
                prop_assert_eq!(s, Split::new(p, d));
            }
        }

        #[test]
        fn hysteresis_never_goes_below_what_it_was_asked_for_in_the_streak(
            wants in proptest::collection::vec(1usize..20, 1..40), down in 1u32..4, cool in 0u32..4) {
            let cfg = PlannerConfig { scale_down_windows: down, cooldown_windows: cool, ..Default::default() };
            let mut h = Hysteresis::default();
            let mut cur = 10;
            let mut streak: Vec<usize> = Vec::new();
            for w in wants {
                let next = h.apply(cur, w, &cfg);
                if w >= cur { streak.clear(); } else { streak.push(w); }
                if w > cur { prop_assert_eq!(next, w); }
                if next < cur {
                    // Only after `down` windows in a row asking for fewer, and never below
                    // the largest of them.
                    prop_assert!(streak.len() >= down as usize);
                    prop_assert_eq!(next, *streak.iter().max().unwrap());
                }
                if next != cur { streak.clear(); }
                cur = next;
            }
        }
    }
}
