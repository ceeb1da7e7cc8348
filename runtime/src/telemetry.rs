//! Process-wide telemetry: the `tracing` subscriber ([`init_tracing`]), the Prometheus metrics
//! recorder ([`install_metrics`], [`MetricsHandle::render`]), the metric names every actor
//! records under, and a panic hook that logs panics through `tracing`
//! ([`install_panic_hook`]).
//!
//! Everything here is idempotent: each installer may be called many times (tests do); the
//! first call installs, later calls are no-ops or return the same handle.
//!
//! Metric recording goes through the `metrics` facade (`metrics::counter!(REQUESTS_TOTAL,
//! LABEL_OUTCOME => "ok").increment(1)`); the names below are the only ones pdserve uses.

use std::io::IsTerminal;
use std::sync::{Once, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

pub use crate::config::LogFormat;

/// Histogram: seconds from a request's arrival to its first output token.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "pdserve_time_to_first_token_seconds";
/// Histogram: per request, (end − first token) / (output tokens − 1), in seconds.
pub const TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "pdserve_time_per_output_token_seconds";
/// Histogram: seconds between two consecutive output tokens of one request.
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "pdserve_inter_token_latency_seconds";
/// Gauge: requests waiting to be scheduled.
pub const REQUESTS_WAITING: &str = "pdserve_requests_waiting";
/// Gauge: requests in the running batch.
pub const REQUESTS_RUNNING: &str = "pdserve_requests_running";
/// Gauge: KV blocks allocated.
pub const KV_BLOCKS_USED: &str = "pdserve_kv_blocks_used";
/// Gauge: KV blocks free.
pub const KV_BLOCKS_FREE: &str = "pdserve_kv_blocks_free";
/// Counter: running sequences preempted to free KV blocks.
pub const PREEMPTIONS_TOTAL: &str = "pdserve_preemptions_total";
/// Counter: finished requests, labelled [`LABEL_OUTCOME`].
pub const REQUESTS_TOTAL: &str = "pdserve_requests_total";
/// Counter: output tokens generated.
pub const GENERATED_TOKENS_TOTAL: &str = "pdserve_generated_tokens_total";
/// Counter: prompt tokens processed.
pub const PROMPT_TOKENS_TOTAL: &str = "pdserve_prompt_tokens_total";
/// Counter: prompt tokens of admitted requests served from the prefix cache (neither computed
/// nor transferred).
pub const PREFIX_CACHE_HIT_TOKENS_TOTAL: &str = "pdserve_prefix_cache_hit_tokens_total";
/// Counter: prompt tokens of admitted requests looked up in the prefix cache.
pub const PREFIX_CACHE_QUERY_TOKENS_TOTAL: &str = "pdserve_prefix_cache_query_tokens_total";
/// Gauge: cached KV blocks nobody holds (evictable; counted as free).
pub const KV_BLOCKS_CACHED: &str = "pdserve_kv_blocks_cached";
/// Counter: cached KV blocks evicted to make room.
pub const PREFIX_CACHE_EVICTIONS_TOTAL: &str = "pdserve_prefix_cache_evictions_total";
/// Counter: KV blocks restored from a KV cache tier (verified), labelled [`LABEL_TIER`].
pub const KV_TIER_HITS_TOTAL: &str = "pdserve_kv_tier_hits_total";
/// Counter: KV blocks a tier's index listed whose restore failed verification (recomputed),
/// labelled [`LABEL_TIER`] and [`LABEL_REASON`] (`missing`, `checksum`, `short_read`,
/// `compat`, `key`, `malformed`, `io`).
pub const KV_TIER_MISSES_TOTAL: &str = "pdserve_kv_tier_misses_total";
/// Counter: bytes stored into a KV cache tier, labelled [`LABEL_TIER`].
pub const KV_TIER_WRITTEN_BYTES_TOTAL: &str = "pdserve_kv_tier_written_bytes_total";
/// Counter: KV bytes restored from a KV cache tier, labelled [`LABEL_TIER`].
pub const KV_TIER_READ_BYTES_TOTAL: &str = "pdserve_kv_tier_read_bytes_total";
/// Gauge: blocks a KV cache tier holds, labelled [`LABEL_TIER`].
pub const KV_TIER_BLOCKS: &str = "pdserve_kv_tier_blocks";
/// Gauge: bytes a KV cache tier holds, labelled [`LABEL_TIER`].
pub const KV_TIER_BYTES: &str = "pdserve_kv_tier_bytes";
/// Histogram: seconds a rank spent copying one batch of evicted KV blocks out of its cache
/// for the tiers. The copy runs on the rank's thread ahead of its next step, so the sum is the
/// tiers' whole cost on the step path when nothing is restored.
pub const KV_TIER_SPILL_SECONDS: &str = "pdserve_kv_tier_spill_seconds";
/// Histogram: load-back latency, from a tier lookup finding blocks of a prompt to those
/// blocks written into the pool on every rank (a whole load: the request waits this long to
/// be admitted; a streamed one: to the end of its first step, which computed meanwhile).
pub const KV_TIER_LOAD_SECONDS: &str = "pdserve_kv_tier_load_seconds";
/// Counter: layers of streamed KV tier restores that ranks took before the restore's last
/// layer had landed (compute that overlapped the load-back), summed over ranks.
pub const KV_TIER_STREAM_EARLY_LAYERS_TOTAL: &str = "pdserve_kv_tier_stream_early_layers_total";
/// Label of the `KV_TIER_*` metrics: `host` or `disk`.
pub const LABEL_TIER: &str = "tier";
/// Histogram: KV bytes one decode-side hand-off moved (after the prefix-cache delta).
pub const KV_TRANSFER_BYTES_PER_REQUEST: &str = "pdserve_kv_transfer_bytes_per_request";
/// Counter: actor restarts by supervisors, labelled [`LABEL_ACTOR`].
pub const ACTOR_RESTARTS_TOTAL: &str = "pdserve_actor_restarts_total";
/// Counter: messages one actor sent another that were not delivered because the receiver
/// was gone (its supervisor reports the death and fails what it held), labelled
/// [`LABEL_ACTOR`] (the receiver) and [`LABEL_MESSAGE`].
pub const ACTOR_MESSAGES_UNDELIVERED_TOTAL: &str = "pdserve_actor_messages_undelivered_total";
/// Label of [`ACTOR_MESSAGES_UNDELIVERED_TOTAL`]: the message (`step`, `report`, ...).
pub const LABEL_MESSAGE: &str = "message";

/// Counter: KV hand-off handshakes (a peer's layout fetched and validated).
pub const KV_HANDSHAKES_TOTAL: &str = "pdserve_kv_handshakes_total";
/// Counter: KV hand-offs that failed (either side), labelled [`LABEL_KIND`].
pub const KV_TRANSFER_FAILURES_TOTAL: &str = "pdserve_kv_transfer_failures_total";
/// Counter: KV bytes moved by this instance's hand-offs, labelled [`LABEL_DIRECTION`].
pub const KV_TRANSFER_BYTES_TOTAL: &str = "pdserve_kv_transfer_bytes_total";
/// Histogram: seconds one KV hand-off took, from its start to its last byte (decode: from the
/// request's arrival; prefill push: from the hand-off's registration), labelled [`LABEL_MODE`].
pub const KV_TRANSFER_SECONDS: &str = "pdserve_kv_transfer_seconds";
/// Label of [`KV_TRANSFER_FAILURES_TOTAL`]: the failure's `HandoffError::kind()` — `timeout`,
/// `peer_gone`, `handshake`, `lease_expired`, `invalid_blocks`, `aborted`, `refused`,
/// `transfer`, `cache_lost`, `interrupted`, `overloaded`, `protocol`.
pub const LABEL_KIND: &str = "kind";
/// Label of [`KV_TRANSFER_BYTES_TOTAL`]: `sent` or `received`.
pub const LABEL_DIRECTION: &str = "direction";
/// Label of [`KV_TRANSFER_SECONDS`]: `push` or `pull`.
pub const LABEL_MODE: &str = "mode";
/// Histogram (decode): seconds from the prefill instance having the whole prompt computed to
/// the decode instance's first decode step of the request — what disaggregation adds to the
/// time to the second token (same-host clocks; across hosts it includes their clock skew).
/// No labels.
pub const KV_HANDOFF_GAP_SECONDS: &str = "pdserve_kv_handoff_gap_seconds";
/// Counter: per-rank hand-off reports the Aggregator dropped, labelled [`LABEL_REASON`]
/// (`stale_epoch`: from an older epoch of its rank or another attempt; `duplicate`).
pub const KV_REPORTS_DROPPED_TOTAL: &str = "pdserve_kv_reports_dropped_total";

/// Counter: requests a decode instance prefilled itself instead of remotely (conditional
/// disaggregation), labelled [`LABEL_REASON`].
pub const LOCAL_PREFILLS_TOTAL: &str = "pdserve_local_prefills_total";
/// Counter (proxy): requests by outcome (`disaggregated`, `local_prefill`, `invalid`,
/// `unauthorized`, `unavailable`, `upstream_error`), labelled [`LABEL_OUTCOME`].
pub const PROXY_REQUESTS_TOTAL: &str = "pdserve_proxy_requests_total";
/// Histogram (proxy): seconds from a request's arrival to the first byte of the decode
/// instance's answer (for streams: the first token, as the client sees it minus the network).
pub const PROXY_TIME_TO_FIRST_BYTE_SECONDS: &str = "pdserve_proxy_time_to_first_byte_seconds";
/// Histogram (proxy): seconds from a request's arrival to the end of its answer.
pub const PROXY_REQUEST_SECONDS: &str = "pdserve_proxy_request_seconds";
/// Counter (proxy): requests moved to another decode instance mid-generation (request
/// migration), labelled [`LABEL_REASON`] (`stream_broken`, `instance_failed`, `unreachable`).
pub const MIGRATIONS_TOTAL: &str = "pdserve_migrations_total";
/// Counter (proxy): requests whose prefill instance failed before the hand-off, labelled
/// [`LABEL_ACTION`] (`retry`: another prefill instance, `local`: prefilled on decode, `fail`).
pub const PREFILL_RETRIES_TOTAL: &str = "pdserve_prefill_retries_total";
/// Label of [`PREFILL_RETRIES_TOTAL`].
pub const LABEL_ACTION: &str = "action";
/// Gauge (proxy): instances routed to, labelled `role` (`prefill`, `decode`).
pub const PROXY_INSTANCES: &str = "pdserve_proxy_instances";
/// Proxy with etcd discovery: instances whose etcd record is alive.
pub const PROXY_ETCD_MEMBERS: &str = "pdserve_proxy_etcd_members";
/// Counter (proxy): instance picks, labelled `role` and [`LABEL_REASON`] (`kv_overlap`,
/// `load`, `no_overlap`, `untokenized`, `least_loaded`, `round_robin`).
pub const ROUTER_DECISIONS_TOTAL: &str = "pdserve_router_decisions_total";
/// Gauge (proxy): block hashes the KV router indexes, labelled `instance` (its URL).
pub const ROUTER_KV_INDEX_BLOCKS: &str = "pdserve_router_kv_index_blocks";

/// Counter (instances and proxy): requests and connections turned away with `503` before any
/// work, labelled [`LABEL_REASON`]: `requests` (`max_concurrent_requests` in flight),
/// `connections` (`max_connections` open), `mailbox` (`scheduler.mailbox_capacity` messages
/// wait for the Scheduler), `shutting_down`.
pub const REQUESTS_SHED_TOTAL: &str = "pdserve_requests_shed_total";

/// Label of [`LOCAL_PREFILLS_TOTAL`] and [`REQUESTS_SHED_TOTAL`]: why (`short_prompt`,
/// `prefill_queue`, `parallel_sampling`, ...).
pub const LABEL_REASON: &str = "reason";

/// Label of [`REQUESTS_TOTAL`]: how a request ended (`ok`, `aborted`, `timeout`, an error's
/// `kind()`, ...).
pub const LABEL_OUTCOME: &str = "outcome";
/// Label of [`ACTOR_RESTARTS_TOTAL`]: the restarted actor's kind (`Scheduler`, `TpWorker`, ...).
pub const LABEL_ACTOR: &str = "actor";

/// Upper bounds (seconds) of the latency histograms' buckets: 1 ms to 60 s.
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 20.0, 30.0, 60.0,
];

