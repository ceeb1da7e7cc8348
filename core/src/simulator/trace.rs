//! Request traces: what the simulator replays. A trace is a list of requests by arrival time,
//! each with its prompt length (ISL), output length (OSL) and, for multi-turn chats, its
//! session and the prompt tokens it shares with the session's previous turn (reusable from
//! the prefix cache of the prefill instance that served that turn).
//!
//! Traces come from a JSONL file (one request per line, parsed by the caller into
//! [`TraceRequest`]s: `{"t": 0.25, "isl": 180, "osl": 40}` or, in a session,
//! `{"t": 3.1, "isl": 420, "osl": 64, "session": 17, "prefix": 300}`) or from the two
//! generators here, both deterministic for a seed:
//! - [`shifting_mix`]: Poisson arrivals at a constant rate whose mix moves from
//!   prefill-heavy (long prompts, short answers) to decode-heavy (short prompts, long
//!   answers) and back, through linear ramps;
//! - [`multi_turn`]: chat sessions arriving at a rate that rises to a peak mid-trace and falls
//!   back; each session has a few turns separated by think time; turn `k`'s prompt is the
//!   previous prompt, its answer and a new user message, so its `prefix` is the previous
//!   turn's prompt.

use super::rng::Rng;
use serde::{Deserialize, Serialize};

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Arrival, seconds from the trace's start.
    pub t: f64,
    /// Prompt tokens.
    pub isl: u32,
    /// Output tokens (≥ 1; the first comes with the prefill).
    pub osl: u32,
    /// The chat session it belongs to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    /// Prompt tokens shared with the session's previous turn (≤ `isl`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prefix: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// A trace that is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trace request {index}: {message}")]
pub struct TraceError {
    /// Position of the request (0-based).
    pub index: usize,
    /// What is wrong.
    pub message: String,
}

/// Requests sorted by arrival.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    requests: Vec<TraceRequest>,
}

impl Trace {
    /// Checks and sorts `requests`.
    ///
    /// # Errors
    /// A request with a negative or non-finite time, an ISL or OSL of 0, or a prefix
    /// longer than its prompt; an empty trace.
    pub fn new(mut requests: Vec<TraceRequest>) -> Result<Self, TraceError> {
        if requests.is_empty() {
            return Err(TraceError {
                index: 0,
                message: "the trace has no request".into(),
            });
        }
        for (index, r) in requests.iter().enumerate() {
            let message = if !(r.t.is_finite() && r.t >= 0.0) {
                "t must be a finite number of seconds >= 0"
            } else if r.isl == 0 || r.osl == 0 {
                "isl and osl must be >= 1"
            } else if r.prefix > r.isl {
                "prefix is longer than isl"
            } else {
                continue;
            };
            return Err(TraceError {
                index,
                message: message.into(),
            });
        }
        requests.sort_by(|a, b| a.t.total_cmp(&b.t));
        Ok(Self { requests })
    }

    /// The requests, by arrival.
    #[must_use]
    pub fn requests(&self) -> &[TraceRequest] {
        &self.requests
    }

    /// The last arrival.
    #[must_use]
    pub fn last_arrival_s(&self) -> f64 {
        self.requests.last().map_or(0.0, |r| r.t)
    }
}

/// An inclusive range of token counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRange {
    /// Fewest.
    pub lo: u32,
    /// Most.
    pub hi: u32,
}

impl TokenRange {
    fn draw(&self, rng: &mut Rng) -> u32 {
        let (lo, hi) = (self.lo.min(self.hi), self.lo.max(self.hi));
        lo + rng.below(u64::from(hi - lo) + 1) as u32
    }
}

/// The request mix of one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mix {
    /// Prompt tokens.
    pub isl: TokenRange,
    /// Output tokens.
    pub osl: TokenRange,
}

/// Parameters of [`shifting_mix`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShiftingMix {
    /// Seconds of trace.
    pub duration_s: f64,
    /// Requests per second (Poisson).
    pub rate: f64,
    /// The mix at the start and the end.
    pub prefill_heavy: Mix,
    /// The mix in the middle.
    pub decode_heavy: Mix,
}

