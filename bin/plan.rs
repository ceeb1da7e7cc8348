//! `pdserve plan`: the SLA planner offline (docs/planner.md).
//!
//! - `pdserve plan simulate --curves FILE --trace KIND|FILE`: replays a trace on a simulated
//!   cluster built from engine curves, once with the planner and once for each fixed P/D split
//!   the search needs, and prints the planner beside the best fixed split meeting the SLA.
//! - `pdserve plan trace KIND`: writes a generated trace as JSONL (the format `--trace FILE`
//!   reads), to inspect it or to edit it.
//! - `pdserve plan watch --control ADDR --proxy URL --credentials-dir DIR`: the planner on a
//!   running cluster (the driver of `pdserve launch --planner`, `planner_driver.rs`), printing
//!   its advice each window and, with `--etcd-endpoint`, putting it in etcd for whoever
//!   scales the deployment.
//!
//! `simulate` and `trace` run in this process, single-threaded and deterministic for a seed;
//! the planner and the simulator are `pdserve_core::planner` and `pdserve_core::simulator`.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use pdserve_core::planner::{Bounds, PlannerConfig, PlannerMode, RoleBounds, SlaTargets};
use pdserve_core::simulator::{
    best_fixed_split, multi_turn, shifting_mix, simulate, MultiTurn, SearchRange, ShiftingMix,
    SimConfig, SimReport, Trace, TraceRequest,
};
use std::io::Write;
use std::path::{Path, PathBuf};

/// `pdserve plan` subcommands.
#[derive(Subcommand, Debug)]
pub enum PlanCommand {
    /// Replay a trace on a simulated cluster: the planner against the best fixed P/D split.
    Simulate(Box<SimulateArgs>),
    /// Write a generated trace (`shifting` or `multi-turn`) as JSONL to stdout.
    Trace(TraceArgs),
    /// Run the planner against a running cluster and print its advice each window (one JSON
    /// line), also putting it in etcd with `--etcd-endpoint`: for deployments scaled by
    /// someone else (Kubernetes, an operator). `pdserve launch --planner` acts instead.
    Watch(Box<WatchArgs>),
}

/// `pdserve plan watch` flags.
#[derive(Args, Debug)]
pub struct WatchArgs {
    /// The proxy's control address (`IP:port`, UDP).
    #[arg(long)]
    control: String,
    /// The proxy's HTTP URL (its `/metrics`).
    #[arg(long)]
    proxy: String,
    /// Cluster credentials directory (`pdserve cluster init`).
    #[arg(long)]
    credentials_dir: PathBuf,
    /// The member to connect as.
    #[arg(long, default_value = "inspect")]
    node: String,
    /// etcd client URL (repeatable): put each window's advice at
    /// `PREFIX/CLUSTER/planner/recommendation`, under a lease of three windows.
    #[arg(long = "etcd-endpoint")]
    etcd: Vec<String>,
    /// The etcd key prefix (the members' `discovery.etcd_prefix`).
    #[arg(long, default_value = "/pdserve")]
    etcd_prefix: String,
    /// Stop after this many windows (default: until stopped).
    #[arg(long)]
    windows: Option<u64>,
    /// Bearer token of the instances' and proxy's `/metrics` (their API key).
    #[arg(long)]
    api_key: Option<String>,
    #[command(flatten)]
    planner: crate::planner_driver::PlannerArgs,
}

/// The generated traces' knobs, shared by `simulate` and `trace`.
#[derive(Args, Debug, Clone)]
pub struct TraceKnobs {
    /// Seed of the trace generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds of generated trace.
    #[arg(long, default_value_t = 1800.0)]
    duration_s: f64,
    /// `shifting`: requests per second (Poisson).
    #[arg(long, default_value_t = 8.0)]
    rate: f64,
    /// `multi-turn`: new sessions per second at the mid-trace peak.
    #[arg(long, default_value_t = 6.0)]
    session_rate: f64,
}

