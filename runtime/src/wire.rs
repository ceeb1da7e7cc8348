//! The control-plane wire format: typed messages encoded with rkyv, in length-prefixed frames.
//!
//! A frame is a 4-byte little-endian payload length followed by the payload, the rkyv archive of
//! one [`Envelope`]. Decoding always validates the archive (`rkyv::access`, bytecheck), then checks
//! its bounds, then deserializes (`rkyv::deserialize`): a
//! malformed, truncated or oversized frame is a [`WireError`], never a panic or undefined
//! behaviour. `access_unchecked` is not used anywhere.
//!
//! The message set is an enum that grows by appending variants; peers of different versions meet
//! at [`Hello`], which carries the pdserve version. A message whose tag this version does not
//! know (a newer peer's) is a [`WireError::UnknownMessage`].
//!
//! Every string and list in a message is bounded ([`bounds`]): after an archive validates, its
//! lengths and counts are checked on the archive itself, before anything is deserialized, and
//! a field past its bound is a typed [`WireError`] naming it.
//!
//! The control plane's exchanges are all typed messages here: the greeting, heartbeats,
//! registration with the proxy ([`ControlMessage::Register`], answered
//! [`ControlMessage::Registered`] or [`ControlMessage::RegistrationRefused`]), draining
//! ([`ControlMessage::Draining`] / [`ControlMessage::DrainingAck`]) and inspection
//! ([`ControlMessage::InspectRequest`] / [`ControlMessage::Inspect`]). Only protocols layered on
//! top that encode their own bodies use [`ControlMessage::Opaque`]: the P/D peer protocol (rkyv
//! frames of its own) and the prefix cache's KV events.

pub mod bounds;
pub mod kv_events;
mod registration;

use rkyv::rancor;
use rkyv::util::AlignedVec;

pub use registration::{Registration, RegistrationError, RegistrationField};

use crate::supervision::{ClusterSnapshot, InstanceSnapshot};

/// The largest frame payload accepted unless a caller says otherwise (16 MiB).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 << 20;

/// Bytes of the length prefix in front of every frame.
pub const FRAME_HEADER_BYTES: usize = 4;

/// Errors of encoding and decoding control frames.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame's declared length is larger than the receiver accepts.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// Declared (or encoded) payload length.
        len: usize,
        /// The maximum accepted.
        max: usize,
    },
    /// The input ended before the frame did.
    #[error("truncated frame: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the frame needs.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The payload is not a valid archive of an [`Envelope`].
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The message could not be serialized.
    #[error("cannot encode frame: {0}")]
    Encode(String),
    /// A string field is longer than its bound ([`bounds`]).
    #[error("{field} of {len} bytes exceeds the maximum of {max} bytes")]
    FieldTooLong {
        /// The field (`hello.node`, `registration.url`, ...).
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The maximum accepted.
        max: usize,
    },
    /// A list holds more items than its bound ([`bounds`]).
    #[error("{field} holds {count} items, more than the maximum of {max}")]
    TooManyItems {
        /// The list (`regions`, `actors`, `cluster.instances`, ...).
        field: &'static str,
        /// Its item count.
        count: usize,
        /// The maximum accepted.
        max: usize,
    },
    /// A flattened actor tree ([`crate::supervision::ActorTree`]) is empty, deeper than its
    /// bound, or its depths do not form one tree.
    #[error("actor node {at} at depth {depth} does not continue a tree at most {max_depth} deep")]
    BadActorTree {
        /// Index of the node at fault, in pre-order.
        at: usize,
        /// Its depth.
        depth: u32,
        /// The deepest accepted.
        max_depth: u32,
    },
    /// A well-formed envelope around a message tag this version does not know (a newer peer's
    /// message, or a corrupted tag).
    #[error("unknown control message tag {tag} (this pdserve knows tags below {known})")]
    UnknownMessage {
        /// The tag received.
        tag: u8,
        /// How many tags this version knows.
        known: u8,
    },
}

impl WireError {
    /// A stable name of the error kind, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::FrameTooLarge { .. } => "frame_too_large",
            Self::Truncated { .. } => "truncated_frame",
            Self::Malformed(_) => "malformed_frame",
            Self::Encode(_) => "encode",
            Self::FieldTooLong { .. } => "field_too_long",
            Self::TooManyItems { .. } => "too_many_items",
            Self::BadActorTree { .. } => "bad_actor_tree",
            Self::UnknownMessage { .. } => "unknown_message",
        }
    }
}

pub use crate::role::Role;

/// The first message on every control connection, in both directions.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Hello {
    /// Cluster name; must match the receiver's.
    pub cluster: String,
    /// The sender's node name.
    pub node: String,
    /// The sender's role.
    pub role: Role,
    /// The sender's pdserve version.
    pub version: String,
}

