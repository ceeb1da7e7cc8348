//! The P/D peer protocol: the typed messages a decode instance and a prefill instance exchange
//! to hand a prompt's KV cache over, and the one error type of a hand-off.
//!
//! Every exchange is a request answered once ([`PeerRequest`] → [`PeerAnswer`]), encoded with
//! rkyv and validated on receipt ([`decode_request`], [`decode_answer`]: a malformed or
//! truncated body is a [`HandoffError::Protocol`], never a panic). The same frames travel over
//! either carrier (see [`super::peer`]): the mutual-TLS QUIC control plane (topic
//! [`PEER_TOPIC`]), or, for instances without cluster credentials (a vLLM-style proxy driving
//! plain instances), `POST /v1/kv/peer` on the instance's HTTP API.
//!
//! | request | sent by | answer | meaning |
//! |---|---|---|---|
//! | [`PeerRequest::Info`] | either | [`PeerAnswer::Info`] | the handshake: the peer's KV memory ([`KvPeerInfo`]) |
//! | [`PeerRequest::Prefill`] | decode | [`PeerAnswer::Prefilled`] | run a prompt; pull: hold its blocks under a lease; push: write them into ours layer by layer |
//! | [`PeerRequest::Renew`] | decode | [`PeerAnswer::Renewed`] | extend the leases of held blocks (batched per peer) |
//! | [`PeerRequest::Release`] | decode | [`PeerAnswer::Released`] | the read finished: free the held blocks; the answer says whether the lease was still alive |
//! | [`PeerRequest::Abort`] | decode | [`PeerAnswer::Aborted`] | give up: stop the prefill and its writes, free what is held; answered once no write can land any more |
//! | [`PeerRequest::OpenSession`] | decode | [`PeerAnswer::Session`] | grant a read session to our KV memory (see [`super::session`]) |
//! | [`PeerRequest::OpenRead`] | decode | [`PeerAnswer::ReadOpened`] | open the read scope of a hand-off's held blocks on that session |
//! | [`PeerRequest::Placement`] | decode with device KV | [`PeerAnswer::Placement`] | the second half of the handshake: where each side keeps its KV, to choose CUDA IPC or the host path ([`super::device`]) |
//!
//! Any request may be answered with [`PeerAnswer::Failed`] carrying a [`HandoffError`].
//!
//! The placement exchange is appended to both enums with boxed payloads, so the archives of
//! the older variants are unchanged (a test checks it): an instance without it fails to decode
//! a `Placement` request and answers `Failed`, which the asker takes as "not advertised" and
//! keeps the host path. Instances whose KV is in host memory never send it.

use pdserve_gpu::config::ModelConfig;
use pdserve_gpu::kv::KvLayout;
use pdserve_gpu::sampling::{SamplingParams, TokenLogprobs, MAX_LOGPROBS};
use pdserve_runtime::ids::TransferId;
use pdserve_runtime::wire::{from_archive, to_archive};
use serde::{Deserialize, Serialize};

/// The control-plane topic (and version) of the peer protocol; a peer speaking another
/// version answers `unsupported`.
pub const PEER_TOPIC: &str = "kv/1";

/// Content type of the rkyv frames on the HTTP carrier.
pub const PEER_CONTENT_TYPE: &str = "application/x-pdserve-peer";

/// One TP rank's KV memory as a peer sees it.
#[derive(
    Clone,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct RankKv {
    /// Model-wide KV heads held by this rank (`start..end`).
    pub heads: (usize, usize),
    /// The rank's cache layout (its `num_kv_heads` is `heads.1 - heads.0`).
    pub layout: KvLayout,
    /// The transfer-engine region of each layer, in layer order.
    pub regions: Vec<u64>,
}

/// What an instance publishes about its KV memory (the answer to [`PeerRequest::Info`], and
/// the target of a push).
#[derive(
    Clone,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub struct KvPeerInfo {
    /// The instance's engine id (`remote_engine_id` in `kv_transfer_params`).
    pub engine_id: String,
    /// Human-readable compatibility key; two instances exchange KV only when equal.
    pub compat_key: String,
    /// FNV-1a of `compat_key`, the compatibility hash.
    pub compat_hash: String,
    /// Where its transfer engine listens.
    pub transfer_addr: String,
    /// Transfer backend (`local`, `shm`, `tcp`, `quic`, `rdma`).
    pub backend: String,
    /// KV heads of the whole model.
    pub num_kv_heads: usize,
    /// Per TP rank, in rank order.
    pub ranks: Vec<RankKv>,
}

