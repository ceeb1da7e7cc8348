//! How to build a transfer engine: [`TransferConfig`] and the settings it holds.
//!
//! The engine's own configuration, independent of how the serving config spells it: the
//! caller that knows both (the instance, from `[transfer]`) builds one and hands it over.

use std::net::SocketAddr;
use std::time::Duration;

use crate::control::tls::MemberCredentials;
use crate::error::{Result, TransportError};

/// Which medium moves the bytes: the config's `transfer.backend` enum (one type from the
/// config file to the engine; `FromStr`/serde accept `local`, `shm`, `tcp`, `quic`, `rdma`).
pub use pdserve_runtime::config::TransferBackend as BackendKind;

/// How to build a [`TransferEngine`](crate::TransferEngine).
#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// The backend.
    pub backend: BackendKind,
    /// This engine's name, shown to peers (in notifications) and in logs.
    pub name: String,
    /// Where `shm` (control), `tcp` and `quic` listen; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Parallel data connections per peer (`tcp`).
    pub tcp_connections: usize,
    /// Largest piece one wire operation or memcpy step moves; larger operations are split.
    pub piece_bytes: u64,
    /// Largest single registration; larger regions are registered in chunks (RDMA limits it;
    /// `None` means one chunk per region).
    pub max_registration_bytes: Option<u64>,
    /// Limit for opening a session.
    pub connect_timeout: Duration,
    /// A silent peer is declared gone after this long (`quic` idle timeout).
    pub peer_timeout: Duration,
    /// Threads of the engine's I/O runtime.
    pub io_threads: usize,
    /// Copy threads of the `local` and `shm` backends (a batch of several pieces is copied
    /// by all of them at once).
    pub memcpy_threads: usize,
    /// Bounded queue depth of the executors (batches for memcpy, pieces per connection).
    pub queue_depth: usize,
    /// Largest notification payload.
    pub max_notify_bytes: usize,
    /// Cluster member credentials (required by `quic`: mutual TLS).
    pub credentials: Option<MemberCredentials>,
    /// Every connection must prove a session key
    /// ([`TransferEngine::grant_session`](crate::TransferEngine::grant_session)) before any
    /// operation. When false, keys become required anyway from the first grant on.
    pub require_auth: bool,
    /// What peers are told to connect to: an IP (the bound port is kept) or `IP:port`.
    /// `None`: the bound address, or, when `listen` is unspecified (`0.0.0.0`, `::`), the
    /// address of the interface that routes to the peer
    /// ([`TransferEngine::address_for`](crate::TransferEngine::address_for)).
    pub advertise_addr: Option<String>,
    /// Protection of `tcp` frames of authenticated sessions.
    pub tcp_integrity: TcpIntegrity,
    /// RDMA devices, port, GID, MTU and queue depths (`rdma`).
    pub rdma: RdmaConfig,
}

/// Protection of the frames of an authenticated `tcp` session (`transfer.tcp_integrity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TcpIntegrity {
    /// Frames travel as they are: the key proof authenticates the connection, not its bytes.
    #[default]
    None,
    /// Every frame carries an AES-256-GCM tag over its header and payload (tampering,
    /// replay and reordering are detected; bytes travel in the clear).
    Mac,
    /// Every frame's payload is encrypted with AES-256-GCM, its header authenticated.
    Encrypt,
}

impl std::str::FromStr for TcpIntegrity {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Self::None),
            "mac" => Ok(Self::Mac),
            "encrypt" => Ok(Self::Encrypt),
            other => Err(TransportError::Config(format!(
                "unknown tcp_integrity {other:?} (none, mac, encrypt)"
            ))),
        }
    }
}

/// The RDMA settings (`transfer.rdma_*`), checked by [`TransferConfig::validate`] without
/// touching a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Devices to use (`mlx5_0`, ...); batches are striped over them. Empty: the first device.
    pub devices: Vec<String>,
    /// Port number on each device.
    pub port: u8,
    /// GID table index; `None`: the first RoCE v2 entry holding an IPv4 address (InfiniBand
    /// ports use no GID).
    pub gid_index: Option<u32>,
    /// Path MTU in bytes (256 to 4096, a power of two); `None`: the port's active MTU.
    pub mtu: Option<u32>,
    /// Work requests in flight per queue pair.
    pub send_queue_depth: u32,
    /// Completion-queue entries per queue pair (at least `send_queue_depth`).
    pub cq_depth: u32,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            devices: Vec::new(),
            port: 1,
            gid_index: None,
            mtu: None,
            send_queue_depth: 512,
            cq_depth: 1024,
        }
    }
}