impl TraceKnobs {
    /// The trace `kind` names (`shifting`, `multi-turn`), or the JSONL file at that path.
    fn load(&self, kind: &str) -> Result<Trace> {
        match kind {
            "shifting" => Ok(shifting_mix(
                &ShiftingMix {
                    duration_s: self.duration_s,
                    rate: self.rate,
                    ..Default::default()
                },
                self.seed,
            )),
            "multi-turn" => Ok(multi_turn(
                &MultiTurn {
                    duration_s: self.duration_s,
                    peak_session_rate: self.session_rate,
                    ..Default::default()
                },
                self.seed,
            )),
            path => read_trace(Path::new(path)),
        }
    }
}

/// `pdserve plan trace` flags.
#[derive(Args, Debug)]
pub struct TraceArgs {
    /// `shifting` or `multi-turn`.
    kind: String,
    #[command(flatten)]
    knobs: TraceKnobs,
}

/// `pdserve plan simulate` flags.
#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Engine curves (TOML), e.g. configs/planner/smollm2-135m-cpu.toml.
    #[arg(long)]
    curves: PathBuf,
    /// `shifting`, `multi-turn`, or a JSONL trace file (one `{"t", "isl", "osl"[, "session",
    /// "prefix"]}` per line).
    #[arg(long)]
    trace: String,
    #[command(flatten)]
    knobs: TraceKnobs,
    /// TTFT target (p90), milliseconds.
    #[arg(long, default_value_t = 500.0)]
    ttft_ms: f64,
    /// ITL target (p90), milliseconds.
    #[arg(long, default_value_t = 50.0)]
    itl_ms: f64,
    /// Planner mode: throughput (forecast + curves) or load (online regression, ±1).
    #[arg(long, default_value = "throughput")]
    mode: String,
    /// Seconds per window (the planner's interval and the SLA's unit).
    #[arg(long, default_value_t = 10.0)]
    window_s: f64,
    /// Seconds a new instance takes to serve (default: the curves file's `startup_s`).
    #[arg(long)]
    startup_s: Option<f64>,
    /// Fraction of windows that must meet the SLA for a fixed split to count.
    #[arg(long, default_value_t = 0.95)]
    required: f64,
    /// Fewest prefill instances the planner may run.
    #[arg(long, default_value_t = 1)]
    min_prefill: usize,
    /// Most prefill instances the planner may run.
    #[arg(long, default_value_t = 512)]
    max_prefill: usize,
    /// Fewest decode instances the planner may run.
    #[arg(long, default_value_t = 1)]
    min_decode: usize,
    /// Most decode instances the planner may run.
    #[arg(long, default_value_t = 512)]
    max_decode: usize,
    /// Most instances in all.
    #[arg(long, default_value_t = 1024)]
    max_total: usize,
    /// Fixed splits searched, prefill `LO:HI` (default 1 to twice the planner's peak + 2).
    #[arg(long)]
    fixed_prefill: Option<String>,
    /// Fixed splits searched, decode `LO:HI` (default 1 to twice the planner's peak + 2).
    #[arg(long)]
    fixed_decode: Option<String>,
    /// Also print every window of the planner's run.
    #[arg(long)]
    windows: bool,
}

/// Reads a JSONL trace (blank lines and lines starting with `#` are skipped).
fn read_trace(path: &Path) -> Result<Trace> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut requests = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let r: TraceRequest = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a trace request", path.display(), n + 1))?;
        requests.push(r);
    }
    Trace::new(requests).with_context(|| format!("trace {}", path.display()))
}

pub use crate::planner_driver::read_curves;

fn range(flag: &str, v: Option<&str>, default: (usize, usize)) -> Result<(usize, usize)> {
    let Some(v) = v else { return Ok(default) };
    let (lo, hi) = v
        .split_once(':')
        .with_context(|| format!("--{flag}: expected LO:HI, got `{v}`"))?;
    let lo: usize = lo.parse().with_context(|| format!("--{flag}: `{lo}`"))?;
    let hi: usize = hi.parse().with_context(|| format!("--{flag}: `{hi}`"))?;
    if lo == 0 || lo > hi {
        bail!("--{flag}: need 1 <= LO <= HI, got {lo}:{hi}");
    }
    Ok((lo, hi))
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.1} ms", s * 1e3))
}

fn row(name: &str, r: &SimReport) -> String {
    format!(
        "{name:<28} {:>4}/{:<4} ({:>5.1} %) {:>12.0} {:>11} {:>10} {:>7}",
        r.windows_meeting,
        r.windows.len(),
        r.fraction_meeting() * 100.0,
        r.instance_seconds,
        ms(r.ttft_p90_s),
        ms(r.itl_p90_s),
        r.peak.to_string()
    )
}

