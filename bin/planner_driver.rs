//! `pdserve launch --planner throughput`: the SLA planner (`pdserve_core::planner`) applied to
//! the cluster the launcher runs.
//!
//! Every `--planner-window-s` the driver builds one [`WindowObservation`] from what the
//! cluster exposes, hands it to [`Planner::observe`], and applies the decision through the
//! launcher's own scale path (new instances are started; surplus ones drain — they finish
//! what they run, so no request is cut — and exit):
//!
//! - the member list, each instance's URL, role, whether it is routed to, its queue and batch:
//!   the proxy's cluster snapshot over the control plane (as `pdserve inspect` fetches it);
//! - arrivals: the proxy's `pdserve_proxy_requests_total` (`disaggregated` + `local_prefill`);
//! - prompt and output lengths: `pdserve_prompt_tokens_total` of every instance (prefill
//!   instances count the prompts they compute, decode instances those they prefill
//!   themselves), over the decode instances' finished `pdserve_requests_total`, and their
//!   `pdserve_generated_tokens_total`, per window;
//! - prefix hits: the prefill instances' `pdserve_prefix_cache_{hit,query}_tokens_total`;
//! - each decode instance's ITL p90 over the window, from its
//!   `pdserve_inter_token_latency_seconds` buckets.
//!
//! Only throughput mode runs here: load mode regresses on per-step engine figures (steps,
//! busy time, tokens per step) the instances do not export yet. The p90 prompt length is
//! taken as the mean (the instances export counters, not a prompt-length histogram).

use anyhow::{bail, Context, Result};
use clap::Args;
use pdserve_core::planner::{
    Bounds, CurvesFile, Decision, EngineCurves, EngineSample, Planner, PlannerConfig, PlannerMode,
    RoleBounds, SlaTargets, Split, WindowObservation,
};
use pdserve_runtime::supervision::{ClusterSnapshot, MemberStatus};
use pdserve_runtime::wire::{ControlMessage, InspectAnswer};
use pdserve_transport::control::{ControlConfig, ControlConnection, ControlEndpoint};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The engine curves shipped for the default model (one compute thread; docs/planner.md).
const DEFAULT_CURVES: &str = include_str!("../configs/planner/smollm2-135m-cpu.toml");

/// `pdserve launch` flags of the planner.
#[derive(Args, Debug, Clone)]
pub struct PlannerArgs {
    /// Run the SLA planner: every window it picks the prefill/decode split that meets the
    /// TTFT and ITL targets and scales the cluster to it (surplus instances drain). Only
    /// `throughput` runs in `launch` (docs/planner.md).
    #[arg(long, value_name = "MODE")]
    pub planner: Option<String>,
    /// Seconds between the planner's decisions.
    #[arg(long, default_value_t = 10.0)]
    pub planner_window_s: f64,
    /// TTFT target at p90, in milliseconds.
    #[arg(long, default_value_t = 500.0)]
    pub planner_ttft_ms: f64,
    /// ITL target at p90, in milliseconds.
    #[arg(long, default_value_t = 50.0)]
    pub planner_itl_ms: f64,
    /// Engine curves (TOML, as `pdserve plan simulate --curves`); default: the curves shipped
    /// for the default model on one compute thread.
    #[arg(long, value_name = "FILE")]
    pub planner_curves: Option<PathBuf>,
    /// Most prefill instances the planner may run.
    #[arg(long, default_value_t = 4)]
    pub planner_max_prefill: usize,
    /// Most decode instances the planner may run.
    #[arg(long, default_value_t = 4)]
    pub planner_max_decode: usize,
}

