//! [`DiscoveryConfig`]: where cluster members find each other (`[control.discovery]` of an
//! instance, `[proxy.discovery]` of a proxy, `discovery = "etcd"` in a deployment file).

use serde::{Deserialize, Serialize};

use super::lenient;
use super::values::DiscoveryKind;

/// Bounds of `discovery.lease_ttl_s`: etcd grants leases of at least a few seconds, and a
/// stopped member must leave the routing set within minutes at the latest.
pub const LEASE_TTL_S_RANGE: std::ops::RangeInclusive<u64> = 2..=300;

/// Most etcd endpoints a member is given.
pub const MAX_ETCD_ENDPOINTS: usize = 64;

/// Where members find each other.
///
/// ```toml
/// [control.discovery]          # [proxy.discovery] on a proxy
/// kind = "etcd"
/// etcd_endpoints = ["http://10.0.0.9:2379"]
/// lease_ttl_s = 10
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `static` (the built-in registration, the default) or `etcd`.
    pub kind: DiscoveryKind,
    /// etcd's client URLs (`http://host:2379`), with `kind = "etcd"`.
    #[serde(deserialize_with = "lenient::string_list")]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix under which the cluster's members live (`PREFIX/CLUSTER/instances/NODE`,
    /// `PREFIX/CLUSTER/proxies/NODE`).
    #[serde(deserialize_with = "lenient::string")]
    pub etcd_prefix: String,
    /// Seconds a member's lease lives without a keep-alive: a member that stops answering
    /// (crashed, frozen, cut off) leaves the routing set within this.
    pub lease_ttl_s: u64,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            kind: DiscoveryKind::Static,
            etcd_endpoints: Vec::new(),
            etcd_prefix: "/pdserve".into(),
            lease_ttl_s: 10,
        }
    }
}

impl DiscoveryConfig {
    /// etcd discovery at `endpoints`, other settings at their defaults.
    pub fn etcd(endpoints: Vec<String>) -> Self {
        Self {
            kind: DiscoveryKind::Etcd,
            etcd_endpoints: endpoints,
            ..Self::default()
        }
    }

    /// Whether membership lives in etcd.
    pub fn is_etcd(&self) -> bool {
        self.kind == DiscoveryKind::Etcd
    }

    /// What is wrong with these settings under `section` (`control.discovery`): the key at
    /// fault and why.
    pub fn invalid(&self, section: &str) -> Option<(String, String)> {
        let key = |k: &str| format!("{section}.{k}");
        if !LEASE_TTL_S_RANGE.contains(&self.lease_ttl_s) {
            return Some((
                key("lease_ttl_s"),
                format!(
                    "{} must be between {} and {} seconds, got {}",
                    key("lease_ttl_s"),
                    LEASE_TTL_S_RANGE.start(),
                    LEASE_TTL_S_RANGE.end(),
                    self.lease_ttl_s
                ),
            ));
        }
        let prefix = self.etcd_prefix.as_str();
        if !prefix.starts_with('/') || prefix.len() > 256 || prefix.ends_with('/') && prefix != "/"
        {
            return Some((
                key("etcd_prefix"),
                format!(
                    "{} must start with `/`, not end with one, and be at most 256 bytes, got `{prefix}`",
                    key("etcd_prefix")
                ),
            ));
        }
        if !self.is_etcd() {
            return None;
        }
        if self.etcd_endpoints.is_empty() || self.etcd_endpoints.len() > MAX_ETCD_ENDPOINTS {
            return Some((
                key("etcd_endpoints"),
                format!(
                    "{} must list 1 to {MAX_ETCD_ENDPOINTS} etcd client URLs with kind = \"etcd\", got {}",
                    key("etcd_endpoints"),
                    self.etcd_endpoints.len()
                ),
            ));
        }
        if let Some(bad) = self
            .etcd_endpoints
            .iter()
            .find(|u| !(u.starts_with("http://") || u.starts_with("https://")) || u.len() > 512)
        {
            return Some((
                key("etcd_endpoints"),
                format!(
                    "{}: `{bad}` is not an http:// URL of an etcd member",
                    key("etcd_endpoints")
                ),
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_settings_are_checked_key_by_key() {
        assert_eq!(
            DiscoveryConfig::default().invalid("control.discovery"),
            None
        );
        let good = DiscoveryConfig::etcd(vec!["http://127.0.0.1:2379".into()]);
        assert_eq!(good.invalid("control.discovery"), None);
        let cases = [
            (
                DiscoveryConfig::etcd(vec![]),
                "control.discovery.etcd_endpoints",
            ),
            (
                DiscoveryConfig::etcd(vec!["127.0.0.1:2379".into()]),
                "control.discovery.etcd_endpoints",
            ),
            (
                DiscoveryConfig {
                    lease_ttl_s: 1,
                    ..good.clone()
                },
                "control.discovery.lease_ttl_s",
            ),
            (
                DiscoveryConfig {
                    lease_ttl_s: 301,
                    ..good.clone()
                },
                "control.discovery.lease_ttl_s",
            ),
            (
                DiscoveryConfig {
                    etcd_prefix: "pdserve".into(),
                    ..good.clone()
                },
                "control.discovery.etcd_prefix",
            ),
            (
                DiscoveryConfig {
                    etcd_prefix: "/pdserve/".into(),
                    ..good.clone()
                },
                "control.discovery.etcd_prefix",
            ),
        ];
        for (cfg, key) in cases {
            let (k, message) = cfg.invalid("control.discovery").expect(key);
            assert_eq!(k, key, "{message}");
            assert!(message.contains(key), "{message}");
        }
    }
}