/// Runs `pdserve plan`.
///
/// # Errors
/// Bad flags, unreadable files, a simulation error.
pub fn run(cmd: PlanCommand) -> Result<()> {
    match cmd {
        PlanCommand::Trace(a) => {
            let trace = a.knobs.load(&a.kind)?;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            for r in trace.requests() {
                serde_json::to_writer(&mut out, r)?;
                writeln!(out)?;
            }
            out.flush()?;
            Ok(())
        }
        PlanCommand::Simulate(a) => simulate_cmd(&a),
        PlanCommand::Watch(a) => watch_cmd(*a),
    }
}

fn watch_cmd(mut a: WatchArgs) -> Result<()> {
    a.planner.planner.get_or_insert_with(|| "throughput".into());
    let planner = a.planner.planner()?.context("--planner")?;
    let control: std::net::SocketAddr = a
        .control
        .parse()
        .with_context(|| format!("--control `{}`: expected IP:port", a.control))?;
    let creds =
        pdserve_transport::control::tls::MemberCredentials::load(&a.credentials_dir, &a.node)
            .with_context(|| format!("member `{}` in {}", a.node, a.credentials_dir.display()))?;
    let etcd = (!a.etcd.is_empty())
        .then(|| {
            let cfg = pdserve_runtime::config::DiscoveryConfig {
                etcd_prefix: a.etcd_prefix.clone(),
                ..pdserve_runtime::config::DiscoveryConfig::etcd(a.etcd.clone())
            };
            if let Some((key, message)) = cfg.invalid("etcd") {
                bail!(
                    "--{}: {message}",
                    key.trim_start_matches("etcd.").replace('_', "-")
                );
            }
            Ok(pdserve_actors::discovery::EtcdSettings::from_config(
                &cfg,
                creds.cluster(),
            ))
        })
        .transpose()?
        .flatten();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut driver = crate::planner_driver::Driver::new(
            planner,
            (&a.credentials_dir, &a.node),
            a.proxy.trim_end_matches('/').to_string(),
            control,
            a.api_key.as_deref(),
        )?;
        let window = driver.window();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + window, window);
        let mut n = 0u64;
        while a.windows.is_none_or(|w| n < w) {
            tick.tick().await;
            n += 1;
            let (current, d) = match driver.observe(None).await {
                Ok(o) => o,
                Err(e) => {
                    eprintln!("pdserve plan watch: window {n} skipped: {e:#}");
                    continue;
                }
            };
            let advice = serde_json::json!({
                "window": n,
                "current": {"prefill": current.prefill, "decode": current.decode},
                "recommended": {"prefill": d.split.prefill, "decode": d.split.decode},
                "wanted": {"prefill": d.wanted.prefill, "decode": d.wanted.decode},
                "reason": d.reason,
                "ttft_ms": driver.config().sla.ttft_s * 1e3,
                "itl_ms": driver.config().sla.itl_s * 1e3,
            });
            println!("{advice}");
            if let Some(etcd) = &etcd {
                if let Err(e) =
                    pdserve_actors::discovery::put_recommendation(etcd, &advice, window * 3).await
                {
                    eprintln!("pdserve plan watch: advice not put in etcd: {e}");
                }
            }
        }
        Ok(())
    })
}