/// The environment variable whose filter, when set and valid, replaces the configured
/// `logging.filter` in [`init_tracing`].
pub const RUST_LOG_ENV: &str = "RUST_LOG";

/// How often the background thread drains recorded histogram samples into their buckets, so
/// memory stays bounded between scrapes.
pub const METRICS_UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Installs the global `tracing` subscriber: `fmt` lines to stderr, human-readable or JSON,
/// filtered by `RUST_LOG` when it is set (and valid), else by `filter`.
///
/// Returns `true` when this call installed it, `false` when a global subscriber already
/// existed (then nothing changes). An invalid `filter` falls back to `info` with a warning.
pub fn init_tracing(filter: &str, format: LogFormat) -> bool {
    let mut warning = None;
    let env_filter = match std::env::var(RUST_LOG_ENV) {
        Ok(value) if !value.trim().is_empty() => match EnvFilter::builder().parse(&value) {
            Ok(f) => Some(f),
            Err(err) => {
                warning = Some(format!("ignoring invalid RUST_LOG {value:?}: {err}"));
                None
            }
        },
        _ => None,
    };
    let env_filter = match env_filter {
        Some(f) => f,
        None => EnvFilter::builder().parse(filter).unwrap_or_else(|err| {
            warning = Some(format!(
                "invalid log filter {filter:?} ({err}); using \"info\""
            ));
            EnvFilter::new("info")
        }),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_writer(std::io::stderr)
        .with_thread_names(true);
    let installed = match format {
        LogFormat::Human => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init()
            .is_ok(),
        LogFormat::Json => builder.json().with_current_span(true).try_init().is_ok(),
    };
    if installed {
        if let Some(warning) = warning {
            tracing::warn!("{warning}");
        }
    }
    installed
}

/// A handle to the process's Prometheus recorder. Cheap to clone.
#[derive(Clone, Debug)]
pub struct MetricsHandle {
    inner: PrometheusHandle,
    installed: bool,
}

impl MetricsHandle {
    /// The current metrics in the Prometheus text exposition format (for `GET /metrics`).
    pub fn render(&self) -> String {
        self.inner.render()
    }

    /// Whether this handle's recorder is the global one. `false` only when some other
    /// recorder was installed first; then [`render`](Self::render) shows no pdserve metrics.
    pub fn is_global(&self) -> bool {
        self.installed
    }
}

static METRICS: OnceLock<MetricsHandle> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global `metrics` recorder (once; later
/// calls return the same handle), describes every pdserve metric, registers the unlabelled
/// ones at zero so they appear before the first event, and starts a background upkeep thread
/// (`pdserve-metrics-upkeep`).
///
/// If another recorder was installed first, this logs a warning and returns a handle to a
/// detached recorder ([`MetricsHandle::is_global`] is `false`).
pub fn install_metrics() -> MetricsHandle {
    METRICS
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS_SECONDS)
                .expect("bucket list is not empty");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            let installed = match metrics::set_global_recorder(recorder) {
                Ok(()) => true,
                Err(err) => {
                    tracing::warn!("a metrics recorder was already installed; pdserve metrics stay empty: {err}");
                    false
                }
            };
            if installed {
                describe_and_register();
                let upkeep = handle.clone();
                let spawned = std::thread::Builder::new().name("pdserve-metrics-upkeep".into()).spawn(move || loop {
                    std::thread::sleep(METRICS_UPKEEP_INTERVAL);
                    upkeep.run_upkeep();
                });
                if let Err(err) = spawned {
                    tracing::warn!("cannot start the metrics upkeep thread: {err}");
                }
            }
            MetricsHandle { inner: handle, installed }
        })
        .clone()
}