impl PlannerArgs {
    /// The planner these flags ask for (`None`: no `--planner`).
    ///
    /// # Errors
    /// An unknown or unsupported mode, a bad curves file, bounds or targets out of range.
    pub fn planner(&self) -> Result<Option<Planner>> {
        let Some(mode) = &self.planner else {
            return Ok(None);
        };
        let mode: PlannerMode = mode.parse().context("--planner")?;
        if mode != PlannerMode::Throughput {
            bail!("--planner load: load mode regresses on per-step engine figures the instances do not export yet; use --planner throughput (load mode runs in `pdserve plan simulate`)");
        }
        let curves = match &self.planner_curves {
            Some(path) => read_curves(path)?,
            None => {
                let file: CurvesFile =
                    toml::from_str(DEFAULT_CURVES).context("the shipped planner curves")?;
                EngineCurves::new(file).context("the shipped planner curves")?
            }
        };
        let cfg = PlannerConfig {
            mode,
            sla: SlaTargets {
                ttft_s: self.planner_ttft_ms / 1e3,
                itl_s: self.planner_itl_ms / 1e3,
            },
            bounds: Bounds {
                prefill: RoleBounds {
                    min: 1,
                    max: self.planner_max_prefill,
                },
                decode: RoleBounds {
                    min: 1,
                    max: self.planner_max_decode,
                },
                total_max: self.planner_max_prefill + self.planner_max_decode,
            },
            window_s: self.planner_window_s,
            startup_s: curves_startup(&self.planner_curves)?,
            ..PlannerConfig::default()
        };
        Ok(Some(Planner::new(cfg, Some(curves)).context("--planner")?))
    }
}

/// Reads and checks a curves file (`pdserve plan simulate --curves`, `--planner-curves`).
///
/// # Errors
/// Unreadable file, TOML or a curves error.
pub fn read_curves(path: &Path) -> Result<EngineCurves> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: CurvesFile =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    EngineCurves::new(file).with_context(|| format!("curves {}", path.display()))
}

/// The start-up delay the curves name (seconds).
fn curves_startup(path: &Option<PathBuf>) -> Result<f64> {
    let text = match path {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
        }
        None => DEFAULT_CURVES.to_string(),
    };
    let file: CurvesFile = toml::from_str(&text).context("planner curves")?;
    Ok(file.engine.startup_s)
}

/// The samples of `metric` in a Prometheus text page: `(labels, value)`.
fn samples<'a>(page: &'a str, metric: &str) -> Vec<(&'a str, f64)> {
    page.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(metric)?;
            let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
                let (labels, value) = r.split_once('}')?;
                (labels, value)
            } else if rest.starts_with(' ') {
                ("", rest)
            } else {
                return None;
            };
            Some((labels, value.trim().parse::<f64>().ok()?))
        })
        .collect()
}

fn sum(page: &str, metric: &str, label: Option<&str>) -> f64 {
    samples(page, metric)
        .into_iter()
        .filter(|(l, _)| label.is_none_or(|want| l.contains(want)))
        .map(|(_, v)| v)
        .sum()
}

/// Cumulative `(le, count)` buckets of a histogram.
fn buckets(page: &str, metric: &str) -> Vec<(f64, f64)> {
    let mut b: Vec<(f64, f64)> = samples(page, &format!("{metric}_bucket"))
        .into_iter()
        .filter_map(|(labels, v)| {
            let le = labels.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, v))
        })
        .collect();
    b.sort_by(|a, b| a.0.total_cmp(&b.0));
    b
}

/// The p90 of the observations between two readings of a histogram's buckets (the upper
/// bound of the bucket holding it; 0 when nothing was observed).
fn p90_between(before: &[(f64, f64)], now: &[(f64, f64)]) -> f64 {
    let at = |le: f64| before.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
    let delta: Vec<(f64, f64)> = now
        .iter()
        .map(|&(le, c)| (le, (c - at(le)).max(0.0)))
        .collect();
    let Some(&(_, total)) = delta.last() else {
        return 0.0;
    };
    if total <= 0.0 {
        return 0.0;
    }
    delta
        .iter()
        .find(|(_, c)| *c >= 0.9 * total)
        .map_or(0.0, |&(le, _)| if le.is_finite() { le } else { 0.0 })
}

/// What one instance's `/metrics` said last window.
#[derive(Default, Clone)]
struct Reading {
    prompt: f64,
    generated: f64,
    finished: f64,
    hit: f64,
    query: f64,
    itl: Vec<(f64, f64)>,
}

impl Reading {
    fn of(page: &str) -> Self {
        Self {
            prompt: sum(page, "pdserve_prompt_tokens_total", None),
            generated: sum(page, "pdserve_generated_tokens_total", None),
            finished: sum(page, "pdserve_requests_total", Some("outcome=\"finished\"")),
            hit: sum(page, "pdserve_prefix_cache_hit_tokens_total", None),
            query: sum(page, "pdserve_prefix_cache_query_tokens_total", None),
            itl: buckets(page, "pdserve_inter_token_latency_seconds"),
        }
    }
}

