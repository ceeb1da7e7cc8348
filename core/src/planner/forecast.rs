//! The throughput-mode forecaster: Holt's linear exponential smoothing (double exponential
//! smoothing). Each observation `x` updates a level `ℓ` and a trend `τ` (per window):
//!
//! ```text
//! ℓ' = α·x + (1 − α)·(ℓ + τ)
//! τ' = β·(ℓ' − ℓ) + (1 − β)·τ
//! forecast(h) = ℓ' + h·τ'
//! ```
//!
//! `α` weighs the newest window against the history, `β` how fast the trend follows changes
//! in the level. With `β = 0` (and a zero initial trend) it is simple exponential smoothing;
//! with `α = 1, β = 0` it is "the last value". A ramp is followed without the lag simple
//! smoothing has, which is what a planner whose new instances take a while to start needs:
//! it forecasts `h` windows ahead, the window it is deciding for plus the start-up delay.
//! The forecast of a non-negative series is clamped at 0.

/// Holt's linear smoothing of one series.
#[derive(Debug, Clone)]
pub struct Holt {
    alpha: f64,
    beta: f64,
    state: Option<(f64, f64)>,
}

impl Holt {
    /// A smoother with weights `alpha`, `beta` (each clamped into `[0, 1]`).
    #[must_use]
    pub fn new(alpha: f64, beta: f64) -> Self {
        Self {
            alpha: alpha.clamp(0.0, 1.0),
            beta: beta.clamp(0.0, 1.0),
            state: None,
        }
    }

    /// Takes one window's value (non-finite values are ignored).
    pub fn observe(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        self.state = Some(match self.state {
            None => (x, 0.0),
            Some((level, trend)) => {
                let l = self.alpha * x + (1.0 - self.alpha) * (level + trend);
                let t = self.beta * (l - level) + (1.0 - self.beta) * trend;
                (l, t)
            }
        });
    }

    /// The value `h` windows ahead, at least 0; `None` before any observation.
    #[must_use]
    pub fn forecast(&self, h: f64) -> Option<f64> {
        self.state.map(|(l, t)| (l + h * t).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn last_value_and_constant_series() {
        let mut h = Holt::new(1.0, 0.0);
        assert_eq!(h.forecast(1.0), None);
        for x in [3.0, 9.0, 4.0] {
            h.observe(x);
        }
        assert_eq!(h.forecast(1.0), Some(4.0));
        let mut h = Holt::new(0.5, 0.3);
        for _ in 0..50 {
            h.observe(7.0);
        }
        assert!((h.forecast(3.0).unwrap() - 7.0).abs() < 1e-9);
    }

    #[test]
    fn a_ramp_is_followed_ahead() {
        let mut h = Holt::new(0.5, 0.5);
        for k in 0..40 {
            h.observe(10.0 + 2.0 * f64::from(k));
        }
        // Last value 88; two windows ahead the ramp is at 92.
        let f = h.forecast(2.0).unwrap();
        assert!((f - 92.0).abs() < 0.5, "{f}");
    }

    proptest! {
        #[test]
        fn forecasts_are_never_negative(xs in proptest::collection::vec(0.0f64..1e4, 1..40),
                                        a in 0.0f64..1.0, b in 0.0f64..1.0, h in 0.0f64..10.0) {
            let mut s = Holt::new(a, b);
            for x in &xs { s.observe(*x); }
            prop_assert!(s.forecast(h).unwrap() >= 0.0);
        }
    }
}
