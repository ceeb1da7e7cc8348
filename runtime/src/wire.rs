//! The control-plane wire format: typed messages encoded with rkyv, in length-prefixed frames.
//!
//! A frame is a 4-byte little-endian payload length followed by the payload, the rkyv archive of
//! one [`Envelope`]. Decoding always validates the archive (`rkyv::from_bytes`, bytecheck): a
//! malformed, truncated or oversized frame is a [`WireError`], never a panic or undefined
//! behaviour. `access_unchecked` is not used anywhere.
//!
//! The message set is an enum that grows by appending variants; peers of different versions meet
//! at [`Hello`], which carries the pdserve version.

use rkyv::rancor;
use rkyv::util::AlignedVec;

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
}

impl WireError {
    /// A stable name of the error kind, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::FrameTooLarge { .. } => "frame_too_large",
            Self::Truncated { .. } => "truncated_frame",
            Self::Malformed(_) => "malformed_frame",
            Self::Encode(_) => "encode",
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

/// Every control-plane message. New variants are appended at the end.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
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

/// Decodes a frame payload (the bytes after the length prefix).
///
/// # Errors
/// [`WireError::Malformed`] when the payload is not a valid [`Envelope`] archive.
pub fn decode_payload(payload: &[u8]) -> Result<Envelope, WireError> {
    from_archive::<Envelope>(payload)
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
    use super::*;
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
        ]
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
            which in 0usize..9,
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