fn simulate_cmd(a: &SimulateArgs) -> Result<()> {
    let curves = read_curves(&a.curves)?;
    let trace = a.knobs.load(&a.trace)?;
    let mode: PlannerMode = a.mode.parse()?;
    if !(a.required > 0.0 && a.required <= 1.0) {
        bail!("--required must be in (0, 1]");
    }
    let sla = SlaTargets {
        ttft_s: a.ttft_ms / 1e3,
        itl_s: a.itl_ms / 1e3,
    };
    let base = SimConfig {
        sla,
        window_s: a.window_s,
        startup_s: a.startup_s,
        ..Default::default()
    };
    let planner = PlannerConfig {
        mode,
        bounds: Bounds {
            prefill: RoleBounds {
                min: a.min_prefill,
                max: a.max_prefill,
            },
            decode: RoleBounds {
                min: a.min_decode,
                max: a.max_decode,
            },
            total_max: a.max_total,
        },
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let planned = simulate(
        &trace,
        &curves,
        &SimConfig {
            planner: Some(planner),
            ..base.clone()
        },
    )?;
    let planner_time = started.elapsed();
    let search_range = SearchRange {
        prefill: range(
            "fixed-prefill",
            a.fixed_prefill.as_deref(),
            (1, 2 * planned.peak.prefill + 2),
        )?,
        decode: range(
            "fixed-decode",
            a.fixed_decode.as_deref(),
            (1, 2 * planned.peak.decode + 2),
        )?,
    };
    let search = best_fixed_split(&trace, &curves, &base, search_range, a.required)?;
    let total_time = started.elapsed();

    let kind = match a.trace.as_str() {
        k @ ("shifting" | "multi-turn") => format!("{k} (seed {})", a.knobs.seed),
        path => path.to_string(),
    };
    println!(
        "trace {kind}: {} requests over {:.0} s, {} windows of {} s; SLA: TTFT p90 <= {} ms, ITL p90 <= {} ms in >= {:.0} % of windows",
        planned.requests,
        trace.last_arrival_s(),
        planned.windows.len(),
        a.window_s,
        a.ttft_ms,
        a.itl_ms,
        a.required * 100.0
    );
    println!(
        "curves {} ({}); start-up {} s",
        a.curves.display(),
        curves.limits.model,
        a.startup_s.unwrap_or(curves.limits.startup_s)
    );
    if a.windows {
        println!("\nplanner windows:");
        println!(
            "{:>8} {:>8} {:>11} {:>10} {:>7} {:>5}  reason",
            "start s", "arrivals", "TTFT p90", "ITL p90", "split", "meets"
        );
        for w in &planned.windows {
            println!(
                "{:>8.0} {:>8} {:>11} {:>10} {:>7} {:>5}  {}",
                w.start_s,
                w.arrivals,
                ms(w.ttft_p90_s),
                ms(w.itl_p90_s),
                w.split.to_string(),
                if w.meets { "yes" } else { "NO" },
                w.reason
            );
        }
    }
    println!();
    println!(
        "{:<28} {:>21} {:>12} {:>11} {:>10} {:>7}",
        "", "windows within SLA", "instance-s", "TTFT p90", "ITL p90", "peak"
    );
    println!("{}", row(&format!("planner ({})", mode.as_str()), &planned));
    match &search.best {
        Some((split, r)) => {
            println!("{}", row(&format!("best fixed split {split}"), r));
            let saved = 1.0 - planned.instance_seconds / r.instance_seconds;
            println!();
            println!(
                "planner: SLA met in {:.1} % of windows ({} the {:.0} % required), {:.1} % {} instance-seconds than the best fixed split {split}",
                planned.fraction_meeting() * 100.0,
                if planned.fraction_meeting() >= a.required { "at or above" } else { "BELOW" },
                a.required * 100.0,
                saved.abs() * 100.0,
                if saved >= 0.0 { "fewer" } else { "more" }
            );
        }
        None => println!(
            "no fixed split in {}..={} prefill x {}..={} decode meets the SLA in {:.0} % of windows",
            search_range.prefill.0,
            search_range.prefill.1,
            search_range.decode.0,
            search_range.decode.1,
            a.required * 100.0
        ),
    }
    println!();
    println!(
        "fixed splits: fewest prefill meeting TTFT alone {}, fewest decode meeting ITL alone {} (searched {}..={} x {}..={}); joint runs:",
        search.prefill_floor.map_or("none".into(), |v| v.to_string()),
        search.decode_floor.map_or("none".into(), |v| v.to_string()),
        search_range.prefill.0,
        search_range.prefill.1,
        search_range.decode.0,
        search_range.decode.1,
    );
    for (split, r) in &search.runs {
        let mut line = row(&format!("  fixed {split}"), r);
        if r.gave_up {
            line.push_str("  (stopped early: missing)");
        }
        println!("{line}");
    }
    println!(
        "\n{} simulations ({} planner events) in {:.2} s (planner run {:.2} s)",
        search.simulations + 1,
        planned.events,
        total_time.as_secs_f64(),
        planner_time.as_secs_f64()
    );
    Ok(())
}
