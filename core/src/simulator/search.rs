//! The best fixed split: the fewest instances `P + D`, held for the whole trace, that meet
//! the SLA in the required fraction of windows — the baseline the planner is compared with.
//!
//! Searching every `(P, D)` of a range runs `|P| × |D|` simulations; this search assumes what
//! the model guarantees in practice — more decode instances never raise a TTFT, more prefill
//! instances never raise an ITL, and more of a role never hurts its own target — and runs:
//!
//! 1. `P_floor`: the fewest prefill instances meeting the TTFT target alone with the most
//!    decode instances of the range (binary search);
//! 2. `D_floor`: the fewest decode instances meeting the ITL target alone with the most
//!    prefill instances (binary search);
//! 3. for `P = P_floor, P_floor + 1, …`: the fewest `D ≥ D_floor` meeting both targets,
//!    stopping once `P + D_floor` cannot beat the best total found.
//!
//! Every probe gives up as soon as more windows are known to miss than the required
//! fraction allows, so a split far too small costs little. The joint runs (step 3) are
//! returned for the report, the best among them named.

use super::{simulate, Judge, SimConfig, SimError, SimReport, Trace};
use crate::planner::{EngineCurves, Split};

/// The splits searched: inclusive ranges of each role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SearchRange {
    /// Prefill instances, `(fewest, most)`.
    pub prefill: (usize, usize),
    /// Decode instances, `(fewest, most)`.
    pub decode: (usize, usize),
}

/// The search's result.
#[derive(Debug, Clone)]
pub struct FixedSearch {
    /// Fewest prefill instances meeting TTFT alone (with the most decode instances).
    pub prefill_floor: Option<usize>,
    /// Fewest decode instances meeting ITL alone (with the most prefill instances).
    pub decode_floor: Option<usize>,
    /// Every split run against both targets, in the order run.
    pub runs: Vec<(Split, SimReport)>,
    /// The split with the fewest instances meeting both (then the fewest instance-seconds).
    pub best: Option<(Split, SimReport)>,
    /// Simulations run in all.
    pub simulations: usize,
}

/// Smallest value of `lo..=hi` whose probe passes, assuming passing is monotone; `None` when
/// even `hi` fails.
fn floor(
    lo: usize,
    hi: usize,
    probe: &mut dyn FnMut(usize) -> Result<bool, SimError>,
) -> Result<Option<usize>, SimError> {
    if !probe(hi)? {
        return Ok(None);
    }
    let (mut a, mut b) = (lo, hi);
    while a < b {
        let mid = a + (b - a) / 2;
        if probe(mid)? {
            b = mid;
        } else {
            a = mid + 1;
        }
    }
    Ok(Some(a))
}

/// Most joint simulations of step 3 (a guard; the search normally needs a handful).
const MAX_JOINT_RUNS: usize = 200;

/// Finds the best fixed split of `range` meeting the SLA of `base` in at least `required`
/// of the windows (see the module's doc). `base`'s planner and initial split are ignored.
///
/// # Errors
/// A simulation's error; an empty range.
pub fn best_fixed_split(
    trace: &Trace,
    curves: &EngineCurves,
    base: &SimConfig,
    range: SearchRange,
    required: f64,
) -> Result<FixedSearch, SimError> {
    let (p_lo, p_hi) = range.prefill;
    let (d_lo, d_hi) = range.decode;
    if p_lo == 0 || d_lo == 0 || p_lo > p_hi || d_lo > d_hi {
        return Err(SimError::Config(format!(
            "fixed split range {p_lo}..={p_hi} prefill, {d_lo}..={d_hi} decode: need 1 <= low <= high"
        )));
    }
    let n_windows = (trace.last_arrival_s() / base.window_s).floor() as usize + 1;
    let allowed = ((1.0 - required) * n_windows as f64).floor() as usize;
    let mut sims = 0usize;
    let mut run = |split: Split, judge: Judge| -> Result<SimReport, SimError> {
        sims += 1;
        let cfg = SimConfig {
            planner: None,
            initial: Some(split),
            judge,
            give_up_after_missed: Some(allowed),
            ..base.clone()
        };
        simulate(trace, curves, &cfg)
    };
    let meets = |r: &SimReport| !r.gave_up && r.fraction_meeting() >= required;
    let prefill_floor = floor(p_lo, p_hi, &mut |p| {
        Ok(meets(&run(Split::new(p, d_hi), Judge::Ttft)?))
    })?;
    let decode_floor = floor(d_lo, d_hi, &mut |d| {
        Ok(meets(&run(Split::new(p_hi, d), Judge::Itl)?))
    })?;
    let mut runs = Vec::new();
    let mut best: Option<(Split, SimReport)> = None;
    if let (Some(pf), Some(df)) = (prefill_floor, decode_floor) {
        'outer: for p in pf..=p_hi {
            for d in df..=d_hi {
                let bound = best.as_ref().map_or(usize::MAX, |b| b.0.total());
                if p + d >= bound || runs.len() >= MAX_JOINT_RUNS {
                    if d == df {
                        break 'outer;
                    }
                    break;
                }
                let split = Split::new(p, d);
                let r = run(split, Judge::Both)?;
                let ok = meets(&r);
                runs.push((split, r.clone()));
                if ok {
                    best = Some((split, r));
                    break;
                }
            }
        }
    }
    Ok(FixedSearch {
        prefill_floor,
        decode_floor,
        runs,
        best,
        simulations: sims,
    })
}
