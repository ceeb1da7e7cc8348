//! A multi-host deployment in one TOML file: every host runs `pdserve serve --config FILE
//! --node NAME` with the same file and its own node name, and starts its part — the proxy or
//! one instance.
//!
//! ```toml
//! [cluster]
//! name = "demo"
//! model = "default"        # every instance serves this model
//! transport = "tcp"        # KV transfer backend between instances
//! # credentials_dir = "/etc/pdserve/cluster"   # from `pdserve cluster init` (quic, control plane)
//!
//! [[node]]
//! name = "proxy"
//! role = "proxy"
//! host = "10.0.0.1"        # the address it binds and peers use
//! port = 8000
//! # control_port = 7000    # control plane (UDP); required with credentials_dir
//!
//! [[node]]
//! name = "prefill-0"
//! role = "prefill"
//! host = "10.0.0.2"
//! port = 8100
//! tp = 1
//!
//! [[node]]
//! name = "decode-0"
//! role = "decode"
//! host = "10.0.0.3"
//! port = 8100
//! # device = "cuda"        # model.device of this node: cpu (default), cuda, cuda:N
//! # dtype = "f16"          # model.dtype on CUDA: auto, f16, bf16, f32
//! ```
//!
//! With `cluster.credentials_dir` set, every node gets a control-plane endpoint (mutual-TLS
//! QUIC, member certificate = node name): the proxy listens on `host:control_port`, and every
//! instance registers with it there and sends heartbeats, so `pdserve inspect
//! host:control_port` shows the whole cluster.

use crate::config::{DiscoveryConfig, DiscoveryKind, ServeFlags};
use crate::error::ConfigError;
use crate::role::Role;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// `[cluster]`: what every node shares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Cluster name.
    pub name: String,
    /// Model source for every instance (`default`, a path valid on every host, `synthetic:…`).
    #[serde(default = "default_model")]
    pub model: String,
    /// Names every instance serves the model under (each instance's `model.name`; empty:
    /// the model's own name).
    #[serde(default)]
    pub served_model_name: Vec<String>,
    /// KV transfer backend between instances.
    #[serde(default = "default_transport")]
    pub transport: String,
    /// Cluster credentials directory (required by `quic`); also enables the control plane
    /// (registration, heartbeats, `pdserve inspect`).
    #[serde(default)]
    pub credentials_dir: Option<String>,
    /// KV transfer mode between prefill and decode: `pull` or `push` (layerwise).
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Conditional disaggregation on decode: prompts shorter than this prefill locally.
    #[serde(default)]
    pub min_remote_prompt_tokens: usize,
    /// Conditional disaggregation at the proxy: above this prefill queue, decode prefills.
    #[serde(default)]
    pub max_prefill_queue: Option<usize>,
    /// PEM CA certificate(s) every node trusts (beside the system's roots) when it calls a
    /// node that serves HTTPS (`tls_cert` on that node).
    #[serde(default)]
    pub tls_ca: Option<String>,
    /// Where members find each other: `static` (the one proxy node of this file; the
    /// default) or `etcd` (every member keeps a record in etcd under a lease; several proxy
    /// nodes; needs `credentials_dir`).
    #[serde(default)]
    pub discovery: DiscoveryKind,
    /// etcd's client URLs, with `discovery = "etcd"`.
    #[serde(default)]
    pub etcd_endpoints: Vec<String>,
    /// Seconds a member's etcd lease lives without a keep-alive (default 10).
    #[serde(default)]
    pub lease_ttl_s: Option<u64>,
}

fn default_mode() -> String {
    "pull".into()
}

fn default_model() -> String {
    "default".into()
}

fn default_transport() -> String {
    "tcp".into()
}