/// Load figures carried by heartbeats (used by the proxy to pick instances).
#[derive(
    Debug, Clone, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct LoadFigures {
    /// Requests running now.
    pub running: u32,
    /// Requests waiting in the queue.
    pub waiting: u32,
    /// Free KV blocks.
    pub free_blocks: u64,
    /// All KV blocks.
    pub total_blocks: u64,
}

/// A liveness and load report.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Heartbeat {
    /// The sender's node name.
    pub node: String,
    /// Increases by one per heartbeat of one sender.
    pub seq: u64,
    /// The sender's load.
    pub load: LoadFigures,
}

/// One piece of a registered region, as a backend registered it (RDMA limits one
/// registration's size; other backends use a single chunk).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RegionChunk {
    /// Offset of the chunk inside the region.
    pub offset: u64,
    /// Length of the chunk.
    pub len: u64,
    /// Remote virtual address of the chunk (RDMA), 0 where unused.
    pub addr: u64,
    /// Remote key of the chunk's registration (RDMA), 0 where unused.
    pub rkey: u32,
}

/// How a peer process on the same host obtains a shared-memory region: not by naming the
/// owner's file descriptor, but by asking the owner's descriptor server (a Unix socket) to
/// pass the memfd itself (`SCM_RIGHTS`). The server hands a region only to a process of its
/// own uid that presents the ticket of an answer it gave on an authenticated connection; the
/// asker maps only a memfd received from the process at the other end of that connection.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ShmHandle {
    /// Abstract Unix socket name of the owner's descriptor server (`pdserve-shm-…`, without
    /// the leading NUL).
    pub socket: String,
    /// The region's key in the owner's process.
    pub key: u64,
    /// Capability the owner issued with the answer carrying this handle (all zeros in a
    /// descriptor that was not sent to a peer).
    pub ticket: [u8; 16],
}

/// What a peer needs to reach one registered region.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RegionDescriptor {
    /// Region id, unique within the owning engine.
    pub id: u64,
    /// Length in bytes.
    pub len: u64,
    /// Registration chunks, covering `0..len` in order.
    pub chunks: Vec<RegionChunk>,
    /// Present on the `shm` backend.
    pub shm: Option<ShmHandle>,
}

/// An error reported to a peer.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ErrorMessage {
    /// A stable error kind (`TransportError::kind()` and friends).
    pub kind: String,
    /// Human-readable detail.
    pub message: String,
}

/// The answer to [`ControlMessage::InspectRequest`]: what the member that answers sees.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum InspectAnswer {
    /// An instance answers with its own snapshot.
    Instance(InstanceSnapshot),
    /// A proxy answers with the whole cluster: itself and every registered instance.
    Cluster(ClusterSnapshot),
}

/// Every control-plane message. New variants are appended at the end (a variant's tag is its
/// position; [`ControlMessage::TAGS`] counts them).
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ControlMessage {
    /// Connection greeting (see [`Hello`]).
    Hello(Hello),
    /// Liveness and load.
    Heartbeat(Heartbeat),
    /// Asks for the receiver's registered-memory descriptors.
    GetRegisteredMemory,
    /// The answer to [`ControlMessage::GetRegisteredMemory`].
    RegisteredMemory {
        /// The sender's regions.
        regions: Vec<RegionDescriptor>,
    },
    /// A small application notification.
    Notify {
        /// Opaque payload.
        bytes: Vec<u8>,
    },
    /// Liveness probe; answered with [`ControlMessage::Pong`] carrying the same nonce.
    Ping {
        /// Echoed back.
        nonce: u64,
    },
    /// Answer to [`ControlMessage::Ping`].
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// A failure answer.
    Error(ErrorMessage),
    /// A generic application message for protocols layered on top (P/D handshakes): a topic and
    /// an opaque body the layer above encodes itself.
    Opaque {
        /// What the body is.
        topic: String,
        /// The body.
        body: Vec<u8>,
    },
    /// An instance registers with the proxy (a request, on the connection it then heartbeats
    /// on); answered [`ControlMessage::Registered`] or [`ControlMessage::RegistrationRefused`].
    /// Boxed, as [`ControlMessage::Inspect`] is: a variant larger than the first nine would
    /// grow every archived message, and older peers could read none of them.
    Register(Box<Registration>),
    /// The proxy accepted a registration.
    Registered {
        /// The proxy's node name.
        proxy: String,
    },
    /// The proxy refused a registration: the field at fault and why. The registration the
    /// connection had before (if any) stands.
    RegistrationRefused(RegistrationError),
    /// A registered instance tells the proxy it is draining (a request): the proxy stops
    /// routing to it at once, keeps its entry, and answers [`ControlMessage::DrainingAck`].
    Draining,
    /// The proxy's answer to [`ControlMessage::Draining`].
    DrainingAck,
    /// Asks a member for its live snapshot (a request); answered [`ControlMessage::Inspect`].
    InspectRequest,
    /// The answer to [`ControlMessage::InspectRequest`].
    Inspect(Box<InspectAnswer>),
    /// A registered instance's prefix-cache and KV-tier events since its last batch
    /// (one-way, instance → proxy; see [`kv_events`]).
    KvEvents(Box<kv_events::KvEventBatch>),
}