/// The planner and what it needs to observe the cluster.
pub struct Driver {
    planner: Planner,
    http: reqwest::Client,
    proxy_url: String,
    endpoint: ControlEndpoint,
    proxy_control: SocketAddr,
    conn: Option<ControlConnection>,
    /// Proxy arrivals counted at the last window.
    arrivals: f64,
    /// Each instance's last reading, by URL.
    last: HashMap<String, Reading>,
}

impl Driver {
    /// A driver for the cluster whose proxy serves `proxy_url` and whose control plane is at
    /// `proxy_control`, reached as member `node` of the credentials in `dir`.
    ///
    /// # Errors
    /// Unusable credentials or an unbindable control endpoint.
    pub fn new(
        planner: Planner,
        (dir, node): (&Path, &str),
        proxy_url: String,
        proxy_control: SocketAddr,
        api_key: Option<&str>,
    ) -> Result<Self> {
        let creds = pdserve_transport::control::tls::MemberCredentials::load(dir, node)
            .with_context(|| format!("member credentials `{node}` in {}", dir.display()))?;
        let config = ControlConfig {
            listen: "127.0.0.1:0".parse()?,
            role: pdserve_runtime::Role::Other,
            request_timeout: Duration::from_secs(5),
            ..ControlConfig::default()
        };
        let endpoint = ControlEndpoint::bind(&creds, config).context("planner control endpoint")?;
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = api_key {
            headers.insert(
                reqwest::header::AUTHORIZATION,
                format!("Bearer {key}").parse().context("--api-key")?,
            );
        }
        let http = pdserve_actors::http::http_client()
            .timeout(Duration::from_secs(5))
            .default_headers(headers)
            .build()?;
        Ok(Self {
            planner,
            http,
            proxy_url,
            endpoint,
            proxy_control,
            conn: None,
            arrivals: f64::NAN,
            last: HashMap::new(),
        })
    }

    /// The planner's configuration.
    pub fn config(&self) -> &PlannerConfig {
        self.planner.config()
    }

    /// The window's length.
    pub fn window(&self) -> Duration {
        Duration::from_secs_f64(self.planner.config().window_s)
    }

    async fn cluster(&mut self) -> Result<ClusterSnapshot> {
        if self.conn.as_ref().is_none_or(|c| !c.is_alive()) {
            self.conn = Some(
                self.endpoint
                    .connect(self.proxy_control)
                    .await
                    .context("connecting to the proxy's control plane")?,
            );
        }
        let conn = self.conn.as_ref().expect("set above");
        match conn.request(ControlMessage::InspectRequest).await? {
            ControlMessage::Inspect(answer) => match *answer {
                InspectAnswer::Cluster(c) => Ok(c),
                InspectAnswer::Instance(_) => bail!("the proxy answered with an instance snapshot"),
            },
            other => bail!("the proxy answered inspect with {}", other.name()),
        }
    }