impl Default for ShiftingMix {
    /// Sized for the SmolLM2-135M CPU curves and TTFT 500 ms / ITL 50 ms: prompts up to 224
    /// tokens (~0.33 s of prefill each on one core), answers up to 320 tokens.
    fn default() -> Self {
        Self {
            duration_s: 1800.0,
            rate: 8.0,
            prefill_heavy: Mix {
                isl: TokenRange { lo: 96, hi: 224 },
                osl: TokenRange { lo: 4, hi: 16 },
            },
            decode_heavy: Mix {
                isl: TokenRange { lo: 16, hi: 48 },
                osl: TokenRange { lo: 128, hi: 320 },
            },
        }
    }
}

/// Share of decode-heavy requests at fraction `x` of the trace: 0 for the first quarter,
/// a ramp to 1 until 40 %, 1 until 60 %, a ramp back to 0 until 75 %, then 0.
#[must_use]
pub fn decode_share(x: f64) -> f64 {
    match x {
        x if x < 0.25 => 0.0,
        x if x < 0.40 => (x - 0.25) / 0.15,
        x if x < 0.60 => 1.0,
        x if x < 0.75 => (0.75 - x) / 0.15,
        _ => 0.0,
    }
}

/// The shifting-mix trace (see the module's doc).
#[must_use]
pub fn shifting_mix(p: &ShiftingMix, seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut requests = Vec::new();
    let mut t = rng.exp(1.0 / p.rate.max(1e-9));
    while t < p.duration_s {
        let mix = if rng.unit() < decode_share(t / p.duration_s) {
            &p.decode_heavy
        } else {
            &p.prefill_heavy
        };
        requests.push(TraceRequest {
            t,
            isl: mix.isl.draw(&mut rng).max(1),
            osl: mix.osl.draw(&mut rng).max(1),
            session: None,
            prefix: 0,
        });
        t += rng.exp(1.0 / p.rate.max(1e-9));
    }
    generated(requests)
}

/// Parameters of [`multi_turn`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultiTurn {
    /// Seconds over which sessions start (their later turns may run past it).
    pub duration_s: f64,
    /// New sessions per second at the peak (mid-trace).
    pub peak_session_rate: f64,
    /// New sessions per second at the start and the end, as a fraction of the peak.
    pub base_fraction: f64,
    /// Turns per session.
    pub turns: TokenRange,
    /// Mean think time between an answer and the next turn, seconds (exponential).
    pub think_s: f64,
    /// System prompt tokens (every first turn).
    pub system: u32,
    /// User message tokens per turn.
    pub user: TokenRange,
    /// Answer tokens per turn.
    pub answer: TokenRange,
}

impl Default for MultiTurn {
    /// Sized for the SmolLM2-135M CPU curves and TTFT 500 ms: a fourth turn's prompt is ~250
    /// tokens (at most 384), which one core recomputes in ~0.4 s when its prefix is not
    /// cached (~0.1 s when it is).
    fn default() -> Self {
        Self {
            duration_s: 1800.0,
            peak_session_rate: 6.0,
            base_fraction: 0.15,
            turns: TokenRange { lo: 2, hi: 4 },
            think_s: 8.0,
            system: 32,
            user: TokenRange { lo: 8, hi: 40 },
            answer: TokenRange { lo: 16, hi: 64 },
        }
    }
}

