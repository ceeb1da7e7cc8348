//! Throughput mode: forecast the load, then size each role from the profiled curves.
//!
//! **Prefill.** A prompt of the forecast ISL (of which `hit` is cached) keeps a prefill
//! instance busy `s = T(ISL) − T(cached)` seconds (the prefill curve); its TTFT adds the
//! hand-off of its KV. With arrivals at rate `λ` spread over `c` instances (the proxy sends
//! each prompt to the instance with the least outstanding work), the queue is taken as M/D/c:
//! the probability of waiting `C` is Erlang's C formula for offered load `a = λ·s`, and the
//! wait is roughly exponential with rate `c/s − λ` (as for M/M/c: prompt lengths vary), so
//! the p90 wait is `max(0, ln(C / 0.1)) / (c/s − λ)`. `λ` is the forecast rate plus
//! `1.3·√(λ/window)`: the 90th percentile of a window's Poisson arrival rate. The plan is the fewest `c` (at
//! utilisation ≤ `prefill_max_utilisation`) whose p90 wait plus the p90 prompt's compute and
//! hand-off stay within the TTFT target. When the p90 prompt alone (nearly) misses it, the
//! wait is still held to a quarter of a prompt's compute.
//!
//! **Decode.** A sequence holds on average `ISL + OSL/2` context tokens; the largest batch `b`
//! whose step time (decode fit) stays within `ITL × itl_margin`, the batch limit and the KV
//! capacity is what one instance can run. Little's law gives the sequences in flight:
//! `N = λ · (OSL − 1) · step(b)`, plus `1.3·√N` of headroom for the Poisson variation of a
//! window (about the 90th percentile); instances = `⌈N / b⌉`, and never fewer than the
//! sequences the decode instances hold now (running and waiting) need: output lengths are
//! only known from finished requests, so a shift towards longer answers shows first there.
//!
//! **Forecasts.** The rate, ISL and OSL are each smoothed with Holt's method; the plan uses,
//! for each, the larger of its level and its forecast `h` windows ahead (`h` = 1 + start-up
//! / window): a rising trend is planned for before it arrives, a falling one is left to the
//! hysteresis of the way down.

use super::{EngineCurves, Holt, PlannerConfig, Split, WindowObservation};

/// The forecasters of the inputs.
#[derive(Debug, Clone)]
pub(super) struct Forecasts {
    rate: Holt,
    isl: Holt,
    p90_isl: Holt,
    osl: Holt,
    hit: Holt,
    last_rate: f64,
}

impl Forecasts {
    pub(super) fn new(cfg: &PlannerConfig) -> Self {
        let holt = || Holt::new(cfg.alpha, cfg.beta);
        Self {
            rate: holt(),
            isl: holt(),
            p90_isl: holt(),
            osl: holt(),
            // The hit rate is planned at its level: a rising one would only lower the plan.
            hit: Holt::new(cfg.alpha, 0.0),
            last_rate: 0.0,
        }
    }

    pub(super) fn observe(&mut self, obs: &WindowObservation) {
        if obs.duration_s > 0.0 {
            let rate = obs.arrivals as f64 / obs.duration_s;
            self.rate.observe(rate);
            self.last_rate = rate;
        }
        if obs.arrivals > 0 {
            self.isl.observe(obs.mean_isl);
            self.p90_isl.observe(obs.p90_isl.max(obs.mean_isl));
            self.hit.observe(obs.prefix_hit_rate.clamp(0.0, 1.0));
        }
        if obs.mean_osl > 0.0 {
            self.osl.observe(obs.mean_osl);
        }
    }
}

/// The load a plan is made for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Load {
    /// Requests per second.
    pub rate: f64,
    /// Mean prompt tokens.
    pub isl: f64,
    /// 90th-percentile prompt tokens.
    pub p90_isl: f64,
    /// Mean output tokens.
    pub osl: f64,
    /// Fraction of prompt tokens cached.
    pub hit: f64,
}