/// `[[node]]`: one host's part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Unique node name (also the instance name and its cluster member name).
    pub name: String,
    /// What it runs.
    pub role: Role,
    /// The address it binds and that peers use to reach it.
    pub host: String,
    /// Its HTTP port.
    pub port: u16,
    /// Tensor-parallel ranks (instances).
    #[serde(default = "one")]
    pub tp: usize,
    /// Compute threads (instances; default: all cores).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Control-plane UDP port (used with `cluster.credentials_dir`): required on the proxy,
    /// where instances register and `pdserve inspect` connects; optional on an instance
    /// (default: a free port).
    #[serde(default)]
    pub control_port: Option<u16>,
    /// PEM certificate chain of this node's API (a path on its host): with `tls_key`, the
    /// node serves HTTPS and the others reach it at `https://host:port`.
    #[serde(default)]
    pub tls_cert: Option<String>,
    /// PEM private key of `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<String>,
    /// `model.device` of an instance node: `cpu` (default), `cuda` or `cuda:N` (needs a
    /// binary built with `--features cuda` and a driver on that host).
    #[serde(default)]
    pub device: Option<String>,
    /// `model.dtype` of an instance node on CUDA: `auto`, `f16`, `bf16`, `f32`.
    #[serde(default)]
    pub dtype: Option<String>,
}

/// HTTPS files of one node: `server.tls_*` of an instance, `proxy.tls_*` of the proxy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: Option<String>,
    /// Private key.
    pub key: Option<String>,
    /// Extra trusted CA.
    pub ca: Option<String>,
}

fn one() -> usize {
    1
}

/// A whole deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    /// Shared settings.
    pub cluster: ClusterSection,
    /// The nodes.
    #[serde(rename = "node")]
    pub nodes: Vec<NodeSection>,
}