    async fn page(&self, url: &str) -> String {
        match self.http.get(format!("{url}/metrics")).send().await {
            Ok(r) if r.status().is_success() => r.text().await.unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// Observes the window that just ended (`current`: the instances the launcher runs per
    /// role, draining ones excluded; `None`: those the proxy lists, draining ones excluded)
    /// and returns the planner's decision with the split it was made from.
    ///
    /// # Errors
    /// The proxy's snapshot could not be fetched (the window is skipped).
    pub async fn observe(&mut self, current: Option<Split>) -> Result<(Split, Decision)> {
        let cluster = self.cluster().await?;
        let current = current.unwrap_or_else(|| {
            let count = |role: &str| {
                cluster
                    .instances
                    .iter()
                    .filter(|m| m.role == role && !m.draining)
                    .count()
            };
            Split::new(count("prefill"), count("decode"))
        });
        let proxy_page = self.page(&self.proxy_url).await;
        let arrivals_now = sum(
            &proxy_page,
            "pdserve_proxy_requests_total",
            Some("outcome=\"disaggregated\""),
        ) + sum(
            &proxy_page,
            "pdserve_proxy_requests_total",
            Some("outcome=\"local_prefill\""),
        );
        let arrivals = if self.arrivals.is_nan() {
            0.0
        } else {
            (arrivals_now - self.arrivals).max(0.0)
        };
        self.arrivals = arrivals_now;
        let mut obs = WindowObservation {
            duration_s: self.planner.config().window_s,
            arrivals: arrivals as u64,
            current,
            ..WindowObservation::default()
        };
        let (mut prompt, mut generated, mut finished, mut hit, mut query) =
            (0.0, 0.0, 0.0, 0.0, 0.0);
        let mut routable = Split::default();
        let mut seen = HashMap::new();
        for m in &cluster.instances {
            if m.draining {
                continue;
            }
            let now = Reading::of(&self.page(&m.url).await);
            let before = self.last.get(&m.url).cloned().unwrap_or_default();
            // A restarted instance starts its counters over: count from zero.
            let d = |now: f64, before: f64| if now >= before { now - before } else { now };
            let (waiting, running) = match &m.status {
                MemberStatus::Snapshot(s) => (s.waiting, s.running),
                MemberStatus::Unreachable(_) => (0, 0),
            };
            match m.role.as_str() {
                "prefill" => {
                    routable.prefill += usize::from(m.routable);
                    prompt += d(now.prompt, before.prompt);
                    hit += d(now.hit, before.hit);
                    query += d(now.query, before.query);
                    obs.prefill.push(EngineSample {
                        waiting,
                        running,
                        ..EngineSample::default()
                    });
                }
                "decode" => {
                    routable.decode += usize::from(m.routable);
                    prompt += d(now.prompt, before.prompt);
                    generated += d(now.generated, before.generated);
                    finished += d(now.finished, before.finished);
                    obs.decode.push(EngineSample {
                        waiting,
                        running,
                        p90_step_s: p90_between(&before.itl, &now.itl),
                        ..EngineSample::default()
                    });
                }
                _ => {}
            }
            seen.insert(m.url.clone(), now);
        }
        self.last = seen;
        if finished > 0.0 {
            obs.mean_isl = prompt / finished;
            obs.p90_isl = obs.mean_isl;
            obs.mean_osl = generated / finished;
        }
        if query > 0.0 {
            obs.prefix_hit_rate = (hit / query).clamp(0.0, 1.0);
        }
        obs.starting = Split::new(
            current.prefill.saturating_sub(routable.prefill),
            current.decode.saturating_sub(routable.decode),
        );
        Ok((current, self.planner.observe(&obs)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_pages_read_into_window_figures() {
        let before = "pdserve_inter_token_latency_seconds_bucket{le=\"0.01\"} 5\n\
                      pdserve_inter_token_latency_seconds_bucket{le=\"0.05\"} 10\n\
                      pdserve_inter_token_latency_seconds_bucket{le=\"+Inf\"} 10\n";
        let now = "pdserve_requests_total{outcome=\"finished\"} 7\n\
                   pdserve_requests_total{outcome=\"aborted\"} 2\n\
                   pdserve_prompt_tokens_total 700\n\
                   pdserve_inter_token_latency_seconds_bucket{le=\"0.01\"} 6\n\
                   pdserve_inter_token_latency_seconds_bucket{le=\"0.05\"} 100\n\
                   pdserve_inter_token_latency_seconds_bucket{le=\"+Inf\"} 110\n";
        let r = Reading::of(now);
        assert_eq!((r.finished, r.prompt), (7.0, 700.0));
        // 100 gaps this window: 1 ≤ 10 ms, 89 more ≤ 50 ms, 10 above: the 90th is in the
        // 50 ms bucket.
        let p90 = p90_between(
            &buckets(before, "pdserve_inter_token_latency_seconds"),
            &r.itl,
        );
        assert_eq!(p90, 0.05);
        assert_eq!(p90_between(&r.itl, &r.itl), 0.0, "nothing observed");
        assert_eq!(
            sum(
                "pdserve_prompt_tokens_total_x 3\n",
                "pdserve_prompt_tokens_total",
                None
            ),
            0.0
        );
    }

    #[test]
    fn only_throughput_mode_runs_in_launch() {
        let args = PlannerArgs {
            planner: Some("load".into()),
            planner_window_s: 10.0,
            planner_ttft_ms: 500.0,
            planner_itl_ms: 50.0,
            planner_curves: None,
            planner_max_prefill: 4,
            planner_max_decode: 4,
        };
        let e = args.planner().err().unwrap().to_string();
        assert!(e.contains("throughput"), "{e}");
        let ok = PlannerArgs {
            planner: Some("throughput".into()),
            ..args.clone()
        };
        assert!(ok.planner().unwrap().is_some());
        let none = PlannerArgs {
            planner: None,
            ..args
        };
        assert!(none.planner().unwrap().is_none());
    }
}