impl ControlMessage {
    /// How many message tags this version knows (the variants above, in order).
    pub const TAGS: u8 = 17;

    /// The variant's name, for logs and error texts.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Hello(_) => "Hello",
            Self::Heartbeat(_) => "Heartbeat",
            Self::GetRegisteredMemory => "GetRegisteredMemory",
            Self::RegisteredMemory { .. } => "RegisteredMemory",
            Self::Notify { .. } => "Notify",
            Self::Ping { .. } => "Ping",
            Self::Pong { .. } => "Pong",
            Self::Error(_) => "Error",
            Self::Opaque { .. } => "Opaque",
            Self::Register(_) => "Register",
            Self::Registered { .. } => "Registered",
            Self::RegistrationRefused(_) => "RegistrationRefused",
            Self::Draining => "Draining",
            Self::DrainingAck => "DrainingAck",
            Self::InspectRequest => "InspectRequest",
            Self::Inspect(_) => "Inspect",
            Self::KvEvents(_) => "KvEvents",
        }
    }
}

/// How an [`Envelope`] relates to others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum EnvelopeKind {
    /// No answer expected.
    OneWay,
    /// Expects one [`EnvelopeKind::Response`] with the same id.
    Request,
    /// Answers the request with the same id.
    Response,
}

/// The unit carried by one frame: a message plus request/response correlation.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Envelope {
    /// Request id (per connection and direction); 0 for one-way messages.
    pub id: u64,
    /// Request, response or one-way.
    pub kind: EnvelopeKind,
    /// The message.
    pub message: ControlMessage,
}

/// Serializes one value with rkyv.
///
/// # Errors
/// [`WireError::Encode`] when rkyv fails.
pub fn to_archive<T>(value: &T) -> Result<AlignedVec, WireError>
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    rkyv::to_bytes::<rancor::Error>(value).map_err(|e| WireError::Encode(e.to_string()))
}

/// Validates and deserializes an rkyv archive of a `T` from arbitrary (possibly unaligned,
/// possibly hostile) bytes.
///
/// # Errors
/// [`WireError::Malformed`] when the bytes are not a valid archive.
pub fn from_archive<T>(bytes: &[u8]) -> Result<T, WireError>
where
    T: rkyv::Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    // Copy into an aligned buffer: validation would reject unaligned input anyway.
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<T, rancor::Error>(&aligned).map_err(|e| WireError::Malformed(e.to_string()))
}

/// Encodes `envelope` as one frame (length prefix + payload).
///
/// # Errors
/// [`WireError::FrameTooLarge`] when the payload exceeds `max_frame_bytes`;
/// [`WireError::Encode`] when serialization fails.
pub fn encode_frame(envelope: &Envelope, max_frame_bytes: usize) -> Result<Vec<u8>, WireError> {
    let payload = to_archive(envelope)?;
    if payload.len() > max_frame_bytes || payload.len() > u32::MAX as usize {
        return Err(WireError::FrameTooLarge {
            len: payload.len(),
            max: max_frame_bytes,
        });
    }
    let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Reads the payload length from a frame header, checking it against the maximum.
///
/// # Errors
/// [`WireError::FrameTooLarge`] when the declared length exceeds `max_frame_bytes`.
pub fn frame_len(
    header: [u8; FRAME_HEADER_BYTES],
    max_frame_bytes: usize,
) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > max_frame_bytes {
        return Err(WireError::FrameTooLarge {
            len,
            max: max_frame_bytes,
        });
    }
    Ok(len)
}

/// Decodes a frame payload (the bytes after the length prefix): validates the archive, checks
/// every bound ([`bounds`]) on it, and only then deserializes.
///
/// # Errors
/// [`WireError::UnknownMessage`] when a well-formed envelope carries a tag this version does
/// not know; [`WireError::Malformed`] when the payload is not a valid [`Envelope`] archive
/// otherwise; [`WireError::FieldTooLong`], [`WireError::TooManyItems`] and
/// [`WireError::BadActorTree`] when it is one but a field is out of bounds.
pub fn decode_payload(payload: &[u8]) -> Result<Envelope, WireError> {
    // Copy into an aligned buffer: validation would reject unaligned input anyway.
    let mut aligned = AlignedVec::<16>::with_capacity(payload.len());
    aligned.extend_from_slice(payload);
    let archived = match rkyv::access::<ArchivedEnvelope, rancor::Error>(&aligned) {
        Ok(a) => a,
        Err(e) => {
            return Err(unknown_tag(&aligned).unwrap_or(WireError::Malformed(e.to_string())));
        }
    };
    bounds::check_envelope(archived)?;
    rkyv::deserialize::<Envelope, rancor::Error>(archived)
        .map_err(|e| WireError::Malformed(e.to_string()))
}