/// Erlang's C formula: the probability that an arrival waits in an M/M/c queue with offered
/// load `a` (< c), through the stable Erlang B recursion.
fn erlang_c(c: usize, a: f64) -> f64 {
    let mut b = 1.0;
    for k in 1..=c {
        b = a * b / (k as f64 + a * b);
    }
    let c = c as f64;
    (c * b / (c - a * (1.0 - b))).clamp(0.0, 1.0)
}

/// Prefill instances for `load` (see the module's doc).
pub(super) fn prefill_count(cfg: &PlannerConfig, curves: &EngineCurves, load: &Load) -> usize {
    if load.rate <= 0.0 {
        return 0;
    }
    let s = curves.prefill_s(load.isl, load.isl * load.hit).max(1e-6);
    let s90 = curves.prefill_s(load.p90_isl, load.p90_isl * load.hit)
        + curves.handoff_tokens_s(load.p90_isl);
    let a = load.rate * s;
    let first = (a / cfg.prefill_max_utilisation).ceil().max(1.0) as usize;
    // When the p90 prompt alone nearly misses the target, the queue still gets a quarter of
    // a prompt's time: continuous in the load, so the count stays monotone in it.
    let budget = (cfg.sla.ttft_s - s90).max(0.25 * s);
    // The wait falls as c grows; a bounded scan (the planner's own maximum) finds the first
    // c that fits.
    let cap = cfg.bounds.prefill.max.max(first);
    for c in first..=cap {
        let spare = c as f64 / s - load.rate;
        if spare <= 0.0 {
            continue;
        }
        let p_wait = erlang_c(c, a);
        let w90 = if p_wait <= 0.1 {
            0.0
        } else {
            (p_wait / 0.1).ln() / spare
        };
        if w90 <= budget {
            return c;
        }
    }
    cap
}

/// Decode instances for `load`, holding at least `in_flight_now` sequences (see the module's
/// doc).
pub(super) fn decode_count(
    cfg: &PlannerConfig,
    curves: &EngineCurves,
    load: &Load,
    in_flight_now: f64,
) -> usize {
    if (load.rate <= 0.0 || load.osl <= 1.0) && in_flight_now <= 0.0 {
        return 0;
    }
    let (a, b1, c1) = curves.decode_coefficients();
    let ctx = load.isl + load.osl / 2.0;
    let per_seq = b1 + c1 * ctx;
    let target = cfg.sla.itl_s * cfg.itl_margin;
    let by_itl = if per_seq > 0.0 {
        ((target - a) / per_seq).floor()
    } else {
        f64::from(curves.limits.max_batch)
    };
    let by_kv = (curves.limits.kv_capacity_tokens as f64 / (load.isl + load.osl)).floor();
    let batch = by_itl
        .min(by_kv)
        .min(f64::from(curves.limits.max_batch))
        .max(1.0);
    let step = a + batch * per_seq;
    let in_flight = load.rate * (load.osl - 1.0).max(0.0) * step;
    let in_flight = (in_flight + 1.3 * in_flight.sqrt()).max(in_flight_now);
    (in_flight / batch).ceil().max(1.0) as usize
}

/// The counts throughput mode wants, and why.
pub(super) fn target(
    cfg: &PlannerConfig,
    curves: &EngineCurves,
    f: &Forecasts,
    obs: &WindowObservation,
) -> (Split, String) {
    let h = 1.0 + cfg.startup_s / cfg.window_s;
    // A falling forecast is not trusted below the level (or, for the rate, below what the
    // last window saw): hysteresis handles the way down.
    let ahead = |s: &Holt, fallback: f64| {
        s.forecast(h)
            .unwrap_or(fallback)
            .max(s.forecast(0.0).unwrap_or(fallback))
    };
    let rate = ahead(&f.rate, 0.0).max(f.last_rate);
    let rate = rate + 1.3 * (rate / cfg.window_s).sqrt();
    let isl = ahead(&f.isl, obs.mean_isl);
    let load = Load {
        rate,
        isl,
        p90_isl: ahead(&f.p90_isl, isl).max(isl),
        osl: ahead(&f.osl, obs.mean_osl),
        hit: f.hit.forecast(0.0).unwrap_or(0.0).min(1.0),
    };
    let in_flight_now: f64 = obs
        .decode
        .iter()
        .map(|e| (e.running + e.waiting) as f64)
        .sum();
    let split = Split::new(
        prefill_count(cfg, curves, &load),
        decode_count(cfg, curves, &load, in_flight_now),
    );
    let reason = format!(
        "forecast {:.2} req/s, ISL {:.0} (p90 {:.0}), OSL {:.0}, prefix hits {:.0}%",
        load.rate,
        load.isl,
        load.p90_isl,
        load.osl,
        load.hit * 100.0
    );
    (split, reason)
}

