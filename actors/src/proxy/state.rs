//! [`ProxyState`]: what the proxy's handlers, its poller and its control plane share.

use super::registry::Registry;
use super::routing::RoundRobin;
use std::sync::Mutex;
use std::time::Duration;

/// Shared by the proxy's handlers, its poller and its control plane.
pub struct ProxyState {
    pub(super) registry: Mutex<Registry>,
    pub(super) rr: RoundRobin,
    pub(super) http: reqwest::Client,
    pub(super) timeout: Duration,
    pub(super) max_prefill_queue: Option<usize>,
    pub(super) api_key: Option<String>,
    /// Times one request may move to another decode instance mid-generation.
    pub(super) migration_limit: u32,
    /// What happens when a prefill instance fails before the hand-off.
    pub(super) prefill_retry: pdserve_runtime::config::PrefillRetry,
    pub(super) metrics: pdserve_runtime::telemetry::MetricsHandle,
}

impl ProxyState {
    pub(super) fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call to an instance, with the cluster's API key when the proxy has one (instances
    /// of a cluster share the proxy's key; one without a key ignores it).
    pub(super) fn upstream(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }
}