/// For a payload that did not validate: [`WireError::UnknownMessage`] when its envelope's
/// kind is one we know but its message tag is past ours (rkyv places the root, an
/// [`ArchivedEnvelope`], at the end of the buffer; an archived enum starts with its `u8` tag).
fn unknown_tag(payload: &[u8]) -> Option<WireError> {
    let root = payload
        .len()
        .checked_sub(std::mem::size_of::<ArchivedEnvelope>())?;
    let kind = payload[root + std::mem::offset_of!(ArchivedEnvelope, kind)];
    let tag = payload[root + std::mem::offset_of!(ArchivedEnvelope, message)];
    (kind <= 2 && tag >= ControlMessage::TAGS).then_some(WireError::UnknownMessage {
        tag,
        known: ControlMessage::TAGS,
    })
}

/// Decodes one complete frame at the start of `bytes`, returning the envelope and the number of
/// bytes consumed.
///
/// # Errors
/// [`WireError::Truncated`] when `bytes` holds less than a whole frame,
/// [`WireError::FrameTooLarge`] and [`WireError::Malformed`] as for [`frame_len`] and
/// [`decode_payload`].
pub fn decode_frame(bytes: &[u8], max_frame_bytes: usize) -> Result<(Envelope, usize), WireError> {
    if bytes.len() < FRAME_HEADER_BYTES {
        return Err(WireError::Truncated {
            needed: FRAME_HEADER_BYTES,
            have: bytes.len(),
        });
    }
    let mut header = [0u8; FRAME_HEADER_BYTES];
    header.copy_from_slice(&bytes[..FRAME_HEADER_BYTES]);
    let len = frame_len(header, max_frame_bytes)?;
    let end = FRAME_HEADER_BYTES + len;
    if bytes.len() < end {
        return Err(WireError::Truncated {
            needed: end,
            have: bytes.len(),
        });
    }
    Ok((decode_payload(&bytes[FRAME_HEADER_BYTES..end])?, end))
}

/// An incremental decoder for a byte stream of frames.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    max_frame_bytes: usize,
}

