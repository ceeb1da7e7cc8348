//! The one error of a KV hand-off, on either side ([`HandoffError`]): pure data, archived
//! with rkyv in the peer protocol's answers. Its conversion from a transfer-engine error lives
//! with the engine's users in `pdserve_actors::handoff::protocol` (`TransferFailure`).

use pdserve_runtime::ids::TransferId;

/// Why a KV hand-off failed, on either side. Travels in the peer protocol's
/// `PeerAnswer::Failed` (`pdserve_actors::handoff::protocol`); [`kind`] is the stable name
/// metrics and logs use.
///
/// [`kind`]: HandoffError::kind
#[derive(
    Debug, Clone, PartialEq, Eq, thiserror::Error, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub enum HandoffError {
    /// Different pdserve version, model, KV dtype or block size.
    #[error("incompatible peer {peer}: it serves `{theirs}`, this instance `{ours}`")]
    Incompatible {
        /// The peer's engine id.
        peer: String,
        /// Its compatibility key.
        theirs: String,
        /// Ours.
        ours: String,
    },
    /// The peer's published layout is inconsistent or does not match ours.
    #[error("KV layout mismatch with {peer}: {reason}")]
    LayoutMismatch {
        /// The peer's engine id.
        peer: String,
        /// What differs.
        reason: String,
    },
    /// Block ids that the request does not own, a wrong number of them, or ids outside a pool.
    #[error("invalid block ids: {0}")]
    InvalidBlocks(String),
    /// A peer-supplied request is malformed or impossible (empty prompt, a token outside the
    /// vocabulary, a prompt longer than the context, bad sampling).
    #[error("bad hand-off request: {0}")]
    BadRequest(String),
    /// The prefill instance refused or failed the prompt; `kind` is its request error kind.
    #[error("the prefill instance failed the prompt ({kind}): {message}")]
    PrefillFailed {
        /// The prefill side's error kind (`worker_failed`, `overloaded`, ...).
        kind: String,
        /// Its message.
        message: String,
    },
    /// The decode instance already aborted this hand-off; a late request for it is refused.
    #[error("transfer {0} was aborted by the decode instance")]
    AlreadyAborted(TransferId),
    /// The hand-off was aborted (the client went away, or decode gave up).
    #[error("the KV hand-off was aborted")]
    Aborted,
    /// The blocks were no longer held when the reader released them: the lease expired (or
    /// the hand-off was aborted) and they may have been reused, so what was read is void.
    #[error("the KV lease of transfer {0} expired (or was aborted) before the read finished: its blocks may have been reused")]
    LeaseExpired(TransferId),
    /// A step of the hand-off did not finish in time.
    #[error("{what} timed out after {secs} s")]
    Timeout {
        /// The step.
        what: String,
        /// Its bound.
        secs: u64,
    },
    /// The peer cannot be reached, or its connection broke.
    #[error("peer {peer} is unreachable: {reason}")]
    PeerGone {
        /// The peer (URL, address or engine id).
        peer: String,
        /// Why.
        reason: String,
    },
    /// The transfer engine failed a batch; `kind` is the transport error kind.
    #[error("KV transfer failed ({kind}): {message}")]
    Transfer {
        /// `TransportError::kind()`.
        kind: String,
        /// Its message.
        message: String,
    },
    /// A TP rank's cache was replaced (a worker restarted) while the KV was arriving.
    #[error("the KV cache was replaced while the hand-off ran: {0}")]
    CacheLost(String),
    /// An actor the hand-off needs failed or is gone (it is restarting, or the instance stops).
    #[error("KV hand-off interrupted: {0}")]
    Interrupted(String),
    /// The instance is over its admission bound.
    #[error("the prefill instance is overloaded: {0}")]
    Overloaded(String),
    /// This instance cannot take part (no transfer engine, wrong role).
    #[error("not supported here: {0}")]
    NotSupported(String),
    /// Test-only fault injection.
    #[error("injected fault: {0}")]
    Injected(String),
    /// The peer broke the protocol: a frame that does not decode, or an answer that does not
    /// fit the request.
    #[error("peer protocol error: {0}")]
    Protocol(String),
    /// The KV landed in a rank's host mirror but could not be moved to its device (decode
    /// with a device KV cache). Last, so earlier variants keep their archived tags.
    #[error("the KV landed but its upload to the device failed: {0}")]
    Upload(String),
}

impl HandoffError {
    /// Whether the failure may leave the transfer session it used stuck (a timeout, a peer
    /// gone, a transport failure): the next hand-off with that peer uses a new session.
    pub fn breaks_session(&self) -> bool {
        matches!(
            self,
            Self::Timeout { .. } | Self::PeerGone { .. } | Self::Transfer { .. }
        )
    }

    /// A stable name of the failure, for metrics (`pdserve_kv_transfer_failures_total{kind}`)
    /// and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Incompatible { .. } | Self::LayoutMismatch { .. } => "handshake",
            Self::InvalidBlocks(_) => "invalid_blocks",
            Self::BadRequest(_) | Self::PrefillFailed { .. } | Self::NotSupported(_) => "refused",
            Self::AlreadyAborted(_) | Self::Aborted => "aborted",
            Self::LeaseExpired(_) => "lease_expired",
            Self::Timeout { .. } => "timeout",
            Self::PeerGone { .. } => "peer_gone",
            Self::Transfer { .. } | Self::Injected(_) => "transfer",
            Self::CacheLost(_) => "cache_lost",
            Self::Interrupted(_) => "interrupted",
            Self::Overloaded(_) => "overloaded",
            Self::Protocol(_) => "protocol",
            Self::Upload(_) => "upload",
        }
    }

    /// A step that did not finish within `bound`.
    pub fn timeout(what: impl Into<String>, bound: std::time::Duration) -> Self {
        Self::Timeout {
            what: what.into(),
            secs: bound.as_secs().max(1),
        }
    }
}