/// The compatibility key of a model served with a KV layout: pdserve version, model shape,
/// KV dtype and block size.
pub fn compat_key(model: &ModelConfig, block_size: usize, layout: &KvLayout) -> String {
    format!(
        "pdserve/{} arch={} layers={} hidden={} heads={} kv_heads={} head_dim={} vocab={} dtype={:?} block={}",
        pdserve_runtime::PDSERVE_VERSION,
        model.architecture,
        model.num_layers,
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.vocab_size,
        layout.dtype,
        block_size,
    )
}

/// FNV-1a 64 of `key`, as 16 hex digits (stable across builds, unlike `DefaultHasher`).
pub fn compat_hash(key: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// A transfer session a target grants an initiator: the key its connections prove, and where
/// to reach the target's engine. Handed over inside the peer protocol (so, between instances
/// with cluster credentials, only over the mutual-TLS control plane).
#[derive(Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SessionOffer {
    /// The session key.
    pub key: [u8; 32],
    /// The target's transfer engine address.
    pub transfer_addr: String,
}

impl std::fmt::Debug for SessionOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionOffer")
            .field("key", &"<secret>")
            .field("transfer_addr", &self.transfer_addr)
            .finish()
    }
}

/// How the prompt's KV reaches the decode instance.
// Built once per hand-off and moved into the encoder: no box needed for the Push variant.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum PrefillMode {
    /// vLLM NIXL style: the prefill instance holds the prompt's blocks under a lease and
    /// answers their ids; decode reads them, then releases the lease.
    Pull,
    /// Mooncake/SGLang style: the prefill instance writes each layer's blocks into `block_ids`
    /// of `peer` as soon as that layer is computed, and answers once its last write finished.
    Push {
        /// The decode instance's KV memory (validated by the writer: the handshake).
        peer: KvPeerInfo,
        /// Its destination blocks, exactly the prompt's.
        block_ids: Vec<u32>,
        /// The write session the decode instance grants for it (`None` on `local`), whose
        /// scope for this hand-off covers exactly `block_ids`.
        session: Option<SessionOffer>,
    },
}

/// Decode asks prefill to run a prompt and hand its KV over.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PrefillRequest {
    /// The hand-off id both sides use.
    pub transfer: TransferId,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The request's sampling; the prefill side samples T0 with it (its `max_tokens` is
    /// ignored: one token).
    pub sampling: SamplingParams,
    /// Pull or push.
    pub mode: PrefillMode,
    /// Leading blocks of the prompt the decode instance already holds (its prefix cache):
    /// a push writes only the others (its `block_ids` are theirs, in order), a pull reads
    /// only the others. The prefill instance still needs their KV to compute the rest (its
    /// own prefix cache may hold it).
    pub cached_blocks: u32,
}

/// Blocks a prefill instance holds for a pull.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct HeldKv {
    /// The prompt's blocks, in order.
    pub block_ids: Vec<u32>,
    /// How long they stay held unless renewed, in ms.
    pub lease_ms: u64,
}

/// The prompt ran: T0, and for a pull the held blocks.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PrefillAnswer {
    /// The hand-off.
    pub transfer: TransferId,
    /// The first token, sampled by the prefill instance (T0).
    pub first_token: u32,
    /// T0's logprobs, when the request's sampling asked for them
    /// ([`SamplingParams::logprobs`]): the decode side reports them as the first token's.
    /// At most [`MAX_LOGPROBS`] alternatives; checked on receipt against the vocabulary and
    /// the count asked.
    pub first_logprobs: Option<TokenLogprobs>,
    /// Pull: the held blocks. Push: `None` (every write has finished).
    pub held: Option<HeldKv>,
    /// Wall-clock time (µs since the Unix epoch) at which the prefill instance had the whole
    /// prompt computed: the start of the hand-off gap decode measures.
    pub computed_at_unix_us: u64,
    /// Leading prompt tokens the prefill instance took from its prefix cache instead of
    /// computing them; decode reports the larger of this and its own reuse as the request's
    /// `usage.prompt_tokens_details.cached_tokens`. Checked on receipt: below the prompt's
    /// length.
    pub cached_tokens: u32,
}

/// What a decode instance with device KV tells the prefill instance in the placement
/// exchange ([`PeerRequest::Placement`]).
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PlacementAsk {
    /// The asker's KV memory (checked against the answerer's like a handshake).
    pub info: KvPeerInfo,
    /// Where the asker keeps its KV (no handles: a reader shares none).
    pub placement: KvPlacement,
}

