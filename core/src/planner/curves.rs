//! Profiled engine curves: what one prefill or decode instance of a model on some hardware
//! does, as measured by `pdserve bench model` (prefill, decode) and the hand-off benchmarks
//! (`benches/handoff_latency.sh`, docs/benchmarks.md). The throughput-mode planner maps
//! forecast load through them to instance counts, and the simulator builds its cluster from
//! them. The file format is TOML (see `configs/planner/` and docs/planner.md); this module
//! holds its serde shape and the models fitted from the points:
//!
//! - **prefill**: tokens/s of a whole prompt of `tokens` tokens (computed in
//!   `max_batched_tokens` chunks, as the scheduler feeds it), interpolated linearly in the
//!   prompt length between measured points and held at the ends. A prompt of `L` tokens of
//!   which `C` are cached costs `T(L) − T(C)`, `T(n) = n / tokens_per_s(n)`: the new tokens
//!   attend to the cached ones, which is what makes long prompts slower per token.
//! - **decode**: one step's time is fitted by least squares as
//!   `a + b·batch + c·(context tokens summed over the batch)` from the measured points
//!   (weights streamed once per step; per-sequence work; attention over each sequence's KV).
//! - **hand-off**: `a + bytes · b`, fitted the same way from (bytes, ms) points.

use super::regression::{fit, LinearFit};
use super::PlannerError;
use serde::Deserialize;

/// One prefill measurement.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrefillPoint {
    /// Prompt tokens.
    pub tokens: u32,
    /// Prompt tokens per second over the whole prompt.
    pub tokens_per_s: f64,
}

/// One decode measurement.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DecodePoint {
    /// Sequences stepped together.
    pub batch: u32,
    /// Tokens already in each sequence's cache (the mean over the timed steps).
    pub context: f64,
    /// Milliseconds per step.
    pub step_ms: f64,
}

/// One hand-off measurement.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HandoffPoint {
    /// KV bytes moved.
    pub bytes: f64,
    /// Milliseconds from the prompt computed to decode's first step.
    pub ms: f64,
}

/// Limits of one instance that are configuration, not measurement.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EngineLimits {
    /// Model the curves were measured on (informational).
    #[serde(default)]
    pub model: String,
    /// Most sequences in a decode batch (`scheduler.max_num_seqs`).
    pub max_batch: u32,
    /// Tokens a decode instance's KV cache holds (`scheduler.kv_cache_bytes` / bytes per
    /// token).
    pub kv_capacity_tokens: u64,
    /// KV bytes per token (what a hand-off moves per prompt token).
    pub kv_bytes_per_token: f64,
    /// Seconds from asking for a new instance to it serving.
    pub startup_s: f64,
}

/// A curves file as written: limits and measured points.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CurvesFile {
    /// The instance's limits.
    pub engine: EngineLimits,
    /// Prefill measurements (at least one).
    pub prefill: Vec<PrefillPoint>,
    /// Decode measurements (at least two, with two distinct batch sizes).
    pub decode: Vec<DecodePoint>,
    /// Hand-off measurements (at least one).
    pub handoff: Vec<HandoffPoint>,
}

/// Curves ready to evaluate: the file's points sorted and its linear models fitted.
#[derive(Debug, Clone)]
pub struct EngineCurves {
    /// The limits, as in the file.
    pub limits: EngineLimits,
    prefill: Vec<PrefillPoint>,
    decode: LinearFit,
    handoff: LinearFit,
}