/// The multi-turn chat trace (see the module's doc).
#[must_use]
pub fn multi_turn(p: &MultiTurn, seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut requests = Vec::new();
    // Sessions start as a non-homogeneous Poisson process, drawn by thinning at the peak
    // rate: rate(x) = peak × (base + (1 − base) × sin²(π x)).
    let peak = p.peak_session_rate.max(1e-9);
    let mut t = 0.0;
    let mut session = 0u64;
    loop {
        t += rng.exp(1.0 / peak);
        if t >= p.duration_s {
            break;
        }
        let x = t / p.duration_s;
        let s = (std::f64::consts::PI * x).sin();
        let share = p.base_fraction + (1.0 - p.base_fraction) * s * s;
        if rng.unit() >= share {
            continue;
        }
        session += 1;
        let turns = p.turns.draw(&mut rng).max(1);
        let mut at = t;
        let mut prev_prompt = 0u32;
        let mut history = p.system;
        for _ in 0..turns {
            let user = p.user.draw(&mut rng);
            let answer = p.answer.draw(&mut rng).max(1);
            let isl = (history + user).max(1);
            requests.push(TraceRequest {
                t: at,
                isl,
                osl: answer,
                session: Some(session),
                prefix: prev_prompt.min(isl),
            });
            prev_prompt = isl;
            history = isl + answer;
            at += rng.exp(p.think_s.max(1e-9));
        }
    }
    generated(requests)
}

/// A generated trace, or one request of one token each way when the parameters generated
/// none (a zero duration or rate): the generators never fail.
fn generated(requests: Vec<TraceRequest>) -> Trace {
    Trace::new(requests).unwrap_or_else(|_| Trace {
        requests: vec![TraceRequest {
            t: 0.0,
            isl: 1,
            osl: 1,
            session: None,
            prefix: 0,
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_for_a_seed_and_differ_between_seeds() {
        let p = ShiftingMix {
            duration_s: 300.0,
            ..Default::default()
        };
        assert_eq!(shifting_mix(&p, 7), shifting_mix(&p, 7));
        assert_ne!(shifting_mix(&p, 7), shifting_mix(&p, 8));
        let m = MultiTurn {
            duration_s: 300.0,
            ..Default::default()
        };
        assert_eq!(multi_turn(&m, 7), multi_turn(&m, 7));
    }

    #[test]
    fn the_mix_shifts_and_shifts_back() {
        let p = ShiftingMix::default();
        let tr = shifting_mix(&p, 1);
        let mean_osl = |lo: f64, hi: f64| {
            let v: Vec<f64> = tr
                .requests()
                .iter()
                .filter(|r| r.t >= lo * p.duration_s && r.t < hi * p.duration_s)
                .map(|r| f64::from(r.osl))
                .collect();
            v.iter().sum::<f64>() / v.len() as f64
        };
        let (start, middle, end) = (mean_osl(0.0, 0.2), mean_osl(0.45, 0.55), mean_osl(0.8, 1.0));
        assert!(
            start < 20.0 && end < 20.0 && middle > 150.0,
            "{start} {middle} {end}"
        );
        // Poisson at 8/s over 1800 s: about 14 400 requests.
        let n = tr.requests().len();
        assert!((13_500..15_300).contains(&n), "{n}");
    }

    #[test]
    fn multi_turn_prompts_grow_and_share_the_previous_prompt() {
        let tr = multi_turn(&MultiTurn::default(), 3);
        let mut last: std::collections::HashMap<u64, TraceRequest> = Default::default();
        let mut follow_ups = 0;
        for r in tr.requests() {
            let s = r.session.unwrap();
            if let Some(prev) = last.get(&s) {
                assert!(r.t > prev.t);
                assert_eq!(r.prefix, prev.isl);
                assert!(r.isl > prev.isl + prev.osl);
                follow_ups += 1;
            } else {
                assert_eq!(r.prefix, 0);
            }
            last.insert(s, *r);
        }
        assert!(follow_ups > 1000, "{follow_ups}");
    }

    #[test]
    fn bad_requests_are_refused_by_index() {
        let ok = TraceRequest {
            t: 1.0,
            isl: 10,
            osl: 5,
            session: None,
            prefix: 0,
        };
        assert!(Trace::new(vec![]).is_err());
        let e = Trace::new(vec![ok, TraceRequest { isl: 0, ..ok }]).unwrap_err();
        assert_eq!(e.index, 1);
        let e = Trace::new(vec![TraceRequest { prefix: 11, ..ok }]).unwrap_err();
        assert!(e.message.contains("prefix"));
        let e = Trace::new(vec![TraceRequest { t: f64::NAN, ..ok }]).unwrap_err();
        assert!(e.message.contains("finite"));
    }
}