/// A request of the peer protocol.
// One message per call, built once and moved into an encoder: the size of the Prefill variant
// costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum PeerRequest {
    /// The handshake: what is your KV memory?
    Info,
    /// Run a prompt and hand its KV over.
    Prefill(PrefillRequest),
    /// Extend the leases of these held hand-offs.
    Renew(Vec<TransferId>),
    /// The read of this hand-off finished: free its held blocks.
    Release(TransferId),
    /// Give up on this hand-off.
    Abort(TransferId),
    /// Grant `initiator` (the caller's engine id) a read session to our KV memory; `fresh`
    /// replaces a grant it already has (its old session is gone).
    OpenSession {
        /// The caller's engine id (on the control plane, checked against its certificate).
        initiator: String,
        /// Replace the current grant.
        fresh: bool,
    },
    /// Open the read scope of `transfer`'s held blocks on `initiator`'s session.
    OpenRead {
        /// The hand-off.
        transfer: TransferId,
        /// The caller's engine id.
        initiator: String,
    },
    /// The placement exchange: where the asker keeps its KV; the answer is the answerer's
    /// [`KvPlacement`], with its IPC handles only when it verified the asker as a process on
    /// its own host and GPU. Appended last and boxed (see the module doc).
    Placement(Box<PlacementAsk>),
    /// A prompt with images (a vision-language model): as [`PeerRequest::Prefill`], the
    /// images' embeddings taken from the encode instance that holds them. Answered
    /// [`PeerAnswer::Prefilled`]. Appended last and boxed (see the module doc).
    PrefillImages(Box<PrefillWithImages>),
}

/// One image of a prompt, by reference: its rows replace the prompt's tokens
/// `at .. at + rows`.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ImageRef {
    /// Prompt position of its first row.
    pub at: u32,
    /// Its digest ([`pdserve_gpu::vision::ImageDigest`]).
    pub digest: [u8; 32],
    /// Its rows.
    pub rows: u32,
}

/// [`PeerRequest::PrefillImages`]'s body.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PrefillWithImages {
    /// The prompt and its hand-off, as for a text prompt.
    pub prefill: PrefillRequest,
    /// Its images, in prompt order.
    pub images: Vec<ImageRef>,
    /// The encode instance that holds their embeddings.
    pub encoder_url: String,
}

/// Most images one prompt of the peer protocol carries.
pub const MAX_PROMPT_IMAGES: usize = 64;

impl PeerRequest {
    /// The variant's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Info => "Info",
            Self::Prefill(_) => "Prefill",
            Self::PrefillImages(_) => "PrefillImages",
            Self::Renew(_) => "Renew",
            Self::Release(_) => "Release",
            Self::Abort(_) => "Abort",
            Self::OpenSession { .. } => "OpenSession",
            Self::OpenRead { .. } => "OpenRead",
            Self::Placement(_) => "Placement",
        }
    }
}

/// An answer of the peer protocol.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum PeerAnswer {
    /// To [`PeerRequest::Info`].
    Info(KvPeerInfo),
    /// To [`PeerRequest::Prefill`].
    Prefilled(PrefillAnswer),
    /// To [`PeerRequest::Renew`]: the hand-offs no longer held (released, expired, unknown).
    Renewed {
        /// Not renewed.
        unknown: Vec<TransferId>,
    },
    /// To [`PeerRequest::Release`]: whether the blocks were still held. `false` means the
    /// lease had expired (or the hand-off was aborted) and the blocks may have been reused.
    Released {
        /// Whether the lease was alive.
        was_held: bool,
    },
    /// To [`PeerRequest::Abort`], sent once none of the hand-off's writes can land any more.
    Aborted {
        /// Whether the prefill instance still had anything of the hand-off.
        found: bool,
    },
    /// To [`PeerRequest::OpenSession`].
    Session(SessionOffer),
    /// To [`PeerRequest::OpenRead`]: the scope is open.
    ReadOpened,
    /// Any request failed.
    Failed(HandoffError),
    /// To [`PeerRequest::Placement`]. Appended last and boxed (see the module doc).
    Placement(Box<KvPlacement>),
}

impl PeerAnswer {
    /// The variant's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Info(_) => "Info",
            Self::Prefilled(_) => "Prefilled",
            Self::Renewed { .. } => "Renewed",
            Self::Released { .. } => "Released",
            Self::Aborted { .. } => "Aborted",
            Self::Session(_) => "Session",
            Self::ReadOpened => "ReadOpened",
            Self::Failed(_) => "Failed",
            Self::Placement(_) => "Placement",
        }
    }
}

pub use pdserve_core::handoff::kv_path::KvPlacement;
pub use pdserve_core::handoff::HandoffError;

