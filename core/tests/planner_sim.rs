//! Issue 32's "must show", in simulation: on a trace whose mix shifts from prefill-heavy to
//! decode-heavy and back, and on a multi-turn chat trace with prefix reuse, the planner meets
//! the TTFT p90 and ITL p90 targets in ≥ 95 % of windows with fewer instance-seconds than the
//! best fixed split meeting the same — on the measured SmolLM2-135M CPU curves
//! (configs/planner/smollm2-135m-cpu.toml). Every figure asserted on is computed by the
//! simulator; the runs are deterministic (seeded) and bounded (trace length, event cap).

use pdserve_core::planner::{
    Bounds, CurvesFile, EngineCurves, PlannerConfig, PlannerMode, RoleBounds, SlaTargets, Split,
};
use pdserve_core::simulator::{
    best_fixed_split, multi_turn, shifting_mix, simulate, MultiTurn, SearchRange, ShiftingMix,
    SimConfig, SimReport, Trace,
};

const REQUIRED: f64 = 0.95;

fn curves() -> EngineCurves {
    let text = include_str!("../../configs/planner/smollm2-135m-cpu.toml");
    let file: CurvesFile = toml::from_str(text).expect("the curves file parses");
    EngineCurves::new(file).expect("the curves file is valid")
}

fn base() -> SimConfig {
    SimConfig {
        sla: SlaTargets::default(),
        window_s: 10.0,
        max_events: 200_000_000,
        ..Default::default()
    }
}

fn planner(mode: PlannerMode) -> PlannerConfig {
    PlannerConfig {
        mode,
        bounds: Bounds {
            prefill: RoleBounds { min: 1, max: 64 },
            decode: RoleBounds { min: 1, max: 64 },
            total_max: 128,
        },
        ..Default::default()
    }
}

fn show(name: &str, r: &SimReport) {
    println!(
        "{name}: {}/{} windows within SLA ({:.1} %), {:.0} instance-s (P {:.0}, D {:.0}), \
         TTFT p90 {:.0} ms, ITL p90 {:.1} ms, peak {}, prefix hits {:.0} %, {} events{}",
        r.windows_meeting,
        r.windows.len(),
        r.fraction_meeting() * 100.0,
        r.instance_seconds,
        r.prefill_instance_seconds,
        r.decode_instance_seconds,
        r.ttft_p90_s.unwrap_or(0.0) * 1e3,
        r.itl_p90_s.unwrap_or(0.0) * 1e3,
        r.peak,
        r.prefix_hit_rate * 100.0,
        r.events,
        if r.gave_up { " (gave up)" } else { "" }
    );
}

/// Runs the planner and the fixed-split search on `trace` and checks the claim.
fn planner_beats_best_fixed_split(trace: &Trace, mode: PlannerMode) {
    let c = curves();
    let cfg = SimConfig {
        planner: Some(planner(mode)),
        ..base()
    };
    let planned = simulate(trace, &c, &cfg).unwrap();
    show(&format!("planner ({})", mode.as_str()), &planned);
    for w in planned.windows.iter().filter(|w| !w.meets) {
        println!(
            "  missed window at {:.0} s: TTFT p90 {:?}, ITL p90 {:?}, {} — {}",
            w.start_s, w.ttft_p90_s, w.itl_p90_s, w.split, w.reason
        );
    }
    assert_eq!(
        planned.completed, planned.requests,
        "every request finished"
    );
    let range = SearchRange {
        prefill: (1, 2 * planned.peak.prefill + 2),
        decode: (1, 2 * planned.peak.decode + 2),
    };
    let search = best_fixed_split(trace, &c, &base(), range, REQUIRED).unwrap();
    for (split, r) in &search.runs {
        show(&format!("fixed {split}"), r);
    }
    let (split, fixed) = search
        .best
        .expect("some fixed split in the range meets the SLA");
    println!(
        "best fixed split {split} ({} simulations)",
        search.simulations
    );
    assert!(
        planned.fraction_meeting() >= REQUIRED,
        "planner met the SLA in {:.1} % of windows",
        planned.fraction_meeting() * 100.0
    );
    assert!(fixed.fraction_meeting() >= REQUIRED);
    assert!(
        planned.instance_seconds < fixed.instance_seconds,
        "planner {:.0} instance-s, best fixed split {split} {:.0}",
        planned.instance_seconds,
        fixed.instance_seconds
    );
    // The search's claim checked directly on the split one decode instance smaller.
    if split.decode > 1 {
        let smaller = Split::new(split.prefill, split.decode - 1);
        let r = simulate(
            trace,
            &c,
            &SimConfig {
                initial: Some(smaller),
                ..base()
            },
        )
        .unwrap();
        show(&format!("fixed {smaller}"), &r);
        assert!(
            r.fraction_meeting() < REQUIRED,
            "{smaller} also meets the SLA"
        );
    }
}

#[test]
fn throughput_planner_on_the_shifting_mix() {
    let trace = shifting_mix(&ShiftingMix::default(), 11);
    planner_beats_best_fixed_split(&trace, PlannerMode::Throughput);
}

#[test]
fn throughput_planner_on_the_multi_turn_trace() {
    let trace = multi_turn(&MultiTurn::default(), 12);
    planner_beats_best_fixed_split(&trace, PlannerMode::Throughput);
}

/// Load mode (±1 per window, no profile) does not reach 95 % on these traces (see
/// docs/planner.md for its figures); what is asserted here is that it follows the shift: more
/// decode and fewer prefill instances in the decode-heavy middle than at the prefill-heavy
/// start, every request served, and the bounds held.
#[test]
fn load_planner_follows_the_shifting_mix() {
    let trace = shifting_mix(&ShiftingMix::default(), 13);
    let c = curves();
    let cfg = SimConfig {
        planner: Some(planner(PlannerMode::Load)),
        ..base()
    };
    let r = simulate(&trace, &c, &cfg).unwrap();
    show("planner (load)", &r);
    assert_eq!(r.completed, r.requests);
    let at = |x: f64| r.windows[(x * r.windows.len() as f64) as usize].split;
    let (start, middle) = (at(0.2), at(0.55));
    println!("split at 20 %: {start}, at 55 %: {middle}");
    assert!(middle.decode > start.decode, "{start} -> {middle}");
    assert!(middle.prefill < start.prefill, "{start} -> {middle}");
    assert!(r
        .windows
        .iter()
        .all(|w| (1..=64).contains(&w.split.prefill) && (1..=64).contains(&w.split.decode)));
}