fn describe_and_register() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_histogram!(
        TIME_TO_FIRST_TOKEN_SECONDS,
        Unit::Seconds,
        "Time from request arrival to the first output token."
    );
    describe_histogram!(
        TIME_PER_OUTPUT_TOKEN_SECONDS,
        Unit::Seconds,
        "Mean time per output token after the first, per request."
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY_SECONDS,
        Unit::Seconds,
        "Time between consecutive output tokens."
    );
    describe_gauge!(REQUESTS_WAITING, "Requests waiting to be scheduled.");
    describe_gauge!(REQUESTS_RUNNING, "Requests in the running batch.");
    describe_gauge!(KV_BLOCKS_USED, "KV cache blocks allocated.");
    describe_gauge!(KV_BLOCKS_FREE, "KV cache blocks free.");
    describe_counter!(
        PREEMPTIONS_TOTAL,
        "Running sequences preempted to free KV blocks."
    );
    describe_counter!(REQUESTS_TOTAL, "Finished requests by outcome.");
    describe_counter!(
        KV_HANDSHAKES_TOTAL,
        "KV hand-off handshakes: a peer's KV layout fetched and validated."
    );
    describe_counter!(
        KV_TRANSFER_FAILURES_TOTAL,
        "KV hand-offs that failed, by kind."
    );
    describe_counter!(
        KV_TRANSFER_BYTES_TOTAL,
        "KV bytes moved by hand-offs, by direction (sent, received)."
    );
    describe_histogram!(
        KV_TRANSFER_SECONDS,
        Unit::Seconds,
        "Duration of one KV hand-off, by mode (push, pull)."
    );
    describe_histogram!(
        KV_HANDOFF_GAP_SECONDS,
        Unit::Seconds,
        "Decode: prompt computed at the prefill instance to the request's first decode step here."
    );
    describe_counter!(
        KV_REPORTS_DROPPED_TOTAL,
        "Per-rank hand-off reports the Aggregator dropped, by reason (stale_epoch, duplicate)."
    );
    describe_counter!(
        LOCAL_PREFILLS_TOTAL,
        "Requests prefilled on the decode instance itself (conditional disaggregation), by reason."
    );
    describe_counter!(GENERATED_TOKENS_TOTAL, "Output tokens generated.");
    describe_counter!(PROMPT_TOKENS_TOTAL, "Prompt tokens processed.");
    describe_counter!(
        PREFIX_CACHE_HIT_TOKENS_TOTAL,
        Unit::Count,
        "Prompt tokens served from the prefix cache."
    );
    describe_counter!(
        PREFIX_CACHE_QUERY_TOKENS_TOTAL,
        Unit::Count,
        "Prompt tokens looked up in the prefix cache."
    );
    describe_gauge!(
        KV_BLOCKS_CACHED,
        "Cached KV blocks nobody holds (evictable)."
    );
    describe_counter!(
        PREFIX_CACHE_EVICTIONS_TOTAL,
        Unit::Count,
        "Cached KV blocks evicted to make room."
    );
    describe_counter!(
        KV_TIER_HITS_TOTAL,
        Unit::Count,
        "KV blocks restored from a KV cache tier, by tier."
    );
    describe_counter!(
        KV_TIER_MISSES_TOTAL,
        Unit::Count,
        "KV blocks whose restore from a tier failed verification (recomputed), by tier and reason."
    );
    describe_counter!(
        KV_TIER_WRITTEN_BYTES_TOTAL,
        Unit::Bytes,
        "Bytes stored into a KV cache tier, by tier."
    );
    describe_counter!(
        KV_TIER_READ_BYTES_TOTAL,
        Unit::Bytes,
        "KV bytes restored from a KV cache tier, by tier."
    );
    describe_gauge!(KV_TIER_BLOCKS, "Blocks a KV cache tier holds, by tier.");
    describe_histogram!(
        KV_TIER_SPILL_SECONDS,
        Unit::Seconds,
        "Time a rank spent copying a batch of evicted KV blocks out for the tiers (on its step path)."
    );
    describe_histogram!(
        KV_TIER_LOAD_SECONDS,
        Unit::Seconds,
        "Load-back latency: from a tier hit found to its blocks written into the pool on every rank."
    );
    describe_counter!(
        KV_TIER_STREAM_EARLY_LAYERS_TOTAL,
        Unit::Count,
        "Layers of streamed KV tier restores ranks computed on before the restore's last layer landed."
    );
    describe_gauge!(
        KV_TIER_BYTES,
        Unit::Bytes,
        "Bytes a KV cache tier holds, by tier."
    );
    describe_histogram!(
        KV_TRANSFER_BYTES_PER_REQUEST,
        Unit::Bytes,
        "KV bytes one hand-off moved into a decode instance."
    );
    describe_counter!(
        ACTOR_RESTARTS_TOTAL,
        "Actor restarts by supervisors, by actor kind."
    );
    describe_counter!(
        ACTOR_MESSAGES_UNDELIVERED_TOTAL,
        "Messages not delivered because the receiving actor was gone, by actor kind and message."
    );

    describe_counter!(PROXY_REQUESTS_TOTAL, "Proxy: requests by outcome.");
    describe_counter!(
        ROUTER_DECISIONS_TOTAL,
        "Proxy: instance picks by role and reason."
    );
    describe_gauge!(
        ROUTER_KV_INDEX_BLOCKS,
        "Proxy: cached block hashes indexed per instance (from its KV events)."
    );
    describe_histogram!(
        PROXY_TIME_TO_FIRST_BYTE_SECONDS,
        Unit::Seconds,
        "Proxy: arrival to the first byte of the decode instance's answer."
    );
    describe_histogram!(
        PROXY_REQUEST_SECONDS,
        Unit::Seconds,
        "Proxy: arrival to the end of the answer."
    );
    describe_gauge!(PROXY_INSTANCES, "Proxy: live instances by role.");
    describe_gauge!(
        PROXY_ETCD_MEMBERS,
        "Proxy with etcd discovery: instances whose etcd record is alive."
    );
    describe_counter!(
        MIGRATIONS_TOTAL,
        "Proxy: requests moved to another decode instance mid-generation, by reason."
    );
    describe_counter!(
        PREFILL_RETRIES_TOTAL,
        "Proxy: requests whose prefill instance failed before the hand-off, by action."
    );
    // The hand-off histogram is only ever observed with its mode: registered with each mode,
    // never bare (a bare registration would export a second, unlabeled series of the name).
    for mode in ["pull", "push"] {
        let _ = metrics::histogram!(KV_TRANSFER_SECONDS, LABEL_MODE => mode);
    }
    for name in [
        KV_HANDOFF_GAP_SECONDS,
        TIME_TO_FIRST_TOKEN_SECONDS,
        TIME_PER_OUTPUT_TOKEN_SECONDS,
        INTER_TOKEN_LATENCY_SECONDS,
    ] {
        // Registering without a sample makes the (empty) histogram visible.
        let _ = metrics::histogram!(name);
    }
    for name in [
        REQUESTS_WAITING,
        REQUESTS_RUNNING,
        KV_BLOCKS_USED,
        KV_BLOCKS_FREE,
    ] {
        metrics::gauge!(name).set(0.0);
    }
    for name in [
        PREEMPTIONS_TOTAL,
        GENERATED_TOKENS_TOTAL,
        PROMPT_TOKENS_TOTAL,
    ] {
        metrics::counter!(name).increment(0);
    }
}

