//! The transport crate's one error type.

use std::sync::Arc;
use std::time::Duration;

use pdserve_runtime::wire::WireError;

/// Which end of a transfer an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// This process's region.
    Local,
    /// The peer's region.
    Remote,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Everything that can go wrong in the transfer engine and the control plane.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    /// An operation names a region that is not registered (here or at the peer).
    #[error("unknown {side} region {id}")]
    UnknownRegion {
        /// Which end.
        side: Side,
        /// The region id named.
        id: u64,
    },
    /// An operation's byte range does not fit inside its region.
    #[error("{side} region {id}: range {offset}+{len} is outside its {region_len} bytes")]
    OutOfBounds {
        /// Which end.
        side: Side,
        /// The region id.
        id: u64,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The peer disconnected, died or shut down.
    #[error("peer {peer} is gone: {reason}")]
    PeerGone {
        /// Peer address or name.
        peer: String,
        /// What was observed.
        reason: String,
    },
    /// A wait, connect or request did not finish in time.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The limit that passed.
        after: Duration,
    },
    /// The peer's registered memory does not have the expected shape, or its descriptors are
    /// inconsistent.
    #[error("memory layout mismatch: {0}")]
    LayoutMismatch(String),
    /// Memory handed to the `shm` backend is not shared memory a peer can map.
    #[error("memory is not shareable: {0}")]
    NotShareable(String),
    /// The peer refused an operation for a reason without its own variant.
    #[error("peer refused: {kind}: {message}")]
    Remote {
        /// The peer's error kind.
        kind: String,
        /// The peer's message.
        message: String,
    },
    /// The peer broke the protocol (unexpected answer, bad header).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A control frame could not be encoded or decoded.
    #[error("wire format: {0}")]
    Wire(#[from] WireError),
    /// An operating-system I/O error.
    #[error("I/O error: {0}")]
    Io(Arc<std::io::Error>),
    /// TLS setup or certificate handling failed.
    #[error("TLS: {0}")]
    Tls(String),
    /// A connection was refused because the peer is not a member of this cluster.
    #[error("not authenticated: {0}")]
    Unauthenticated(String),
    /// A configuration value is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A bounded queue is full; retry later.
    #[error("busy: {0}")]
    Busy(String),
    /// The operation is not available here (backend not compiled in, no device).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The batch was cancelled by its owner.
    #[error("cancelled")]
    Cancelled,
    /// The operation lies outside what the session's grant allows (region, range, direction).
    #[error("not granted: {} of region {region} range {offset}+{len} (fence {fence})", if *write { "write" } else { "read" })]
    NotGranted {
        /// The target's region id.
        region: u64,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Whether it was a write.
        write: bool,
        /// The scope it named.
        fence: u64,
    },
    /// The operation's scope was fenced (closed) by the target, or never opened: its bytes
    /// did not land.
    #[error("fenced: scope {fence} is closed at the target")]
    Fenced {
        /// The scope's fence id.
        fence: u64,
    },
    /// An RDMA device named in the configuration is not there, or unusable.
    #[error("rdma device {device:?}: {reason} (devices here: {available:?})")]
    RdmaDevice {
        /// The device named.
        device: String,
        /// What went wrong.
        reason: String,
        /// The devices this machine lists.
        available: Vec<String>,
    },
}

impl TransportError {
    /// A stable name of the error kind, for logs, metrics and the wire.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnknownRegion { .. } => "unknown_region",
            Self::OutOfBounds { .. } => "out_of_bounds",
            Self::PeerGone { .. } => "peer_gone",
            Self::Timeout { .. } => "timeout",
            Self::LayoutMismatch(_) => "layout_mismatch",
            Self::NotShareable(_) => "not_shareable",
            Self::Remote { .. } => "remote",
            Self::Protocol(_) => "protocol",
            Self::Wire(_) => "wire",
            Self::Io(_) => "io",
            Self::Tls(_) => "tls",
            Self::Unauthenticated(_) => "unauthenticated",
            Self::Config(_) => "config",
            Self::Busy(_) => "busy",
            Self::Unsupported(_) => "unsupported",
            Self::Cancelled => "cancelled",
            Self::NotGranted { .. } => "not_granted",
            Self::Fenced { .. } => "fenced",
            Self::RdmaDevice { .. } => "rdma_device",
        }
    }

    pub(crate) fn peer_gone(peer: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::PeerGone {
            peer: peer.into(),
            reason: reason.to_string(),
        }
    }

    /// Why a QUIC connection to or from `peer` (transfer or control plane) ended, by quinn's
    /// typed error: a failed TLS handshake is [`TransportError::Unauthenticated`], anything
    /// else [`TransportError::PeerGone`].
    ///
    /// A failed handshake is a QUIC *crypto* error code, `0x100 + TLS alert` (RFC 9001
    /// §4.8), whichever end detected it: raised here (`TransportError`, with rustls' reason)
    /// or received in the peer's close (`ConnectionClosed`). rustls sends an alert for every
    /// certificate it refuses (unknown CA, node name not bound, expired), so a refused
    /// certificate always carries such a code.
    pub(crate) fn quic_closed(peer: &str, e: quinn::ConnectionError) -> Self {
        match e {
            quinn::ConnectionError::TransportError(t) if is_crypto(t.code) => {
                Self::Unauthenticated(format!("{peer}: {t}"))
            }
            quinn::ConnectionError::ConnectionClosed(c) if is_crypto(c.error_code) => {
                Self::Unauthenticated(format!("{peer}: {c}"))
            }
            quinn::ConnectionError::TimedOut => Self::peer_gone(peer, "QUIC idle timeout"),
            other => Self::peer_gone(peer, other),
        }
    }
}

/// Whether `code` is a QUIC crypto error: a TLS alert carried as `0x100 + alert` (RFC 9001
/// §4.8).
fn is_crypto(code: quinn::TransportErrorCode) -> bool {
    (0x100..0x200).contains(&u64::from(code))
}

impl From<pdserve_runtime::config::UnknownValue> for TransportError {
    fn from(e: pdserve_runtime::config::UnknownValue) -> Self {
        Self::Config(e.to_string())
    }
}

impl From<std::io::Error> for TransportError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(Arc::new(e))
    }
}

/// The crate's result type.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;