/// A transfer-engine failure as a [`HandoffError`]: `HandoffError::transfer(&e)` with this
/// trait in scope (the error lives in `pdserve-core`, which does not know the engine).
pub trait TransferFailure {
    /// A transfer-engine failure.
    fn transfer(e: &pdserve_transport::TransportError) -> Self;
}

impl TransferFailure for HandoffError {
    fn transfer(e: &pdserve_transport::TransportError) -> Self {
        match e {
            pdserve_transport::TransportError::Timeout { what, after } => {
                Self::timeout(format!("KV transfer ({what})"), *after)
            }
            pdserve_transport::TransportError::PeerGone { .. } => Self::PeerGone {
                peer: "transfer peer".into(),
                reason: e.to_string(),
            },
            other => Self::Transfer {
                kind: other.kind().to_string(),
                message: other.to_string(),
            },
        }
    }
}

/// Encodes a request.
///
/// # Errors
/// [`HandoffError::Protocol`] when rkyv cannot encode it.
pub fn encode_request(request: &PeerRequest) -> Result<Vec<u8>, HandoffError> {
    to_archive(request)
        .map(|b| b.to_vec())
        .map_err(|e| HandoffError::Protocol(e.to_string()))
}

/// Most hand-offs one [`PeerRequest::Renew`] (or its answer) names: a decode instance renews
/// the hand-offs it has in flight with one peer, far fewer.
pub const MAX_RENEW_IDS: usize = 4096;
/// Longest prompt a [`PeerRequest::Prefill`] carries, in tokens (past any model's context).
pub const MAX_PROMPT_TOKENS: usize = 1 << 22;
/// Most blocks one hand-off names ([`HeldKv::block_ids`], [`PrefillMode::Push`]'s).
pub const MAX_HANDOFF_BLOCKS: usize = 1 << 20;
/// Longest engine id, address or other name a peer sends, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;
/// Most TP ranks a peer may publish.
pub const MAX_RANKS: usize = 1024;
/// Most regions (layers) one rank may publish.
pub const MAX_RANK_REGIONS: usize = 4096;

fn bound(what: &str, n: usize, max: usize) -> Result<(), HandoffError> {
    if n > max {
        return Err(HandoffError::Protocol(format!(
            "{what}: {n} exceeds the limit of {max}"
        )));
    }
    Ok(())
}

/// A placement's counts and lengths against the protocol's limits (the same as a
/// [`KvPeerInfo`]'s: ranks, regions per rank, names).
fn placement_bounds(p: &KvPlacement) -> Result<(), HandoffError> {
    p.validate_bounds()
        .map_err(|e| HandoffError::Protocol(e.to_string()))
}

impl KvPeerInfo {
    /// Checks the lengths and counts of a peer's published memory against the protocol's
    /// limits (its contents are checked against ours by `plan::validate_peer`).
    ///
    /// # Errors
    /// [`HandoffError::Protocol`] naming the field and its limit.
    pub fn validate_bounds(&self) -> Result<(), HandoffError> {
        for (what, n) in [
            ("engine_id bytes", self.engine_id.len()),
            ("compat_key bytes", self.compat_key.len()),
            ("compat_hash bytes", self.compat_hash.len()),
            ("transfer_addr bytes", self.transfer_addr.len()),
            ("backend bytes", self.backend.len()),
        ] {
            bound(what, n, MAX_NAME_BYTES)?;
        }
        bound("ranks", self.ranks.len(), MAX_RANKS)?;
        for r in &self.ranks {
            bound("rank regions", r.regions.len(), MAX_RANK_REGIONS)?;
        }
        Ok(())
    }
}

impl PeerRequest {
    /// Checks every length and count a peer controls against this protocol's limits, before
    /// anything of the request reaches shared state.
    ///
    /// # Errors
    /// [`HandoffError::Protocol`] naming the field and its limit.
    pub fn validate(&self) -> Result<(), HandoffError> {
        match self {
            Self::Info | Self::Release(_) | Self::Abort(_) => Ok(()),
            Self::Renew(ids) => bound("Renew ids", ids.len(), MAX_RENEW_IDS),
            Self::PrefillImages(p) => {
                bound("PrefillImages images", p.images.len(), MAX_PROMPT_IMAGES)?;
                bound(
                    "PrefillImages encoder_url bytes",
                    p.encoder_url.len(),
                    MAX_NAME_BYTES,
                )?;
                prefill_bounds(&p.prefill)
            }
            Self::Prefill(p) => prefill_bounds(p),
            Self::OpenSession { initiator, .. } | Self::OpenRead { initiator, .. } => {
                bound("initiator bytes", initiator.len(), MAX_NAME_BYTES)
            }
            Self::Placement(ask) => {
                ask.info.validate_bounds()?;
                placement_bounds(&ask.placement)
            }
        }
    }
}