impl RdmaConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`TransportError::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(TransportError::Config(m));
        if let Some(d) = self
            .devices
            .iter()
            .find(|d| d.is_empty() || d.contains(char::is_whitespace))
        {
            return bad(format!("rdma device name {d:?} is empty or has whitespace"));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(d) = self.devices.iter().find(|d| !seen.insert(*d)) {
            return bad(format!("rdma device {d:?} is listed twice"));
        }
        if self.port == 0 {
            return bad("rdma port must be ≥ 1".into());
        }
        if let Some(m) = self.mtu {
            if !matches!(m, 256 | 512 | 1024 | 2048 | 4096) {
                return bad(format!(
                    "rdma mtu must be 256, 512, 1024, 2048 or 4096, got {m}"
                ));
            }
        }
        if !(1..=32768).contains(&self.send_queue_depth) {
            return bad(format!(
                "rdma send_queue_depth must be 1..=32768, got {}",
                self.send_queue_depth
            ));
        }
        if self.cq_depth < self.send_queue_depth || self.cq_depth > 1 << 22 {
            return bad(format!(
                "rdma cq_depth must be between send_queue_depth ({}) and 4194304, got {}",
                self.send_queue_depth, self.cq_depth
            ));
        }
        Ok(())
    }
}

impl TransferConfig {
    /// Defaults for `backend`, listening on 127.0.0.1 with a free port.
    pub fn new(backend: BackendKind, name: impl Into<String>) -> Self {
        Self {
            backend,
            name: name.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp_connections: 4,
            piece_bytes: 1 << 20,
            max_registration_bytes: None,
            connect_timeout: Duration::from_secs(5),
            peer_timeout: Duration::from_secs(5),
            io_threads: 2,
            memcpy_threads: 2,
            queue_depth: 256,
            max_notify_bytes: 64 << 10,
            credentials: None,
            require_auth: false,
            advertise_addr: None,
            tcp_integrity: TcpIntegrity::None,
            rdma: RdmaConfig::default(),
        }
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`TransportError::Config`] naming the first bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(TransportError::Config(m.to_string()));
        if self.tcp_connections == 0 || self.tcp_connections > 64 {
            return bad("tcp_connections must be 1..=64");
        }
        if self.piece_bytes < 4096 {
            return bad("piece_bytes must be at least 4096");
        }
        if self.max_registration_bytes == Some(0) {
            return bad("max_registration_bytes must be positive");
        }
        if self.io_threads == 0 || self.queue_depth == 0 {
            return bad("io_threads and queue_depth must be positive");
        }
        if !(1..=64).contains(&self.memcpy_threads) {
            return bad("memcpy_threads must be 1..=64");
        }
        if self.backend == BackendKind::Quic && self.credentials.is_none() {
            return bad("the quic backend needs cluster member credentials (mutual TLS)");
        }
        if let Some(a) = &self.advertise_addr {
            parse_advertise(a)?;
        }
        self.rdma.validate()
    }
}

/// A configured advertised address: a whole socket address, or an IP to pair with the bound
/// port.
pub(crate) fn parse_advertise(a: &str) -> Result<(std::net::IpAddr, Option<u16>)> {
    if let Ok(sock) = a.parse::<SocketAddr>() {
        return Ok((sock.ip(), Some(sock.port())));
    }
    a.parse::<std::net::IpAddr>()
        .map(|ip| (ip, None))
        .map_err(|_| {
            TransportError::Config(format!(
                "advertise_addr must be an IP or IP:port, got {a:?}"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation_names_bad_values() {
        let mut c = TransferConfig::new(BackendKind::Tcp, "a");
        c.validate().unwrap();
        c.tcp_connections = 0;
        assert!(matches!(c.validate(), Err(TransportError::Config(_))));
        let q = TransferConfig::new(BackendKind::Quic, "q");
        assert!(matches!(q.validate(), Err(TransportError::Config(_))));
        assert_eq!("shm".parse::<BackendKind>().unwrap(), BackendKind::Shm);
        assert!("nope".parse::<BackendKind>().is_err());
        let mut m = TransferConfig::new(BackendKind::Shm, "m");
        for bad in [0, 65] {
            m.memcpy_threads = bad;
            assert!(
                matches!(m.validate(), Err(TransportError::Config(_))),
                "{bad}"
            );
        }
    }
}