impl EngineCurves {
    /// Checks the file's points and fits its models.
    ///
    /// # Errors
    /// [`PlannerError::Curves`] naming what is wrong: missing points, non-positive or
    /// non-finite values, decode points that do not determine the batch slope, a fitted
    /// step time that is not positive over the instance's range.
    pub fn new(file: CurvesFile) -> Result<Self, PlannerError> {
        let bad = |m: String| Err(PlannerError::Curves(m));
        let l = &file.engine;
        if l.max_batch == 0 || l.kv_capacity_tokens == 0 {
            return bad("engine.max_batch and engine.kv_capacity_tokens must be > 0".into());
        }
        if !(l.kv_bytes_per_token.is_finite() && l.kv_bytes_per_token > 0.0) {
            return bad("engine.kv_bytes_per_token must be > 0".into());
        }
        if !(l.startup_s.is_finite() && l.startup_s >= 0.0) {
            return bad("engine.startup_s must be >= 0".into());
        }
        if file.prefill.is_empty() {
            return bad("no [[prefill]] point".into());
        }
        if let Some(p) = file
            .prefill
            .iter()
            .find(|p| p.tokens == 0 || !(p.tokens_per_s.is_finite() && p.tokens_per_s > 0.0))
        {
            return bad(format!(
                "prefill point {p:?}: tokens and tokens_per_s must be > 0"
            ));
        }
        let mut prefill = file.prefill.clone();
        prefill.sort_by_key(|p| p.tokens);
        if prefill.windows(2).any(|w| w[0].tokens == w[1].tokens) {
            return bad("two prefill points with the same tokens".into());
        }
        if let Some(p) = file.decode.iter().find(|p| {
            p.batch == 0
                || !(p.context.is_finite() && p.context >= 0.0)
                || !(p.step_ms.is_finite() && p.step_ms > 0.0)
        }) {
            return bad(format!(
                "decode point {p:?}: batch > 0, context >= 0, step_ms > 0"
            ));
        }
        let batches: std::collections::BTreeSet<u32> =
            file.decode.iter().map(|p| p.batch).collect();
        if batches.len() < 2 {
            return bad("decode points need at least two batch sizes".into());
        }
        let decode = fit(&file
            .decode
            .iter()
            .map(|p| {
                let b = f64::from(p.batch);
                (vec![b, b * p.context], p.step_ms / 1e3)
            })
            .collect::<Vec<_>>())
        .ok_or_else(|| PlannerError::Curves("decode points cannot be fitted".into()))?;
        if file.handoff.is_empty() {
            return bad("no [[handoff]] point".into());
        }
        if let Some(p) = file
            .handoff
            .iter()
            .find(|p| !(p.bytes.is_finite() && p.bytes >= 0.0 && p.ms.is_finite() && p.ms >= 0.0))
        {
            return bad(format!("handoff point {p:?}: bytes and ms must be >= 0"));
        }
        let handoff = if file.handoff.len() == 1 {
            // One point: a pure bandwidth line through the origin.
            let p = file.handoff[0];
            LinearFit {
                intercept: 0.0,
                slopes: vec![if p.bytes > 0.0 {
                    p.ms / 1e3 / p.bytes
                } else {
                    0.0
                }],
            }
        } else {
            fit(&file
                .handoff
                .iter()
                .map(|p| (vec![p.bytes], p.ms / 1e3))
                .collect::<Vec<_>>())
            .ok_or_else(|| PlannerError::Curves("handoff points cannot be fitted".into()))?
        };
        let c = Self {
            limits: file.engine,
            prefill,
            decode,
            handoff,
        };
        let max_b = c.limits.max_batch;
        for (b, ctx) in [
            (1, 0.0),
            (max_b, 0.0),
            (1, c.limits.kv_capacity_tokens as f64),
        ] {
            let t = c.decode_step_s(b, ctx);
            if !(t.is_finite() && t > 0.0) {
                return bad(format!(
                    "the decode fit gives {t} s per step at batch {b} with {ctx} context tokens: \
                     the points do not describe a positive step time"
                ));
            }
        }
        if c.handoff_s(0.0) < 0.0 || c.handoff.slopes[0] < 0.0 {
            return bad("the hand-off fit decreases with bytes or starts below 0".into());
        }
        Ok(c)
    }

    /// Prompt tokens per second of a whole `tokens`-token prompt.
    #[must_use]
    pub fn prefill_tokens_per_s(&self, tokens: f64) -> f64 {
        let p = &self.prefill;
        let t = tokens.max(0.0);
        if t <= f64::from(p[0].tokens) {
            return p[0].tokens_per_s;
        }
        for w in p.windows(2) {
            let (x0, x1) = (f64::from(w[0].tokens), f64::from(w[1].tokens));
            if t <= x1 {
                let f = (t - x0) / (x1 - x0);
                return w[0].tokens_per_s + f * (w[1].tokens_per_s - w[0].tokens_per_s);
            }
        }
        p[p.len() - 1].tokens_per_s
    }

    /// Seconds to compute a `tokens`-token prompt from nothing cached.
    #[must_use]
    pub fn prefill_full_s(&self, tokens: f64) -> f64 {
        if tokens <= 0.0 {
            0.0
        } else {
            tokens / self.prefill_tokens_per_s(tokens)
        }
    }

    /// Seconds to compute a `total`-token prompt whose first `cached` tokens are in the
    /// prefix cache: `T(total) − T(cached)`, never negative.
    #[must_use]
    pub fn prefill_s(&self, total: f64, cached: f64) -> f64 {
        let cached = cached.clamp(0.0, total.max(0.0));
        (self.prefill_full_s(total) - self.prefill_full_s(cached)).max(0.0)
    }