/// The bounds of a prompt's hand-off request (see [`PeerRequest::validate`]).
fn prefill_bounds(p: &PrefillRequest) -> Result<(), HandoffError> {
    bound("Prefill prompt tokens", p.prompt.len(), MAX_PROMPT_TOKENS)?;
    if let PrefillMode::Push {
        peer,
        block_ids,
        session,
    } = &p.mode
    {
        peer.validate_bounds()?;
        bound("Prefill push blocks", block_ids.len(), MAX_HANDOFF_BLOCKS)?;
        if let Some(s) = session {
            bound(
                "session transfer_addr bytes",
                s.transfer_addr.len(),
                MAX_NAME_BYTES,
            )?;
        }
    }
    bound(
        "stop strings",
        p.sampling.stop.len(),
        pdserve_gpu::sampling::MAX_STOP_STRINGS,
    )?;
    bound(
        "stop_token_ids",
        p.sampling.stop_token_ids.len(),
        pdserve_gpu::sampling::MAX_STOP_TOKEN_IDS,
    )?;
    for (what, n) in [
        ("logprobs", p.sampling.logprobs),
        ("prompt_logprobs", p.sampling.prompt_logprobs),
    ] {
        bound(what, n.unwrap_or(0) as usize, MAX_LOGPROBS as usize)?;
    }
    bound(
        "logit_bias",
        p.sampling.logit_bias.len(),
        pdserve_gpu::sampling::MAX_LOGIT_BIAS_ENTRIES,
    )?;
    // Ids are checked against the vocabulary by `validate_prefill`.
    let limit = pdserve_gpu::sampling::MAX_LOGIT_BIAS;
    if let Some(b) = p
        .sampling
        .logit_bias
        .iter()
        .find(|b| !(-limit..=limit).contains(&b.bias))
    {
        return Err(HandoffError::Protocol(format!(
            "logit_bias {} of token {} is outside [-{limit}, {limit}]",
            b.bias, b.token
        )));
    }
    // Structured output: the grammar's size and choices (compiled, with its own
    // limits, only by the Scheduler that runs the prompt).
    if let Some(g) = &p.sampling.grammar {
        g.validate()
            .map_err(|e| HandoffError::Protocol(format!("grammar: {e}")))?;
    }
    Ok(())
}

impl PeerAnswer {
    /// As [`PeerRequest::validate`], for an answer.
    ///
    /// # Errors
    /// [`HandoffError::Protocol`] naming the field and its limit.
    pub fn validate(&self) -> Result<(), HandoffError> {
        match self {
            Self::Info(info) => info.validate_bounds(),
            Self::Prefilled(a) => {
                if let Some(lp) = &a.first_logprobs {
                    // Ids are checked against the vocabulary by the receiver, which knows it.
                    lp.validate(usize::MAX, MAX_LOGPROBS as usize)
                        .map_err(|e| {
                            HandoffError::Protocol(format!("first token logprobs: {e}"))
                        })?;
                }
                match &a.held {
                    Some(h) => bound("held blocks", h.block_ids.len(), MAX_HANDOFF_BLOCKS),
                    None => Ok(()),
                }
            }
            Self::Renewed { unknown } => bound("Renewed ids", unknown.len(), MAX_RENEW_IDS),
            Self::Session(s) => bound(
                "session transfer_addr bytes",
                s.transfer_addr.len(),
                MAX_NAME_BYTES,
            ),
            Self::Released { .. } | Self::Aborted { .. } | Self::ReadOpened | Self::Failed(_) => {
                Ok(())
            }
            Self::Placement(p) => placement_bounds(p),
        }
    }
}

/// Decodes and validates a request ([`PeerRequest::validate`]).
///
/// # Errors
/// [`HandoffError::Protocol`] for bytes that are not a valid archive of a [`PeerRequest`],
/// or one past a limit.
pub fn decode_request(bytes: &[u8]) -> Result<PeerRequest, HandoffError> {
    let request: PeerRequest = from_archive(bytes)
        .map_err(|e| HandoffError::Protocol(format!("bad request frame: {e}")))?;
    request.validate()?;
    Ok(request)
}

/// Encodes an answer.
///
/// # Errors
/// [`HandoffError::Protocol`] when rkyv cannot encode it.
pub fn encode_answer(answer: &PeerAnswer) -> Result<Vec<u8>, HandoffError> {
    to_archive(answer)
        .map(|b| b.to_vec())
        .map_err(|e| HandoffError::Protocol(e.to_string()))
}