#[cfg(test)]
mod tests {
    use super::super::curves::tests::sample;
    use super::*;
    use proptest::prelude::*;

    fn load(rate: f64, isl: f64, osl: f64) -> Load {
        Load {
            rate,
            isl,
            p90_isl: isl * 1.3,
            osl,
            hit: 0.0,
        }
    }

    #[test]
    fn erlang_c_matches_known_values() {
        // One server: P(wait) = utilisation.
        assert!((erlang_c(1, 0.7) - 0.7).abs() < 1e-12);
        // Two servers, a = 1: C = 1/3.
        assert!((erlang_c(2, 1.0) - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn no_load_needs_nothing_and_some_load_needs_some() {
        let cfg = PlannerConfig::default();
        let c = sample();
        assert_eq!(prefill_count(&cfg, &c, &load(0.0, 100.0, 50.0)), 0);
        assert_eq!(decode_count(&cfg, &c, &load(0.0, 100.0, 50.0), 0.0), 0);
        assert!(prefill_count(&cfg, &c, &load(5.0, 150.0, 50.0)) >= 1);
        assert!(decode_count(&cfg, &c, &load(5.0, 150.0, 50.0), 0.0) >= 1);
    }

    #[test]
    fn the_plan_meets_the_model_it_plans_with() {
        // The chosen prefill count's utilisation is under the cap, and its decode batch's
        // step time under the ITL target.
        let cfg = PlannerConfig::default();
        let c = sample();
        let l = load(20.0, 150.0, 100.0);
        let p = prefill_count(&cfg, &c, &l);
        let s = c.prefill_s(150.0, 0.0);
        assert!(20.0 * s / p as f64 <= cfg.prefill_max_utilisation);
        let d = decode_count(&cfg, &c, &l, 0.0);
        // Sequences already in flight are never left without a batch.
        assert!(decode_count(&cfg, &c, &l, 400.0) >= 400 / 64);
        // 20 req/s × 99 steps at ~40 ms is ~80 sequences in flight, ~10 per instance.
        assert!((5..=20).contains(&d), "{d}");
    }

    proptest! {
        #[test]
        fn counts_are_monotone_in_load(r1 in 0.1f64..50.0, dr in 0.0f64..50.0,
                                       isl in 16.0f64..300.0, disl in 0.0f64..200.0,
                                       osl in 2.0f64..400.0, dosl in 0.0f64..200.0) {
            let cfg = PlannerConfig::default();
            let c = sample();
            let lo = load(r1, isl, osl);
            let hi = load(r1 + dr, isl + disl, osl + dosl);
            prop_assert!(prefill_count(&cfg, &c, &lo) <= prefill_count(&cfg, &c, &hi));
            // Decode in rate and OSL at a fixed prompt (a longer prompt also shrinks the
            // batch, which only adds instances).
            let hi_d = load(r1 + dr, isl + disl, osl + dosl);
            prop_assert!(decode_count(&cfg, &c, &lo, 0.0) <= decode_count(&cfg, &c, &hi_d, 0.0));
        }

        #[test]
        fn prefix_hits_never_add_prefill_instances(r in 0.1f64..50.0, isl in 16.0f64..2000.0,
                                                   hit in 0.0f64..1.0) {
            let cfg = PlannerConfig::default();
            let c = sample();
            let cold = load(r, isl, 50.0);
            let warm = Load { hit, ..cold };
            prop_assert!(prefill_count(&cfg, &c, &warm) <= prefill_count(&cfg, &c, &cold));
        }
    }
}
