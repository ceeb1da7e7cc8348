//! Load mode: online regression on the engines' forward-pass figures, ±1 per window.
//!
//! Every window each serving engine contributes one sample (its mean step over the window):
//! prefill `(tokens per step) → step seconds`, decode `(batch, context tokens) → step
//! seconds`. The newest `regression_samples` of each role are fitted by least squares; with
//! too few samples (or a singular fit) an engine's own mean step time stands in.
//!
//! - **Prefill** engine prediction: a prompt of the window's mean uncached length takes `s`
//!   (the fit at that many tokens); its TTFT is `s` plus the backlog ahead of it — the larger
//!   of the requests already waiting (`waiting × s`) and the M/D/1 p90 wait at the engine's
//!   utilisation `u` (busy time / window), `1.15·s·u/(1 − u)` — plus the hand-off, taken as 0
//!   (unknown here; throughput mode has the curve).
//! - **Decode** engine prediction: the step time at its mean batch plus the requests waiting
//!   for it (each bringing the mean context), i.e. the ITL once they are admitted — and at
//!   least the engine's observed p90 step time (scaled by the fit's ratio for another load):
//!   batches swing within a window, and the target is a p90, not a mean.
//!
//! A role goes +1 when any engine's prediction exceeds target × `scale_up_at` (and none of
//! its instances is still starting: their effect is not visible yet). It goes −1 when every
//! engine is below target × `sensitivity` and the prediction with the role's load spread over
//! one instance fewer (batch, context, utilisation and queue × `n/(n−1)`) stays under
//! target × `scale_up_at`.

use super::regression::{fit, LinearFit};
use super::{EngineSample, PlannerConfig, Split, WindowObservation};
use std::collections::VecDeque;

/// Regression samples of both roles.
#[derive(Debug, Clone)]
pub(super) struct LoadState {
    cap: usize,
    prefill: VecDeque<(Vec<f64>, f64)>,
    decode: VecDeque<(Vec<f64>, f64)>,
}

/// Fewest samples before the fit is used.
const MIN_SAMPLES: usize = 4;

fn push(q: &mut VecDeque<(Vec<f64>, f64)>, cap: usize, x: Vec<f64>, y: f64) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back((x, y));
}

fn fitted(q: &VecDeque<(Vec<f64>, f64)>) -> Option<LinearFit> {
    if q.len() < MIN_SAMPLES {
        return None;
    }
    let v: Vec<_> = q.iter().cloned().collect();
    fit(&v)
}

/// Mean step seconds of a sample, if it ran any step.
fn mean_step(e: &EngineSample) -> Option<f64> {
    (e.steps > 0).then(|| e.busy_s / e.steps as f64)
}