impl FrameDecoder {
    /// A decoder that refuses frames larger than `max_frame_bytes`.
    pub fn new(max_frame_bytes: usize) -> Self {
        Self {
            buf: Vec::new(),
            max_frame_bytes,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Returns the next whole frame, or `None` when more bytes are needed.
    ///
    /// # Errors
    /// [`WireError::FrameTooLarge`] as soon as a header declares an oversized frame (before its
    /// payload arrives), [`WireError::Malformed`] for an invalid payload. After an error the
    /// stream is out of sync and must be closed.
    pub fn next_frame(&mut self) -> Result<Option<Envelope>, WireError> {
        match decode_frame(&self.buf, self.max_frame_bytes) {
            Ok((envelope, used)) => {
                self.buf.drain(..used);
                Ok(Some(envelope))
            }
            Err(WireError::Truncated { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Bytes held that do not yet form a whole frame. A stream that ends with this non-zero
    /// ended in the middle of a frame.
    pub fn pending_bytes(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::registration::tests::registration;
    use super::*;
    use crate::supervision::{
        ActorSnapshot, ActorState, ClusterMember, IndexedInstance, MemberStatus, ProxySnapshot,
        RouterDecisions, RouterSnapshot, TierSnapshot,
    };
    use proptest::prelude::*;

    fn samples() -> Vec<ControlMessage> {
        vec![
            ControlMessage::Hello(Hello {
                cluster: "c".into(),
                node: "n1".into(),
                role: Role::Prefill,
                version: "0.1.0".into(),
            }),
            ControlMessage::Heartbeat(Heartbeat {
                node: "n1".into(),
                seq: 7,
                load: LoadFigures {
                    running: 1,
                    waiting: 2,
                    free_blocks: 3,
                    total_blocks: 4,
                },
            }),
            ControlMessage::GetRegisteredMemory,
            ControlMessage::RegisteredMemory {
                regions: vec![RegionDescriptor {
                    id: 1,
                    len: 8192,
                    chunks: vec![RegionChunk {
                        offset: 0,
                        len: 8192,
                        addr: 0xdead,
                        rkey: 9,
                    }],
                    shm: Some(ShmHandle {
                        socket: "pdserve-shm-1-0123456789abcdef".into(),
                        key: 3,
                        ticket: [7; 16],
                    }),
                }],
            },
            ControlMessage::Notify {
                bytes: vec![1, 2, 3],
            },
            ControlMessage::Ping { nonce: 5 },
            ControlMessage::Pong { nonce: 5 },
            ControlMessage::Error(ErrorMessage {
                kind: "timeout".into(),
                message: "slow".into(),
            }),
            ControlMessage::Opaque {
                topic: "kv".into(),
                body: vec![0; 100],
            },
            ControlMessage::Register(Box::new(registration())),
            ControlMessage::Registered {
                proxy: "proxy".into(),
            },
            ControlMessage::RegistrationRefused(RegistrationError::new(
                RegistrationField::HeartbeatMs,
                "heartbeat_ms 0 is outside 10..=60000",
            )),
            ControlMessage::Draining,
            ControlMessage::DrainingAck,
            ControlMessage::InspectRequest,
            ControlMessage::Inspect(Box::new(InspectAnswer::Instance(instance("decode-0")))),
            ControlMessage::Inspect(Box::new(InspectAnswer::Cluster(cluster()))),
            ControlMessage::KvEvents(Box::new(kv_batch())),
        ]
    }

    fn kv_batch() -> kv_events::KvEventBatch {
        use kv_events::{KvEventBatch, KvOp, TierEvents};
        KvEventBatch {
            snapshot: Some(vec![1, 2, 3]),
            ops: vec![KvOp::Removed(vec![2]), KvOp::Stored(vec![4, 5])],
            tiers: vec![TierEvents {
                medium: "disk".into(),
                snapshot: None,
                ops: vec![KvOp::Stored(vec![2])],
            }],
        }
    }

    #[test]
    fn kv_events_are_bounded_before_they_are_built() {
        use kv_events::{KvOp, TierEvents};
        let refused = |b: kv_events::KvEventBatch| match decode_payload(&payload(
            ControlMessage::KvEvents(Box::new(b)),
        )) {
            Err(WireError::TooManyItems { field, .. }) => field,
            Err(WireError::FieldTooLong { field, .. }) => field,
            other => panic!("not refused: {other:?}"),
        };
        assert!(decode_payload(&payload(ControlMessage::KvEvents(Box::new(kv_batch())))).is_ok());
        // One medium's events past what a log holds between two drains, in one op or many.
        let mut b = kv_batch();
        b.ops = vec![KvOp::Stored(vec![7; bounds::MAX_KV_EVENTS + 1])];
        assert_eq!(refused(b), "kv_events.ops");
        let mut b = kv_batch();
        b.tiers[0].ops = vec![KvOp::Removed(vec![7; 2]); bounds::MAX_KV_EVENTS / 2 + 1];
        assert_eq!(refused(b), "kv_events.tiers.ops");
        let mut b = kv_batch();
        b.tiers = vec![TierEvents::default(); bounds::MAX_MEDIA + 1];
        assert_eq!(refused(b), "kv_events.tiers");
        let mut b = kv_batch();
        b.tiers[0].medium = "m".repeat(bounds::MAX_NAME_BYTES + 1);
        assert_eq!(refused(b), "kv_events.tiers.medium");
    }

    fn actor(name: &str, children: Vec<ActorSnapshot>) -> ActorSnapshot {
        ActorSnapshot {
            name: name.into(),
            kind: "Kind".into(),
            state: ActorState::Running,
            restarts: 1,
            mailbox_depth: 2,
            last_error: Some("boom".into()),
            uptime_s: 1.5,
            children,
        }
    }

    fn tree() -> ActorSnapshot {
        actor(
            "supervisor",
            vec![
                actor(
                    "scheduler",
                    vec![actor("tp-0", vec![]), actor("tp-1", vec![])],
                ),
                actor("kv", vec![actor("sender", vec![actor("leaf", vec![])])]),
                actor("http", vec![]),
            ],
        )
    }

    fn instance(name: &str) -> InstanceSnapshot {
        InstanceSnapshot {
            instance: name.into(),
            role: "decode".into(),
            model: "tiny".into(),
            tp: 2,
            waiting: 1,
            running: 2,
            kv_blocks_total: 100,
            kv_blocks_free: 40,
            kv_blocks_used: 60,
            preemptions: 3,
            transfers_in_flight: 4,
            bytes_sent: 5,
            bytes_received: 6,
            transfer_failures: 7,
            kv_blocks_cached: 8,
            prompt_tokens: 9,
            prompt_tokens_cached: 10,
            cache_evictions: 11,
            local_prefills: 12,
            handoffs_done: 13,
            handoff_bytes: 14,
            handoff_bytes_skipped: 15,
            kv_paths: Vec::new(),
            kv_tiers: vec![TierSnapshot {
                tier: "host".into(),
                blocks: 1,
                ..TierSnapshot::default()
            }],
            encoder: Some(crate::supervision::EncoderSnapshot {
                cache_images: 2,
                ..Default::default()
            }),
            actors: tree(),
        }
    }

    fn cluster() -> ClusterSnapshot {
        ClusterSnapshot {
            proxy: ProxySnapshot {
                node: "proxy".into(),
                cluster: "c".into(),
                url: "http://127.0.0.1:8000".into(),
                control_addr: "127.0.0.1:7000".into(),
                registered: 2,
                routable_prefill: 1,
                routable_decode: 0,
                refused_connections: 3,
                router: Some(RouterSnapshot {
                    kind: "kv".into(),
                    decisions: vec![RouterDecisions {
                        role: "decode".into(),
                        reason: "load".into(),
                        count: 4,
                    }],
                    kv_index: vec![IndexedInstance {
                        url: "http://127.0.0.1:8200".into(),
                        blocks: 5,
                        dropped: 6,
                        by_medium: vec![("pool".into(), 3), ("host".into(), 2)],
                    }],
                }),
                actors: actor("proxy", vec![]),
            },
            instances: vec![
                ClusterMember {
                    node: "decode-0".into(),
                    role: "decode".into(),
                    url: "http://127.0.0.1:8200".into(),
                    control_addr: "127.0.0.1:7200".into(),
                    routable: true,
                    draining: false,
                    last_heartbeat_s: 0.25,
                    status: MemberStatus::Snapshot(Box::new(instance("decode-0"))),
                },
                ClusterMember {
                    node: "prefill-0".into(),
                    role: "prefill".into(),
                    url: "http://127.0.0.1:8100".into(),
                    control_addr: "127.0.0.1:7100".into(),
                    routable: false,
                    draining: true,
                    last_heartbeat_s: 9.0,
                    status: MemberStatus::Unreachable("no inspect answer".into()),
                },
            ],
        }
    }

    /// The raw archive of `message` in a request envelope, past every sender-side check.
    fn payload(message: ControlMessage) -> Vec<u8> {
        to_archive(&Envelope {
            id: 1,
            kind: EnvelopeKind::Request,
            message,
        })
        .unwrap()
        .to_vec()
    }

    #[test]
    fn tags_count_every_variant() {
        // The last variant's tag is TAGS - 1: the tag sits where `unknown_tag` reads it.
        let all = samples();
        let last = payload(all.last().unwrap().clone());
        let root = last.len() - std::mem::size_of::<ArchivedEnvelope>();
        let at = root + std::mem::offset_of!(ArchivedEnvelope, message);
        assert_eq!(last[at], ControlMessage::TAGS - 1);
        let names: std::collections::HashSet<_> = all.iter().map(ControlMessage::name).collect();
        assert_eq!(names.len(), usize::from(ControlMessage::TAGS));
    }

    #[test]
    fn unknown_tags_are_refused_by_name() {
        let mut bytes = payload(ControlMessage::InspectRequest);
        let root = bytes.len() - std::mem::size_of::<ArchivedEnvelope>();
        let at = root + std::mem::offset_of!(ArchivedEnvelope, message);
        for tag in [ControlMessage::TAGS, ControlMessage::TAGS + 1, 0xff] {
            bytes[at] = tag;
            let e = decode_payload(&bytes).unwrap_err();
            assert_eq!(
                e,
                WireError::UnknownMessage {
                    tag,
                    known: ControlMessage::TAGS
                }
            );
            assert_eq!(e.kind(), "unknown_message");
        }
    }

    #[test]
    fn actor_trees_travel_flat_and_come_back_whole() {
        let nodes = crate::supervision::ActorTree::flatten(&tree());
        let depths: Vec<u32> = nodes.iter().map(|n| n.depth).collect();
        assert_eq!(depths, [0, 1, 2, 2, 1, 2, 3, 1]);
        assert_eq!(crate::supervision::ActorTree::build(nodes).unwrap(), tree());
        assert!(crate::supervision::ActorTree::build(Vec::new()).is_err());
    }

    #[test]
    fn oversized_strings_are_refused_naming_the_field() {
        let long = |n: usize| "x".repeat(n);
        let cases = [
            (
                ControlMessage::Register(Box::new(Registration {
                    node: long(bounds::MAX_NAME_BYTES + 1),
                    ..registration()
                })),
                "registration.node",
            ),
            (
                ControlMessage::Register(Box::new(Registration {
                    url: long(bounds::MAX_ADDRESS_BYTES + 1),
                    ..registration()
                })),
                "registration.url",
            ),
            (
                ControlMessage::Opaque {
                    topic: long(bounds::MAX_NAME_BYTES + 1),
                    body: Vec::new(),
                },
                "opaque.topic",
            ),
            (
                ControlMessage::Error(ErrorMessage {
                    kind: "k".into(),
                    message: long(bounds::MAX_TEXT_BYTES + 1),
                }),
                "error.message",
            ),
            (
                ControlMessage::Inspect(Box::new(InspectAnswer::Instance(InstanceSnapshot {
                    actors: actor(&long(bounds::MAX_NAME_BYTES + 1), vec![]),
                    ..instance("decode-0")
                }))),
                "actor.name",
            ),
        ];
        for (message, field) in cases {
            match decode_payload(&payload(message)) {
                Err(WireError::FieldTooLong { field: f, len, max }) => {
                    assert_eq!(f, field);
                    assert_eq!(len, max + 1, "{field}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
        // At the bound exactly, accepted.
        let at_bound = ControlMessage::Register(Box::new(Registration {
            node: long(bounds::MAX_NAME_BYTES),
            ..registration()
        }));
        assert_eq!(
            decode_payload(&payload(at_bound.clone())).unwrap().message,
            at_bound
        );
    }

    #[test]
    fn oversized_lists_are_refused_naming_the_list() {
        let mut c = cluster();
        let member = c.instances[1].clone();
        c.instances = vec![member; bounds::MAX_MEMBERS + 1];
        let wide = ControlMessage::Inspect(Box::new(InspectAnswer::Cluster(c)));
        let e = decode_payload(&payload(wide)).unwrap_err();
        assert_eq!(
            e,
            WireError::TooManyItems {
                field: "cluster.instances",
                count: bounds::MAX_MEMBERS + 1,
                max: bounds::MAX_MEMBERS
            }
        );
        assert_eq!(e.kind(), "too_many_items");

        let region = RegionDescriptor {
            id: 1,
            len: 1,
            chunks: Vec::new(),
            shm: None,
        };
        let many = ControlMessage::RegisteredMemory {
            regions: vec![region; bounds::MAX_REGIONS + 1],
        };
        assert!(matches!(
            decode_payload(&payload(many)),
            Err(WireError::TooManyItems {
                field: "regions",
                ..
            })
        ));

        let mut c = cluster();
        if let Some(r) = c.proxy.router.as_mut() {
            r.kv_index[0].by_medium = vec![("host".into(), 1); bounds::MAX_MEDIA + 1];
        }
        let media = ControlMessage::Inspect(Box::new(InspectAnswer::Cluster(c)));
        assert!(matches!(
            decode_payload(&payload(media)),
            Err(WireError::TooManyItems {
                field: "router.kv_index.by_medium",
                ..
            })
        ));

        let mut snap = instance("decode-0");
        snap.actors.children = vec![actor("a", vec![]); bounds::MAX_ACTORS];
        let crowded = ControlMessage::Inspect(Box::new(InspectAnswer::Instance(snap)));
        assert!(matches!(
            decode_payload(&payload(crowded)),
            Err(WireError::TooManyItems {
                field: "actors",
                ..
            })
        ));
    }

    #[test]
    fn kv_paths_are_bounded() {
        use crate::supervision::KvPathSnapshot;
        let path = |peer: &str, reason: &str| KvPathSnapshot {
            peer: peer.into(),
            path: "host".into(),
            reason: reason.into(),
        };
        let inspect = |kv_paths| {
            payload(ControlMessage::Inspect(Box::new(InspectAnswer::Instance(
                InstanceSnapshot {
                    kv_paths,
                    ..instance("decode-0")
                },
            ))))
        };
        assert!(decode_payload(&inspect(vec![path("p", "other_gpu (rank 0)")])).is_ok());
        assert!(matches!(
            decode_payload(&inspect(vec![path("p", "x"); bounds::MAX_KV_PATHS + 1])),
            Err(WireError::TooManyItems {
                field: "instance.kv_paths",
                ..
            })
        ));
        let long = "r".repeat(bounds::MAX_NAME_BYTES + 1);
        assert!(matches!(
            decode_payload(&inspect(vec![path("p", &long)])),
            Err(WireError::FieldTooLong {
                field: "instance.kv_paths.reason",
                ..
            })
        ));
        let far = "p".repeat(bounds::MAX_ADDRESS_BYTES + 1);
        assert!(matches!(
            decode_payload(&inspect(vec![path(&far, "x")])),
            Err(WireError::FieldTooLong {
                field: "instance.kv_paths.peer",
                ..
            })
        ));
    }

    #[test]
    fn deep_actor_trees_are_refused_before_anything_is_built() {
        let mut deep = actor("leaf", vec![]);
        for _ in 0..=bounds::MAX_ACTOR_DEPTH {
            deep = actor("a", vec![deep]);
        }
        let snap = InstanceSnapshot {
            actors: deep,
            ..instance("decode-0")
        };
        let e = decode_payload(&payload(ControlMessage::Inspect(Box::new(
            InspectAnswer::Instance(snap),
        ))))
        .unwrap_err();
        assert!(
            matches!(e, WireError::BadActorTree { depth, .. } if depth == bounds::MAX_ACTOR_DEPTH + 1),
            "{e:?}"
        );
        assert_eq!(e.kind(), "bad_actor_tree");
    }

    #[test]
    fn truncated_typed_bodies_are_errors() {
        for message in [
            ControlMessage::Register(Box::new(registration())),
            ControlMessage::Inspect(Box::new(InspectAnswer::Cluster(cluster()))),
        ] {
            let env = Envelope {
                id: 2,
                kind: EnvelopeKind::Response,
                message,
            };
            let frame = encode_frame(&env, DEFAULT_MAX_FRAME_BYTES).unwrap();
            let step = (frame.len() / 64).max(1);
            for cut in (0..frame.len()).step_by(step) {
                assert!(
                    matches!(
                        decode_frame(&frame[..cut], DEFAULT_MAX_FRAME_BYTES),
                        Err(WireError::Truncated { .. })
                    ),
                    "cut {cut}"
                );
            }
            // A payload cut short under a header claiming the short length: rkyv reads its
            // root at the end, so a prefix can happen to be another valid archive, but never
            // the message cut, and never a panic.
            let payload = &frame[FRAME_HEADER_BYTES..];
            for cut in (0..payload.len()).step_by(step) {
                if let Ok(other) = decode_payload(&payload[..cut]) {
                    assert_ne!(other, env, "cut {cut}");
                }
            }
        }
    }

    #[test]
    fn every_message_round_trips_through_a_frame() {
        for (i, message) in samples().into_iter().enumerate() {
            for kind in [
                EnvelopeKind::OneWay,
                EnvelopeKind::Request,
                EnvelopeKind::Response,
            ] {
                let env = Envelope {
                    id: i as u64,
                    kind,
                    message: message.clone(),
                };
                let frame = encode_frame(&env, DEFAULT_MAX_FRAME_BYTES).unwrap();
                let (back, used) = decode_frame(&frame, DEFAULT_MAX_FRAME_BYTES).unwrap();
                assert_eq!(back, env);
                assert_eq!(used, frame.len());
            }
        }
    }

    #[test]
    fn truncated_frames_are_errors_at_every_cut() {
        let env = Envelope {
            id: 1,
            kind: EnvelopeKind::Request,
            message: samples()[3].clone(),
        };
        let frame = encode_frame(&env, DEFAULT_MAX_FRAME_BYTES).unwrap();
        for cut in 0..frame.len() {
            match decode_frame(&frame[..cut], DEFAULT_MAX_FRAME_BYTES) {
                Err(WireError::Truncated { .. }) => {}
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        // A payload cut short but with a header claiming the short length is malformed.
        let payload = &frame[FRAME_HEADER_BYTES..];
        for cut in [0, 1, payload.len() / 2, payload.len() - 1] {
            assert!(decode_payload(&payload[..cut]).is_err(), "cut {cut}");
        }
    }

    #[test]
    fn oversized_frames_are_refused_on_both_ends() {
        let env = Envelope {
            id: 1,
            kind: EnvelopeKind::OneWay,
            message: ControlMessage::Notify {
                bytes: vec![0; 2000],
            },
        };
        assert!(matches!(
            encode_frame(&env, 1000),
            Err(WireError::FrameTooLarge { .. })
        ));
        let frame = encode_frame(&env, DEFAULT_MAX_FRAME_BYTES).unwrap();
        assert!(matches!(
            decode_frame(&frame, 1000),
            Err(WireError::FrameTooLarge { .. })
        ));
        // The streaming decoder refuses on the header alone.
        let mut dec = FrameDecoder::new(1000);
        dec.push(&frame[..4]);
        assert!(matches!(
            dec.next_frame(),
            Err(WireError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn stream_decoder_splits_frames_fed_byte_by_byte() {
        let mut stream = Vec::new();
        for (i, m) in samples().into_iter().enumerate() {
            let env = Envelope {
                id: i as u64,
                kind: EnvelopeKind::OneWay,
                message: m,
            };
            stream.extend(encode_frame(&env, DEFAULT_MAX_FRAME_BYTES).unwrap());
        }
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME_BYTES);
        let mut got = Vec::new();
        for b in &stream {
            dec.push(std::slice::from_ref(b));
            while let Some(env) = dec.next_frame().unwrap() {
                got.push(env.message);
            }
        }
        assert_eq!(got, samples());
        assert_eq!(dec.pending_bytes(), 0);
    }

    #[test]
    fn garbage_payloads_are_malformed() {
        assert!(matches!(
            decode_payload(&[0xff; 64]),
            Err(WireError::Malformed(_))
        ));
        assert!(matches!(decode_payload(&[]), Err(WireError::Malformed(_))));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_payload(&bytes);
            let _ = decode_frame(&bytes, 4096);
        }

        #[test]
        fn decoding_mutated_frames_never_panics_and_valid_results_reencode(
            which in 0usize..17,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            cut in any::<usize>(),
        ) {
            let env = Envelope { id: 3, kind: EnvelopeKind::Request, message: samples()[which].clone() };
            let mut frame = encode_frame(&env, DEFAULT_MAX_FRAME_BYTES).unwrap();
            for (pos, val) in flips {
                let at = FRAME_HEADER_BYTES + pos % (frame.len() - FRAME_HEADER_BYTES);
                frame[at] ^= val;
            }
            let keep = FRAME_HEADER_BYTES + cut % (frame.len() - FRAME_HEADER_BYTES + 1);
            if let Ok((decoded, _)) = decode_frame(&frame[..keep], DEFAULT_MAX_FRAME_BYTES) {
                // Whatever validated is a well-formed value that encodes again.
                let again = encode_frame(&decoded, DEFAULT_MAX_FRAME_BYTES).unwrap();
                prop_assert_eq!(decode_frame(&again, DEFAULT_MAX_FRAME_BYTES).unwrap().0, decoded);
            }
        }
    }
}