    /// Seconds of one decode step of `batch` sequences holding `context_tokens` tokens in
    /// all (summed over the batch).
    #[must_use]
    pub fn decode_step_s(&self, batch: u32, context_tokens: f64) -> f64 {
        let b = f64::from(batch);
        self.decode.predict(&[b, context_tokens])
    }

    /// Seconds of the hand-off of `bytes` KV bytes.
    #[must_use]
    pub fn handoff_s(&self, bytes: f64) -> f64 {
        self.handoff.predict(&[bytes]).max(0.0)
    }

    /// Seconds of the hand-off of a `tokens`-token prompt's KV.
    #[must_use]
    pub fn handoff_tokens_s(&self, tokens: f64) -> f64 {
        self.handoff_s(tokens * self.limits.kv_bytes_per_token)
    }

    /// The decode fit's `(a, b, c)`: step seconds = `a + b·batch + c·context tokens`.
    #[must_use]
    pub fn decode_coefficients(&self) -> (f64, f64, f64) {
        (
            self.decode.intercept,
            self.decode.slopes[0],
            self.decode.slopes[1],
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Curves shaped like the measured SmolLM2 file, for unit tests that must not depend on
    /// a file.
    pub(crate) fn sample() -> EngineCurves {
        EngineCurves::new(CurvesFile {
            engine: EngineLimits {
                model: "test".into(),
                max_batch: 64,
                kv_capacity_tokens: 11_000,
                kv_bytes_per_token: 46_080.0,
                startup_s: 1.0,
            },
            prefill: vec![
                PrefillPoint {
                    tokens: 128,
                    tokens_per_s: 700.0,
                },
                PrefillPoint {
                    tokens: 512,
                    tokens_per_s: 590.0,
                },
                PrefillPoint {
                    tokens: 2048,
                    tokens_per_s: 410.0,
                },
            ],
            decode: vec![
                DecodePoint {
                    batch: 1,
                    context: 32.0,
                    step_ms: 7.3,
                },
                DecodePoint {
                    batch: 8,
                    context: 32.0,
                    step_ms: 27.3,
                },
                DecodePoint {
                    batch: 1,
                    context: 2080.0,
                    step_ms: 21.2,
                },
            ],
            handoff: vec![
                HandoffPoint {
                    bytes: 23_224_320.0,
                    ms: 3.69,
                },
                HandoffPoint {
                    bytes: 46_448_640.0,
                    ms: 5.92,
                },
            ],
        })
        .unwrap()
    }

    #[test]
    fn prefill_interpolates_and_holds_at_the_ends() {
        let c = sample();
        assert_eq!(c.prefill_tokens_per_s(64.0), 700.0);
        assert_eq!(c.prefill_tokens_per_s(4096.0), 410.0);
        assert!((c.prefill_tokens_per_s(320.0) - 645.0).abs() < 1e-9);
        // Cached tokens are cheaper than new ones and nothing is negative.
        assert!(c.prefill_s(512.0, 256.0) < c.prefill_full_s(512.0));
        assert_eq!(c.prefill_s(100.0, 500.0), 0.0);
    }

    #[test]
    fn decode_fit_goes_through_the_points() {
        let c = sample();
        assert!((c.decode_step_s(1, 32.0) - 0.0073).abs() < 1e-6);
        assert!((c.decode_step_s(8, 8.0 * 32.0) - 0.0273).abs() < 1e-6);
        assert!((c.decode_step_s(1, 2080.0) - 0.0212).abs() < 1e-6);
        assert!((c.handoff_s(46_448_640.0) - 0.00592).abs() < 1e-9);
    }

    #[test]
    fn bad_files_are_refused_by_what_is_wrong() {
        let mut f = CurvesFile {
            engine: sample().limits,
            prefill: vec![],
            decode: vec![DecodePoint {
                batch: 1,
                context: 0.0,
                step_ms: 5.0,
            }],
            handoff: vec![HandoffPoint {
                bytes: 1.0,
                ms: 1.0,
            }],
        };
        let e = EngineCurves::new(f.clone()).unwrap_err().to_string();
        assert!(e.contains("prefill"), "{e}");
        f.prefill = vec![PrefillPoint {
            tokens: 128,
            tokens_per_s: 700.0,
        }];
        let e = EngineCurves::new(f.clone()).unwrap_err().to_string();
        assert!(e.contains("two batch sizes"), "{e}");
        f.decode.push(DecodePoint {
            batch: 4,
            context: 0.0,
            step_ms: 1.0,
        });
        // Step time falling with batch: negative at max_batch.
        let e = EngineCurves::new(f).unwrap_err().to_string();
        assert!(e.contains("positive step time"), "{e}");
    }
}