impl LoadState {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            cap,
            prefill: VecDeque::new(),
            decode: VecDeque::new(),
        }
    }

    /// Predicted TTFT of one prefill engine with its load scaled by `k`.
    fn prefill_ttft(
        fit: Option<&LinearFit>,
        e: &EngineSample,
        tokens: f64,
        dur: f64,
        k: f64,
    ) -> f64 {
        let own = mean_step(e).map(|m| m / (e.batch_tokens / e.steps as f64).max(1.0) * tokens);
        let s = match (fit, own) {
            (Some(f), _) if f.predict(&[tokens]) > 0.0 => f.predict(&[tokens]),
            (_, Some(o)) => o,
            _ => 0.0,
        };
        let u = (e.busy_s / dur * k).min(0.99);
        let queue = e.waiting as f64 * k;
        s + s * queue.max(1.15 * u / (1.0 - u))
    }

    /// Predicted ITL of one decode engine with its load scaled by `k`.
    fn decode_itl(fit: Option<&LinearFit>, e: &EngineSample, ctx_per_seq: f64, k: f64) -> f64 {
        let (batch, ctx) = if e.steps > 0 {
            let n = e.steps as f64;
            (e.batch_tokens / n, e.context_tokens / n)
        } else {
            (e.running as f64, e.running as f64 * ctx_per_seq)
        };
        let batch_k = (batch + e.waiting as f64) * k;
        let ctx_k = (ctx + e.waiting as f64 * ctx_per_seq) * k;
        let (at_k, at_now) = match (fit, mean_step(e)) {
            (Some(f), _) => (
                f.predict(&[batch_k, ctx_k]).max(0.0),
                f.predict(&[batch, ctx]).max(1e-9),
            ),
            // No fit yet: the engine's own step time, scaled as its batch would be.
            (None, Some(m)) => (m * if batch > 0.0 { batch_k / batch } else { 1.0 }, m),
            (None, None) => (0.0, 1e-9),
        };
        at_k.max(e.p90_step_s * at_k / at_now)
    }

    /// The counts load mode wants, and why.
    pub(super) fn target(
        &mut self,
        cfg: &PlannerConfig,
        obs: &WindowObservation,
    ) -> (Split, String) {
        for e in &obs.prefill {
            if let Some(m) = mean_step(e) {
                push(
                    &mut self.prefill,
                    self.cap,
                    vec![e.batch_tokens / e.steps as f64],
                    m,
                );
            }
        }
        for e in &obs.decode {
            if let Some(m) = mean_step(e) {
                let n = e.steps as f64;
                push(
                    &mut self.decode,
                    self.cap,
                    vec![e.batch_tokens / n, e.context_tokens / n],
                    m,
                );
            }
        }
        let pf = fitted(&self.prefill);
        let df = fitted(&self.decode);
        let tokens = (obs.mean_isl * (1.0 - obs.prefix_hit_rate.clamp(0.0, 1.0))).max(1.0);
        let ctx_per_seq = obs.mean_isl + obs.mean_osl / 2.0;
        let dur = obs.duration_s.max(1e-9);
        let cur = obs.current;

        let ttft = |k: f64| -> Vec<f64> {
            obs.prefill
                .iter()
                .map(|e| Self::prefill_ttft(pf.as_ref(), e, tokens, dur, k))
                .collect()
        };
        let itl = |k: f64| -> Vec<f64> {
            obs.decode
                .iter()
                .map(|e| Self::decode_itl(df.as_ref(), e, ctx_per_seq, k))
                .collect()
        };
        let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        let mean = |v: &[f64]| {
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let step = |n: usize, starting: usize, now: Vec<f64>, fewer: Vec<f64>, target: f64| {
            if max(&now) > target * cfg.scale_up_at {
                if starting > 0 {
                    n
                } else {
                    n + 1
                }
            } else if n > 1
                && max(&now) < target * cfg.sensitivity
                && mean(&fewer) <= target * cfg.scale_up_at
                && max(&fewer) <= target * cfg.scale_up_at
            {
                n - 1
            } else {
                n
            }
        };
        let k = |n: usize| {
            if n > 1 {
                n as f64 / (n - 1) as f64
            } else {
                1.0
            }
        };
        let (t_now, i_now) = (ttft(1.0), itl(1.0));
        let split = Split::new(
            step(
                cur.prefill,
                obs.starting.prefill,
                t_now.clone(),
                ttft(k(cur.prefill)),
                cfg.sla.ttft_s,
            ),
            step(
                cur.decode,
                obs.starting.decode,
                i_now.clone(),
                itl(k(cur.decode)),
                cfg.sla.itl_s,
            ),
        );
        let reason = format!(
            "predicted TTFT max {:.0} ms over {} prefill, ITL max {:.1} ms over {} decode{}",
            max(&t_now) * 1e3,
            obs.prefill.len(),
            max(&i_now) * 1e3,
            obs.decode.len(),
            if pf.is_some() && df.is_some() {
                ""
            } else {
                " (fit warming up)"
            }
        );
        (split, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Planner, PlannerMode};
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> PlannerConfig {
        PlannerConfig {
            mode: PlannerMode::Load,
            scale_down_windows: 1,
            cooldown_windows: 0,
            ..Default::default()
        }
    }

    /// A decode engine stepping `batch` sequences of `ctx` tokens each at the step time of a
    /// linear engine (4 ms + 3 ms per sequence + 5 µs per context token).
    fn decode(batch: f64, ctx: f64, waiting: usize) -> EngineSample {
        let steps = 200;
        let step = 0.004 + 0.003 * batch + 5e-6 * batch * ctx;
        EngineSample {
            steps,
            busy_s: step * steps as f64,
            batch_tokens: batch * steps as f64,
            context_tokens: batch * ctx * steps as f64,
            waiting,
            running: batch as usize,
            ..Default::default()
        }
    }

    fn prefill(util: f64, waiting: usize) -> EngineSample {
        // 0.25 s per 150-token prompt, `util` of a 10 s window busy.
        let steps = ((util * 10.0) / 0.25).round() as u64;
        EngineSample {
            steps,
            busy_s: steps as f64 * 0.25,
            batch_tokens: steps as f64 * 150.0,
            waiting,
            ..Default::default()
        }
    }

    fn obs(p: Vec<EngineSample>, d: Vec<EngineSample>) -> WindowObservation {
        WindowObservation {
            duration_s: 10.0,
            arrivals: 100,
            mean_isl: 150.0,
            p90_isl: 200.0,
            mean_osl: 100.0,
            current: Split::new(p.len(), d.len()),
            prefill: p,
            decode: d,
            ..Default::default()
        }
    }

    #[test]
    fn an_engine_over_target_adds_one_and_only_one() {
        let mut planner = Planner::new(cfg(), None).unwrap();
        // Batches of 20 at 200 context tokens: 4 + 60 + 20 = 84 ms > 50 ms.
        let o = obs(
            vec![prefill(0.3, 0)],
            vec![decode(20.0, 200.0, 0), decode(5.0, 200.0, 0)],
        );
        let d = planner.observe(&o);
        assert_eq!(d.split.decode, 3, "{d:?}");
        // The prefill engine at 30 % utilisation predicts ~0.37 s: unchanged.
        assert_eq!(d.split.prefill, 1, "{d:?}");
    }

    #[test]
    fn no_scale_up_while_an_instance_of_the_role_is_starting() {
        let mut planner = Planner::new(cfg(), None).unwrap();
        let mut o = obs(vec![prefill(0.3, 0)], vec![decode(20.0, 200.0, 0)]);
        o.current.decode = 2;
        o.starting.decode = 1;
        assert_eq!(planner.observe(&o).split.decode, 2);
    }

    #[test]
    fn scale_down_needs_every_engine_below_target_times_sensitivity() {
        let mut planner = Planner::new(cfg(), None).unwrap();
        // One engine at batch 8 of 200 tokens: 4 + 24 + 8 = 36 ms, under 0.9 × 50 ms but
        // above 0.6 × 50 = 30 ms: no scale-down, no scale-up.
        let busy = decode(8.0, 200.0, 0);
        let idle = decode(1.0, 200.0, 0);
        let d = planner.observe(&obs(vec![prefill(0.1, 0)], vec![idle, idle, busy]));
        assert_eq!(d.split.decode, 3, "{d:?}");
        // All light: one fewer (the load of 3 over 2 is still light).
        let mut planner = Planner::new(cfg(), None).unwrap();
        let d = planner.observe(&obs(vec![prefill(0.1, 0)], vec![idle, idle, idle]));
        assert_eq!(d.split.decode, 2, "{d:?}");
    }

    #[test]
    fn scale_down_is_refused_when_the_spread_load_would_miss() {
        let mut planner = Planner::new(cfg(), None).unwrap();
        // Two engines at 5 × 200: 4 + 15 + 5 = 24 ms (< 30); their load on one engine
        // (no fit yet: the own step time scaled by the batch, 48 ms) is over 0.9 × 50: stays.
        let e = decode(5.0, 200.0, 0);
        let d = planner.observe(&obs(vec![prefill(0.1, 0)], vec![e, e]));
        assert_eq!(d.split.decode, 2, "{d:?}");
    }

    #[test]
    fn a_prefill_queue_adds_a_prefill_instance() {
        let mut planner = Planner::new(cfg(), None).unwrap();
        let d = planner.observe(&obs(vec![prefill(0.9, 3)], vec![decode(2.0, 100.0, 0)]));
        assert_eq!(d.split.prefill, 2, "{d:?}");
    }

    proptest! {
        #[test]
        fn load_mode_moves_at_most_one_per_window_and_never_below_min(
            batches in proptest::collection::vec((0.0f64..40.0, 0.0f64..800.0, 0usize..4), 1..8),
            utils in proptest::collection::vec((0.0f64..1.0, 0usize..4), 1..8),
            windows in 1usize..6) {
            let mut planner = Planner::new(cfg(), None).unwrap();
            let mut cur = Split::new(utils.len(), batches.len());
            for _ in 0..windows {
                let mut o = obs(utils.iter().map(|&(u, w)| prefill(u, w)).collect(),
                                batches.iter().map(|&(b, c, w)| decode(b, c, w)).collect());
                o.current = cur;
                let d = planner.observe(&o);
                prop_assert!(d.split.prefill.abs_diff(cur.prefill) <= 1);
                prop_assert!(d.split.decode.abs_diff(cur.decode) <= 1);
                prop_assert!(d.split.prefill >= 1 && d.split.decode >= 1);
                cur = d.split;
            }
        }
    }
}