impl Deployment {
    /// Reads and validates a deployment file.
    ///
    /// # Errors
    /// [`ConfigError::File`] for an unreadable file, [`ConfigError::Parse`] for bad TOML or an
    /// unknown key, [`ConfigError::Invalid`] for an inconsistent deployment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates deployment TOML (`origin` names it in errors).
    ///
    /// # Errors
    /// As [`Deployment::load`].
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let d: Deployment = toml::from_str(text).map_err(|e| ConfigError::Parse {
            message: e.to_string(),
            origin: Some(origin.to_string()),
        })?;
        d.validate()?;
        Ok(d)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.into(),
                message,
                layer: None,
            })
        };
        if self.cluster.name.trim().is_empty() {
            return invalid("cluster.name", "cluster.name must not be empty".into());
        }
        // The same names as `transfer.backend` and `transfer.mode`, which these become.
        if self
            .cluster
            .transport
            .parse::<crate::config::TransferBackend>()
            .is_err()
        {
            return invalid(
                "cluster.transport",
                format!(
                    "cluster.transport must be one of local, shm, tcp, quic, rdma, got `{}`",
                    self.cluster.transport
                ),
            );
        }
        if self
            .cluster
            .mode
            .parse::<crate::config::TransferMode>()
            .is_err()
        {
            return invalid(
                "cluster.mode",
                format!(
                    "cluster.mode must be push or pull, got `{}`",
                    self.cluster.mode
                ),
            );
        }
        if self.cluster.transport == "quic" && self.cluster.credentials_dir.is_none() {
            return invalid(
                "cluster.credentials_dir",
                "the quic transport needs cluster.credentials_dir (pdserve cluster init)".into(),
            );
        }
        let mut names = std::collections::HashSet::new();
        for n in &self.nodes {
            if n.name.trim().is_empty() || !names.insert(n.name.as_str()) {
                return invalid(
                    "node.name",
                    format!("node names must be unique and non-empty (`{}`)", n.name),
                );
            }
            if n.port == 0 {
                return invalid("node.port", format!("node `{}` needs a port", n.name));
            }
            if n.tp == 0 {
                return invalid("node.tp", format!("node `{}`: tp must be ≥ 1", n.name));
            }
            if n.tls_cert.is_some() != n.tls_key.is_some() {
                return invalid(
                    "node.tls_cert",
                    format!(
                        "node `{}`: tls_cert and tls_key go together (HTTPS needs both)",
                        n.name
                    ),
                );
            }
            if let Some(d) = n.device.as_deref().filter(|d| !crate::config::is_device(d)) {
                return invalid(
                    "node.device",
                    format!("node `{}`: device `{d}` (cpu, cuda, cuda:N)", n.name),
                );
            }
            if let Some(d) = n
                .dtype
                .as_deref()
                .filter(|d| !crate::config::CUDA_DTYPES.contains(d))
            {
                return invalid(
                    "node.dtype",
                    format!("node `{}`: dtype `{d}` (auto, f16, bf16, f32)", n.name),
                );
            }
            if n.host.parse::<std::net::IpAddr>().is_err() {
                return invalid(
                    "node.host",
                    format!("node `{}`: host `{}` must be an IP address", n.name, n.host),
                );
            }
        }
        if let Some(n) = self.nodes.iter().find(|n| {
            !matches!(
                n.role,
                Role::Proxy | Role::Prefill | Role::Decode | Role::Encode
            )
        }) {
            return invalid(
                "node.role",
                format!(
                    "node `{}`: role must be proxy, prefill, decode or encode, got `{}`",
                    n.name, n.role
                ),
            );
        }
        let count = |r: Role| self.nodes.iter().filter(|n| n.role == r).count();
        let etcd = self.cluster.discovery == DiscoveryKind::Etcd;
        if etcd {
            if self.cluster.credentials_dir.is_none() {
                return invalid(
                    "cluster.discovery",
                    "cluster.discovery = \"etcd\" needs cluster.credentials_dir: instances register with the proxies over the control plane (pdserve cluster init)".into(),
                );
            }
            if let Some((key, message)) = self.discovery().invalid("cluster") {
                return invalid(&key, message);
            }
            if count(Role::Proxy) == 0 {
                return invalid(
                    "node.role",
                    "a deployment needs at least one proxy node".into(),
                );
            }
        } else if count(Role::Proxy) != 1 {
            return invalid(
                "node.role",
                format!(
                    "a deployment needs exactly one proxy node, found {} (several proxies need cluster.discovery = \"etcd\")",
                    count(Role::Proxy)
                ),
            );
        }
        if self.cluster.credentials_dir.is_some() {
            for proxy in self.nodes.iter().filter(|n| n.role == Role::Proxy) {
                if proxy.control_port.is_none_or(|p| p == 0) {
                    return invalid(
                        "node.control_port",
                        format!(
                            "proxy node `{}` needs a control_port (non-zero) when cluster.credentials_dir is set: instances register there",
                            proxy.name
                        ),
                    );
                }
            }
        }
        if count(Role::Prefill) == 0 || count(Role::Decode) == 0 {
            return invalid(
                "node.role",
                "a deployment needs at least one prefill and one decode node".into(),
            );
        }
        Ok(())
    }

    /// A node by name.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing the nodes when there is none of that name.
    pub fn node(&self, name: &str) -> Result<&NodeSection, ConfigError> {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| ConfigError::Invalid {
                key: "--node".into(),
                message: format!(
                    "no node `{name}` in the deployment (nodes: {})",
                    self.nodes
                        .iter()
                        .map(|n| n.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                layer: None,
            })
    }

    /// `http://host:port` of every node of `role` (`https://` for a node with `tls_cert`).
    pub fn urls(&self, role: Role) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.role == role)
            .map(|n| {
                let scheme = if n.tls_cert.is_some() {
                    "https"
                } else {
                    "http"
                };
                format!("{scheme}://{}:{}", n.host, n.port)
            })
            .collect()
    }

    /// The HTTPS files of `node`: its own certificate and key, the cluster's CA.
    pub fn tls(&self, node: &NodeSection) -> TlsFiles {
        TlsFiles {
            cert: node.tls_cert.clone(),
            key: node.tls_key.clone(),
            ca: self.cluster.tls_ca.clone(),
        }
    }

    /// Where members find each other (`[cluster]`'s `discovery`, `etcd_endpoints`,
    /// `lease_ttl_s`).
    pub fn discovery(&self) -> DiscoveryConfig {
        let defaults = DiscoveryConfig::default();
        DiscoveryConfig {
            kind: self.cluster.discovery,
            etcd_endpoints: self.cluster.etcd_endpoints.clone(),
            lease_ttl_s: self.cluster.lease_ttl_s.unwrap_or(defaults.lease_ttl_s),
            ..defaults
        }
    }

    /// The proxy's control address (`host:control_port`), when the cluster has credentials
    /// and the proxy a control port, and the instances do not find the proxies in etcd.
    pub fn proxy_control_addr(&self) -> Option<String> {
        self.cluster.credentials_dir.as_ref()?;
        if self.cluster.discovery == DiscoveryKind::Etcd {
            return None;
        }
        let proxy = self.nodes.iter().find(|n| n.role == Role::Proxy)?;
        Some(format!("{}:{}", proxy.host, proxy.control_port?))
    }

    /// The serve flags an instance node runs with (the deployment file is their top layer).
    pub fn instance_flags(&self, node: &NodeSection) -> ServeFlags {
        let control = self.cluster.credentials_dir.is_some();
        ServeFlags {
            model: Some(self.cluster.model.clone()),
            served_model_name: self.cluster.served_model_name.clone(),
            tp: Some(node.tp),
            host: Some(node.host.clone()),
            port: Some(node.port),
            role: Some(node.role),
            name: Some(node.name.clone()),
            transfer: Some(self.cluster.transport.clone()),
            transfer_listen: Some(format!("{}:0", node.host)),
            credentials_dir: self.cluster.credentials_dir.clone(),
            transfer_mode: Some(self.cluster.mode.clone()),
            min_remote_prompt_tokens: Some(self.cluster.min_remote_prompt_tokens),
            control_listen: control
                .then(|| format!("{}:{}", node.host, node.control_port.unwrap_or(0))),
            control_proxy: self.proxy_control_addr(),
            discovery: (self.cluster.discovery == DiscoveryKind::Etcd).then(|| self.discovery()),
            tls_cert: node.tls_cert.clone(),
            tls_key: node.tls_key.clone(),
            tls_ca: self.cluster.tls_ca.clone(),
            device: node.device.clone(),
            dtype: node.dtype.clone(),
            ..ServeFlags::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[cluster]
name = "demo"
model = "synthetic:tiny"
transport = "tcp"

[[node]]
name = "proxy"
role = "proxy"
host = "127.0.0.1"
port = 8000

[[node]]
name = "prefill-0"
role = "prefill"
host = "127.0.0.1"
port = 8100
tp = 2

[[node]]
name = "decode-0"
role = "decode"
host = "127.0.0.1"
port = 8200
"#;

    #[test]
    fn parses_nodes_and_derives_instance_flags() {
        let d = Deployment::parse(GOOD, "test").unwrap();
        assert_eq!(
            d.urls(Role::Prefill),
            vec!["http://127.0.0.1:8100".to_string()]
        );
        let flags = d.instance_flags(d.node("prefill-0").unwrap());
        assert_eq!(
            (flags.tp, flags.port, flags.role),
            (Some(2), Some(8100), Some(Role::Prefill))
        );
        assert_eq!(flags.transfer.as_deref(), Some("tcp"));
        assert_eq!(
            flags.control_proxy, None,
            "no credentials, no control plane"
        );
        assert_eq!(flags.control_listen, None);
        let e = d.node("nope").unwrap_err().to_string();
        assert!(e.contains("prefill-0"), "{e}");
    }

    #[test]
    fn credentials_give_the_proxy_a_control_address_and_instances_register_there() {
        let text = GOOD
            .replace(
                "transport = \"tcp\"",
                "transport = \"tcp\"\ncredentials_dir = \"/etc/pdserve/demo\"",
            )
            .replace("port = 8000", "port = 8000\ncontrol_port = 7000")
            .replace("port = 8200", "port = 8200\ncontrol_port = 7200");
        let d = Deployment::parse(&text, "test").unwrap();
        assert_eq!(d.proxy_control_addr().as_deref(), Some("127.0.0.1:7000"));
        let p = d.instance_flags(d.node("prefill-0").unwrap());
        assert_eq!(p.control_proxy.as_deref(), Some("127.0.0.1:7000"));
        assert_eq!(p.control_listen.as_deref(), Some("127.0.0.1:0"));
        assert_eq!(p.credentials_dir.as_deref(), Some("/etc/pdserve/demo"));
        let dd = d.instance_flags(d.node("decode-0").unwrap());
        assert_eq!(dd.control_listen.as_deref(), Some("127.0.0.1:7200"));
        // The flags make a valid instance config (no environment layer: tests run in parallel).
        use figment::providers::Serialized;
        let figment =
            figment::Figment::from(Serialized::defaults(crate::config::ServeConfig::default()))
                .merge(Serialized::defaults(&p));
        let c = crate::config::ServeConfig::from_figment(&figment).unwrap();
        assert_eq!(c.control.proxy.as_deref(), Some("127.0.0.1:7000"));

        let missing = GOOD.replace(
            "transport = \"tcp\"",
            "transport = \"tcp\"\ncredentials_dir = \"/etc/pdserve/demo\"",
        );
        let e = Deployment::parse(&missing, "test").unwrap_err().to_string();
        assert!(e.contains("control_port"), "{e}");
    }

    #[test]
    fn etcd_discovery_allows_several_proxies_and_instances_find_them_in_etcd() {
        let second = "\n[[node]]\nname = \"proxy-b\"\nrole = \"proxy\"\nhost = \"127.0.0.1\"\nport = 8001\ncontrol_port = 7001\n";
        let etcd = GOOD
            .replace(
                "transport = \"tcp\"",
                "transport = \"tcp\"\ncredentials_dir = \"/etc/pdserve/demo\"\ndiscovery = \"etcd\"\netcd_endpoints = [\"http://10.0.0.9:2379\"]\nlease_ttl_s = 5",
            )
            .replace("port = 8000", "port = 8000\ncontrol_port = 7000")
            + second;
        let d = Deployment::parse(&etcd, "test").unwrap();
        assert_eq!(d.proxy_control_addr(), None, "proxies are found in etcd");
        let flags = d.instance_flags(d.node("decode-0").unwrap());
        assert_eq!(flags.control_proxy, None);
        let discovery = flags.discovery.clone().unwrap();
        assert!(discovery.is_etcd());
        assert_eq!(discovery.etcd_endpoints, ["http://10.0.0.9:2379"]);
        assert_eq!(discovery.lease_ttl_s, 5);
        // The flags make a valid instance config carrying the discovery section.
        use figment::providers::Serialized;
        let figment =
            figment::Figment::from(Serialized::defaults(crate::config::ServeConfig::default()))
                .merge(Serialized::defaults(&flags));
        let cfg = crate::config::ServeConfig::from_figment(&figment).unwrap();
        assert_eq!(cfg.control.discovery, discovery);

        // Refused: two proxies without etcd; etcd without credentials, without endpoints,
        // with a lease out of bounds; a proxy without a control port.
        let cases = [
            (GOOD.to_string() + second, "exactly one proxy"),
            (
                etcd.replace("credentials_dir = \"/etc/pdserve/demo\"\n", ""),
                "needs cluster.credentials_dir",
            ),
            (
                etcd.replace("[\"http://10.0.0.9:2379\"]", "[]"),
                "cluster.etcd_endpoints",
            ),
            (
                etcd.replace("lease_ttl_s = 5", "lease_ttl_s = 0"),
                "cluster.lease_ttl_s",
            ),
            (
                etcd.replace("port = 8001\ncontrol_port = 7001", "port = 8001"),
                "proxy-b",
            ),
        ];
        for (text, want) in cases {
            let e = Deployment::parse(&text, "test").unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn a_node_may_run_on_cuda_and_bad_devices_are_refused_by_key() {
        let text = GOOD.replace(
            "port = 8200",
            "port = 8200\ndevice = \"cuda:1\"\ndtype = \"bf16\"",
        );
        let d = Deployment::parse(&text, "test").unwrap();
        let flags = d.instance_flags(d.node("decode-0").unwrap());
        assert_eq!(
            (flags.device.as_deref(), flags.dtype.as_deref()),
            (Some("cuda:1"), Some("bf16"))
        );
        let p = d.instance_flags(d.node("prefill-0").unwrap());
        assert_eq!((p.device, p.dtype), (None, None), "cpu unless a node says");
        let bad = GOOD.replace("port = 8200", "port = 8200\ndevice = \"gpu\"");
        let e = Deployment::parse(&bad, "test").unwrap_err().to_string();
        assert!(
            e.contains("node.device") || e.contains("device `gpu`"),
            "{e}"
        );
        let bad = GOOD.replace("port = 8200", "port = 8200\ndtype = \"f64\"");
        let e = Deployment::parse(&bad, "test").unwrap_err().to_string();
        assert!(e.contains("dtype `f64`"), "{e}");
    }

    #[test]
    fn a_node_with_a_certificate_is_reached_over_https_and_every_node_trusts_the_cluster_ca() {
        let text = GOOD
            .replace(
                "transport = \"tcp\"",
                "transport = \"tcp\"\ntls_ca = \"/tls/ca.pem\"",
            )
            .replace(
                "port = 8200",
                "port = 8200\ntls_cert = \"/tls/d.pem\"\ntls_key = \"/tls/d.key\"",
            );
        let d = Deployment::parse(&text, "test").unwrap();
        assert_eq!(
            d.urls(Role::Decode),
            vec!["https://127.0.0.1:8200".to_string()]
        );
        assert_eq!(
            d.urls(Role::Prefill),
            vec!["http://127.0.0.1:8100".to_string()]
        );
        let flags = d.instance_flags(d.node("decode-0").unwrap());
        assert_eq!(
            (flags.tls_cert.as_deref(), flags.tls_key.as_deref()),
            (Some("/tls/d.pem"), Some("/tls/d.key"))
        );
        let proxy = d.tls(d.node("proxy").unwrap());
        assert_eq!(
            (proxy.cert, proxy.ca.as_deref()),
            (None, Some("/tls/ca.pem"))
        );

        let half = GOOD.replace("port = 8200", "port = 8200\ntls_cert = \"/tls/d.pem\"");
        let e = Deployment::parse(&half, "test").unwrap_err().to_string();
        assert!(e.contains("tls_key"), "{e}");
    }

    #[test]
    fn bad_deployments_are_refused_with_the_reason() {
        let cases = [
            (
                GOOD.replace("role = \"proxy\"", "role = \"decode\""),
                "exactly one proxy",
            ),
            (
                GOOD.replace("name = \"decode-0\"", "name = \"prefill-0\""),
                "unique",
            ),
            (
                GOOD.replace("transport = \"tcp\"", "transport = \"carrier-pigeon\""),
                "cluster.transport",
            ),
            (
                GOOD.replace("transport = \"tcp\"", "transport = \"quic\""),
                "credentials_dir",
            ),
            (GOOD.replace("port = 8200", "port = 8200\nwat = 1"), "wat"),
            (
                GOOD.replace(
                    "host = \"127.0.0.1\"\nport = 8200",
                    "host = \"decode.example\"\nport = 8200",
                ),
                "IP address",
            ),
        ];
        for (text, needle) in cases {
            let e = Deployment::parse(&text, "test").unwrap_err().to_string();
            assert!(e.contains(needle), "expected `{needle}` in: {e}");
        }
    }
}

#[cfg(test)]
mod shipped_configs {
    use super::*;

    #[test]
    fn every_file_in_configs_is_a_valid_deployment() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let d =
                    Deployment::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(!d.urls(Role::Decode).is_empty());
                seen += 1;
            }
        }
        assert!(
            seen >= 3,
            "configs/ should ship single-node 1P1D, 1P2D and a multi-host example"
        );
    }
}