static PANIC_HOOK: Once = Once::new();

/// Installs (once) a panic hook that logs each panic as a `tracing` error event (target
/// `pdserve::panic`, with the thread's name, the location and the message), then calls the
/// hook that was installed before it (by default, the one printing to stderr).
///
/// Keep `panic = "unwind"` so supervisors still see the panicking actor stop.
pub fn install_panic_hook() {
    PANIC_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            let thread_name = thread.name().unwrap_or("<unnamed>");
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("<non-string panic payload>");
            let location = info.location().map(|l| l.to_string()).unwrap_or_else(|| "<unknown>".into());
            tracing::error!(target: "pdserve::panic", thread = thread_name, location = %location, "panic: {message}");
            previous(info);
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    #[test]
    fn metrics_install_is_idempotent_and_renders_every_name() {
        let handle = install_metrics();
        assert!(handle.is_global());
        let again = install_metrics();
        assert!(again.is_global());

        metrics::counter!(REQUESTS_TOTAL, LABEL_OUTCOME => "ok").increment(2);
        metrics::counter!(ACTOR_RESTARTS_TOTAL, LABEL_ACTOR => "Scheduler").increment(1);
        metrics::histogram!(TIME_TO_FIRST_TOKEN_SECONDS).record(0.02);
        metrics::counter!(PREEMPTIONS_TOTAL).increment(1);

        // Rendered through the second handle: both point at the same recorder.
        let text = again.render();
        for name in [
            TIME_TO_FIRST_TOKEN_SECONDS,
            TIME_PER_OUTPUT_TOKEN_SECONDS,
            INTER_TOKEN_LATENCY_SECONDS,
            REQUESTS_WAITING,
            REQUESTS_RUNNING,
            KV_BLOCKS_USED,
            KV_BLOCKS_FREE,
            PREEMPTIONS_TOTAL,
            REQUESTS_TOTAL,
            GENERATED_TOKENS_TOTAL,
            PROMPT_TOKENS_TOTAL,
            ACTOR_RESTARTS_TOTAL,
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        assert!(
            text.contains("pdserve_requests_total{outcome=\"ok\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("pdserve_actor_restarts_total{actor=\"Scheduler\"} 1"),
            "{text}"
        );
        // Latency histograms are real histograms with our buckets, not summaries.
        assert!(
            text.contains("pdserve_time_to_first_token_seconds_bucket{le=\"0.025\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("pdserve_time_to_first_token_seconds_bucket{le=\"0.01\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE pdserve_kv_blocks_free gauge"),
            "{text}"
        );
    }

    #[test]
    fn every_kv_transfer_series_carries_its_mode() {
        let handle = install_metrics();
        metrics::histogram!(KV_TRANSFER_SECONDS, LABEL_MODE => "pull").record(0.5);
        let text = handle.render();
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with(KV_TRANSFER_SECONDS))
            .collect();
        assert!(
            samples
                .iter()
                .any(|l| l.starts_with("pdserve_kv_transfer_seconds_count{mode=\"pull\"} ")),
            "{text}"
        );
        assert!(
            samples
                .iter()
                .any(|l| l.starts_with("pdserve_kv_transfer_seconds_count{mode=\"push\"} ")),
            "both modes are exported from the start: {text}"
        );
        for line in samples {
            assert!(
                line.contains("mode=\""),
                "an unlabeled series: {line}\n{text}"
            );
        }
    }

    #[test]
    fn latency_buckets_are_increasing_from_1ms_to_60s() {
        assert_eq!(LATENCY_BUCKETS_SECONDS.first(), Some(&0.001));
        assert_eq!(LATENCY_BUCKETS_SECONDS.last(), Some(&60.0));
        assert!(LATENCY_BUCKETS_SECONDS.windows(2).all(|w| w[0] < w[1]));
    }

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn panic_hook_logs_through_tracing_and_chains() {
        static PREVIOUS_CALLS: AtomicUsize = AtomicUsize::new(0);
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PREVIOUS_CALLS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
        install_panic_hook();
        install_panic_hook(); // idempotent: still one log line per panic

        let capture = Capture::default();
        let writer = capture.clone();
        let result = std::thread::Builder::new()
            .name("doomed-worker".into())
            .spawn(move || {
                let subscriber = tracing_subscriber::fmt()
                    .with_writer(move || writer.clone())
                    .with_ansi(false)
                    .finish();
                tracing::subscriber::with_default(subscriber, || panic!("boom {}", 42));
            })
            .unwrap()
            .join();
        assert!(result.is_err());
        let logged = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
        assert!(logged.contains("panic: boom 42"), "{logged}");
        assert!(logged.contains("doomed-worker"), "{logged}");
        assert!(logged.contains("telemetry.rs"), "{logged}");
        assert_eq!(logged.matches("panic: boom 42").count(), 1, "{logged}");
        assert!(PREVIOUS_CALLS.load(Ordering::SeqCst) >= 1);
    }

    #[test]
    fn init_tracing_is_idempotent() {
        // The first call may or may not win (another test binary thread could have
        // installed one); the second never does.
        let _ = init_tracing("info", LogFormat::Json);
        assert!(!init_tracing("debug", LogFormat::Human));
    }
}