/// Decodes and validates an answer.
///
/// # Errors
/// [`HandoffError::Protocol`] for bytes that are not a valid archive of a [`PeerAnswer`].
pub fn decode_answer(bytes: &[u8]) -> Result<PeerAnswer, HandoffError> {
    let answer: PeerAnswer = from_archive(bytes)
        .map_err(|e| HandoffError::Protocol(format!("bad answer frame: {e}")))?;
    answer.validate()?;
    Ok(answer)
}

/// Microseconds since the Unix epoch now (0 if the clock is before it).
pub fn unix_now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_gpu::kv::KvDtype;
    use proptest::prelude::*;

    fn info() -> KvPeerInfo {
        KvPeerInfo {
            engine_id: "d0".into(),
            compat_key: "k".into(),
            compat_hash: compat_hash("k"),
            transfer_addr: "127.0.0.1:1".into(),
            backend: "tcp".into(),
            num_kv_heads: 4,
            ranks: vec![RankKv {
                heads: (0, 4),
                layout: KvLayout {
                    num_layers: 2,
                    num_blocks: 8,
                    block_size: 4,
                    num_kv_heads: 4,
                    head_dim: 8,
                    dtype: KvDtype::F32,
                },
                regions: vec![7, 9],
            }],
        }
    }

    fn requests() -> Vec<PeerRequest> {
        let t = TransferId(0xabc);
        vec![
            PeerRequest::Info,
            PeerRequest::Prefill(PrefillRequest {
                transfer: t,
                prompt: vec![1, 2, 3],
                sampling: SamplingParams::greedy(1),
                mode: PrefillMode::Pull,
                cached_blocks: 0,
            }),
            PeerRequest::Prefill(PrefillRequest {
                transfer: t,
                prompt: vec![5; 9],
                sampling: SamplingParams {
                    temperature: 0.7,
                    seed: Some(3),
                    stop: vec!["x".into()],
                    logit_bias: vec![pdserve_gpu::sampling::LogitBias {
                        token: 2,
                        bias: -3.5,
                    }],
                    ..SamplingParams::default()
                },
                mode: PrefillMode::Push {
                    peer: info(),
                    block_ids: vec![3, 4, 5],
                    session: Some(SessionOffer {
                        key: [7; 32],
                        transfer_addr: "127.0.0.1:9".into(),
                    }),
                },
                cached_blocks: 0,
            }),
            PeerRequest::Renew(vec![t, TransferId(1)]),
            PeerRequest::Release(t),
            PeerRequest::Abort(t),
            PeerRequest::OpenSession {
                initiator: "d0".into(),
                fresh: true,
            },
            PeerRequest::OpenRead {
                transfer: t,
                initiator: "d0".into(),
            },
            PeerRequest::Placement(Box::new(PlacementAsk {
                info: info(),
                placement: placement(false),
            })),
        ]
    }

    fn placement(handles: bool) -> KvPlacement {
        use pdserve_core::handoff::kv_path::{DeviceRank, HostIdentity, IpcRegion, RankPlacement};
        KvPlacement {
            engine_id: "d0".into(),
            host: HostIdentity {
                boot_id: "b".into(),
                proof_id: 9,
                nonce: [3; 32],
            },
            ranks: vec![RankPlacement::Device(DeviceRank {
                gpu_uuid: [1; 16],
                ordinal: 0,
                ipc_export: true,
                region_bytes: vec![4096, 4096],
                handles: if handles {
                    vec![
                        IpcRegion {
                            handle: vec![5; 64],
                            bytes: 4096,
                        };
                        2
                    ]
                } else {
                    Vec::new()
                },
            })],
        }
    }

    fn answers() -> Vec<PeerAnswer> {
        let t = TransferId(0xabc);
        vec![
            PeerAnswer::Info(info()),
            PeerAnswer::Prefilled(PrefillAnswer {
                transfer: t,
                first_token: 17,
                first_logprobs: None,
                held: Some(HeldKv {
                    block_ids: vec![1, 2],
                    lease_ms: 30_000,
                }),
                computed_at_unix_us: 5,
                cached_tokens: 48,
            }),
            PeerAnswer::Renewed { unknown: vec![t] },
            PeerAnswer::Released { was_held: false },
            PeerAnswer::Aborted { found: true },
            PeerAnswer::Session(SessionOffer {
                key: [1; 32],
                transfer_addr: "a".into(),
            }),
            PeerAnswer::ReadOpened,
            PeerAnswer::Failed(HandoffError::LeaseExpired(t)),
            PeerAnswer::Failed(HandoffError::timeout(
                "x",
                std::time::Duration::from_secs(3),
            )),
            PeerAnswer::Placement(Box::new(placement(true))),
        ]
    }

    /// The two enums as they were before the placement exchange.
    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    #[allow(dead_code, clippy::large_enum_variant)]
    enum OldRequest {
        Info,
        Prefill(PrefillRequest),
        Renew(Vec<TransferId>),
        Release(TransferId),
        Abort(TransferId),
        OpenSession {
            initiator: String,
            fresh: bool,
        },
        OpenRead {
            transfer: TransferId,
            initiator: String,
        },
    }

    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    #[allow(dead_code, clippy::large_enum_variant)]
    enum OldAnswer {
        Info(KvPeerInfo),
        Prefilled(PrefillAnswer),
        Renewed { unknown: Vec<TransferId> },
        Released { was_held: bool },
        Aborted { found: bool },
        Session(SessionOffer),
        ReadOpened,
        Failed(HandoffError),
    }

    #[test]
    fn the_placement_exchange_keeps_older_frames_readable() {
        // The archives of the older variants did not move...
        assert_eq!(
            std::mem::size_of::<ArchivedPeerAnswer>(),
            std::mem::size_of::<ArchivedOldAnswer>()
        );
        assert_eq!(
            std::mem::size_of::<ArchivedPeerRequest>(),
            std::mem::size_of::<ArchivedOldRequest>()
        );
        // ...so what an older instance sends decodes here,
        let old = to_archive(&OldAnswer::Info(info())).unwrap();
        assert_eq!(decode_answer(&old).unwrap(), PeerAnswer::Info(info()));
        let old = to_archive(&OldAnswer::Failed(HandoffError::Protocol("x".into()))).unwrap();
        assert_eq!(
            decode_answer(&old).unwrap(),
            PeerAnswer::Failed(HandoffError::Protocol("x".into()))
        );
        let old = to_archive(&OldRequest::Info).unwrap();
        assert_eq!(decode_request(&old).unwrap(), PeerRequest::Info);
        // ...and the placement request is refused by an older one (which answers `Failed`:
        // the asker keeps the host path).
        let new = encode_request(requests().last().unwrap()).unwrap();
        assert!(from_archive::<OldRequest>(&new).is_err());
    }

    #[test]
    fn placement_bounds_are_the_protocol_bounds() {
        use pdserve_core::handoff::kv_path as k;
        assert_eq!(k::MAX_PLACEMENT_RANKS, MAX_RANKS);
        assert_eq!(k::MAX_PLACEMENT_REGIONS, MAX_RANK_REGIONS);
        assert_eq!(k::MAX_ENGINE_ID_BYTES, MAX_NAME_BYTES);
        let mut p = placement(true);
        if let pdserve_core::handoff::kv_path::RankPlacement::Device(d) = &mut p.ranks[0] {
            d.handles[1].handle = vec![0; 65];
        }
        let e = decode_answer(&encode_answer(&PeerAnswer::Placement(Box::new(p))).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("placement.handle bytes: 65"), "{e}");
        let mut p = placement(false);
        p.ranks = vec![pdserve_core::handoff::kv_path::RankPlacement::Host; MAX_RANKS + 1];
        let ask = PeerRequest::Placement(Box::new(PlacementAsk {
            info: info(),
            placement: p,
        }));
        let e = decode_request(&encode_request(&ask).unwrap()).unwrap_err();
        assert!(e.to_string().contains("placement.ranks"), "{e}");
        let mut wide = info();
        wide.ranks = vec![wide.ranks[0].clone(); MAX_RANKS + 1];
        let ask = PeerRequest::Placement(Box::new(PlacementAsk {
            info: wide,
            placement: placement(false),
        }));
        assert!(decode_request(&encode_request(&ask).unwrap()).is_err());
    }

    #[test]
    fn every_message_round_trips() {
        for r in requests() {
            assert_eq!(decode_request(&encode_request(&r).unwrap()).unwrap(), r);
        }
        for a in answers() {
            assert_eq!(decode_answer(&encode_answer(&a).unwrap()).unwrap(), a);
        }
    }

    #[test]
    fn a_request_is_not_an_answer_and_garbage_is_refused() {
        let bytes = encode_request(&requests()[2]).unwrap();
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            assert!(matches!(
                decode_request(&bytes[..cut]),
                Err(HandoffError::Protocol(_))
            ));
        }
        assert!(matches!(
            decode_answer(&[0xff; 40]),
            Err(HandoffError::Protocol(_))
        ));
    }

    #[test]
    fn kinds_are_the_documented_metric_labels() {
        let t = TransferId(1);
        let cases = [
            (HandoffError::LeaseExpired(t), "lease_expired"),
            (HandoffError::InvalidBlocks("x".into()), "invalid_blocks"),
            (HandoffError::Aborted, "aborted"),
            (
                HandoffError::timeout("a", std::time::Duration::ZERO),
                "timeout",
            ),
            (
                HandoffError::PeerGone {
                    peer: "p".into(),
                    reason: "r".into(),
                },
                "peer_gone",
            ),
            (
                HandoffError::LayoutMismatch {
                    peer: "p".into(),
                    reason: "r".into(),
                },
                "handshake",
            ),
        ];
        for (e, kind) in cases {
            assert_eq!(e.kind(), kind, "{e}");
        }
    }

    #[test]
    fn counts_past_the_limits_are_refused_on_decode() {
        let t = TransferId(5);
        let too_many = vec![t; MAX_RENEW_IDS + 1];
        let frame = encode_request(&PeerRequest::Renew(too_many)).unwrap();
        let e = decode_request(&frame).unwrap_err();
        assert!(
            e.to_string()
                .contains("Renew ids: 4097 exceeds the limit of 4096"),
            "{e}"
        );
        let ok = encode_request(&PeerRequest::Renew(vec![t; MAX_RENEW_IDS])).unwrap();
        assert!(decode_request(&ok).is_ok(), "the limit itself is allowed");

        let long_name = PeerRequest::OpenSession {
            initiator: "x".repeat(MAX_NAME_BYTES + 1),
            fresh: false,
        };
        assert!(decode_request(&encode_request(&long_name).unwrap()).is_err());

        let pull = |sampling| {
            PeerRequest::Prefill(PrefillRequest {
                transfer: t,
                prompt: vec![1, 2, 3],
                sampling,
                mode: PrefillMode::Pull,
                cached_blocks: 0,
            })
        };
        let mut sampling = SamplingParams::greedy(1);
        sampling.stop_token_ids = vec![1; pdserve_gpu::sampling::MAX_STOP_TOKEN_IDS + 1];
        assert!(decode_request(&encode_request(&pull(sampling)).unwrap()).is_err());
        let bias = |token, bias| pdserve_gpu::sampling::LogitBias { token, bias };
        for (logit_bias, needle) in [
            (
                vec![bias(1, 0.0); pdserve_gpu::sampling::MAX_LOGIT_BIAS_ENTRIES + 1],
                "logit_bias: 301 exceeds",
            ),
            (vec![bias(1, f32::NAN)], "logit_bias NaN"),
            (vec![bias(1, 1e9)], "outside [-100, 100]"),
        ] {
            let mut sampling = SamplingParams::greedy(1);
            sampling.logit_bias = logit_bias;
            let e = decode_request(&encode_request(&pull(sampling)).unwrap()).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }

        use pdserve_gpu::grammar::{GrammarSpec, MAX_GRAMMAR_BYTES, MAX_GRAMMAR_CHOICES};
        for (grammar, needle) in [
            (
                GrammarSpec::JsonSchema(" ".repeat(MAX_GRAMMAR_BYTES + 1)),
                "more than the 65536 allowed",
            ),
            (
                GrammarSpec::Choice(vec!["a".into(); MAX_GRAMMAR_CHOICES + 1]),
                "choice needs 1 to 256",
            ),
        ] {
            let mut sampling = SamplingParams::greedy(1);
            sampling.grammar = Some(grammar);
            let e = decode_request(&encode_request(&pull(sampling)).unwrap()).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        let mut sampling = SamplingParams::greedy(1);
        sampling.grammar = Some(GrammarSpec::Regex("a".repeat(MAX_GRAMMAR_BYTES)));
        assert!(
            decode_request(&encode_request(&pull(sampling)).unwrap()).is_ok(),
            "the limit itself is allowed"
        );

        let mut wide = info();
        wide.ranks = vec![wide.ranks[0].clone(); MAX_RANKS + 1];
        let e = decode_answer(&encode_answer(&PeerAnswer::Info(wide)).unwrap()).unwrap_err();
        assert!(e.to_string().contains("ranks"), "{e}");
        let renewed = PeerAnswer::Renewed {
            unknown: vec![t; MAX_RENEW_IDS + 1],
        };
        assert!(decode_answer(&encode_answer(&renewed).unwrap()).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        #[test]
        fn mutated_frames_never_panic(which in 0usize..8, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
            let mut bytes = encode_request(&requests()[which]).unwrap();
            for (pos, val) in flips {
                let at = pos % bytes.len();
                bytes[at] ^= val;
            }
            if let Ok(r) = decode_request(&bytes) {
                // Whatever validated encodes again.
                prop_assert_eq!(decode_request(&encode_request(&r).unwrap()).unwrap(), r);
            }
        }
    }
}
