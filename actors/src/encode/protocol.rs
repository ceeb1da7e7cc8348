//! The encoder protocol (E → P): the typed messages an instance that needs a request's image
//! embeddings exchanges with the encode instance that holds them, and its one error type.
//!
//! Every exchange is a request answered once ([`EcRequest`] → [`EcAnswer`]), rkyv frames
//! validated on receipt ([`decode_request`], [`decode_answer`]): a malformed, truncated or
//! oversized frame is an [`EncoderError::Protocol`], never a panic. The frames ride the
//! mutual-TLS control plane (topic [`EC_TOPIC`]) between instances with cluster credentials,
//! and `POST /v1/ec/peer` on the encode instance's HTTP API ([`EC_CONTENT_TYPE`]) between
//! instances without; the embeddings themselves move over the transfer engine.
//!
//! | request | answer | meaning |
//! |---|---|---|
//! | [`EcRequest::Info`] | [`EcAnswer::Info`] | the handshake: the encoder's model, row shape and transfer region ([`EncoderInfo`]) |
//! | [`EcRequest::OpenSession`] | [`EcAnswer::Session`] | grant a read session to the encoder's hold region |
//! | [`EcRequest::Hold`] | [`EcAnswer::Held`] | copy these images' embeddings (by digest) into hold slots, under a lease, in a read scope fenced by the hold id |
//! | [`EcRequest::Release`] | [`EcAnswer::Released`] | the read finished: fence the scope, free the slots; says whether the lease was still alive |
//!
//! Any request may be answered [`EcAnswer::Failed`].

use pdserve_runtime::ids::TransferId;
use pdserve_runtime::wire::{from_archive, to_archive};

use crate::handoff::protocol::SessionOffer;

/// Version of the protocol; an encoder answering another version is refused at the
/// handshake.
pub const EC_VERSION: u32 = 1;
/// The control-plane topic of the protocol (between instances with cluster credentials).
pub const EC_TOPIC: &str = "ec/1";
/// Content type of the rkyv frames on `POST /v1/ec/peer`.
pub const EC_CONTENT_TYPE: &str = "application/x-pdserve-encoder";
/// Most images one [`EcRequest::Hold`] names (the most one request may send).
pub const MAX_HOLD_IMAGES: usize = 64;
/// Longest engine id, address or preprocessing key a peer sends, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;
/// Largest frame either side reads.
pub const MAX_FRAME_BYTES: usize = 64 << 10;

/// Why taking a request's image embeddings from an encode instance failed, on either side.
/// [`kind`](EncoderError::kind) is the stable name in metrics and logs.
#[derive(
    Debug, Clone, PartialEq, Eq, thiserror::Error, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub enum EncoderError {
    /// The encoder does not hold this image (evicted from its cache, or never encoded there):
    /// send the request to it with `POST /v1/encode` first.
    #[error("image {0} is not in the encoder's cache (evicted, or never encoded there with POST /v1/encode)")]
    NotCached(String),
    /// The encoder serves another model or preprocessing, or another row shape or backend.
    #[error("encoder {encoder} does not fit this instance: {reason}")]
    Mismatch {
        /// The encoder (URL or engine id).
        encoder: String,
        /// What differs.
        reason: String,
    },
    /// Every hold slot is taken (`multimodal.encoder_hold_slots`), or every session.
    #[error("the encoder is busy: {0}")]
    Overloaded(String),
    /// A request the encoder cannot take (too many images, a hold id in use).
    #[error("bad encoder request: {0}")]
    BadRequest(String),
    /// The encoder cannot be reached, or refused the call.
    #[error("encoder {encoder} is unreachable: {reason}")]
    Unreachable {
        /// Its URL.
        encoder: String,
        /// Why.
        reason: String,
    },
    /// The transfer engine failed the read; `kind` is the transport error kind.
    #[error("moving image embeddings failed ({kind}): {message}")]
    Transfer {
        /// `TransportError::kind()`.
        kind: String,
        /// Its message.
        message: String,
    },
    /// The hold ended (lease expired, released, fenced) before the read finished: what was
    /// read is void.
    #[error("the hold {0} of image embeddings ended before its read finished")]
    LeaseExpired(TransferId),
    /// A step did not finish in time.
    #[error("{what} timed out after {secs} s")]
    Timeout {
        /// The step.
        what: String,
        /// Its bound.
        secs: u64,
    },
    /// The peer broke the protocol: a frame that does not decode, an answer that does not fit.
    #[error("encoder protocol error: {0}")]
    Protocol(String),
    /// This instance cannot take part (no transfer engine, not an encode instance).
    #[error("not supported here: {0}")]
    NotSupported(String),
}

impl EncoderError {
    /// A stable name of the failure.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotCached(_) => "not_cached",
            Self::Mismatch { .. } => "handshake",
            Self::Overloaded(_) => "overloaded",
            Self::BadRequest(_) => "refused",
            Self::Unreachable { .. } => "peer_gone",
            Self::Transfer { .. } => "transfer",
            Self::LeaseExpired(_) => "lease_expired",
            Self::Timeout { .. } => "timeout",
            Self::Protocol(_) => "protocol",
            Self::NotSupported(_) => "not_supported",
        }
    }

    /// A step that did not finish within `bound`.
    pub fn timeout(what: impl Into<String>, bound: std::time::Duration) -> Self {
        Self::Timeout {
            what: what.into(),
            secs: bound.as_secs().max(1),
        }
    }

    /// A transfer-engine failure.
    pub fn transfer(e: &pdserve_transport::TransportError) -> Self {
        Self::Transfer {
            kind: e.kind().to_string(),
            message: e.to_string(),
        }
    }

    /// Whether the session used may be stuck behind a broken link (the next fetch opens a new
    /// one).
    pub fn breaks_session(&self) -> bool {
        matches!(
            self,
            Self::Timeout { .. } | Self::Unreachable { .. } | Self::Transfer { .. }
        )
    }
}

/// An encode instance as the handshake describes it.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct EncoderInfo {
    /// [`EC_VERSION`].
    pub version: u32,
    /// Its engine id (instance name).
    pub engine_id: String,
    /// The model its tower belongs to (served name and weights fingerprint): embeddings are
    /// only taken from an encoder of the same model.
    pub model: String,
    /// Its transfer engine's backend (`local`, `shm`, `tcp`, `quic`, `rdma`).
    pub backend: String,
    /// Its transfer engine's address.
    pub transfer_addr: String,
    /// The vision tower's preprocessing key (model, image size, normalization): part of every
    /// image digest.
    pub preprocessing: String,
    /// Rows of one image's embeddings.
    pub rows: u32,
    /// Width of a row (the decoder's hidden size), f32.
    pub width: u32,
    /// The transfer region of its hold slots.
    pub region: u64,
    /// Bytes of that region.
    pub region_bytes: u64,
    /// Bytes of one slot (`rows · width · 4`).
    pub slot_bytes: u64,
}

/// A request of the encoder protocol.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum EcRequest {
    /// The handshake.
    Info,
    /// Grant `initiator` (the caller's engine id) a read session to the hold region; `fresh`
    /// replaces a grant it already has.
    OpenSession {
        /// The caller's engine id.
        initiator: String,
        /// Replace the current grant.
        fresh: bool,
    },
    /// Hold these images' embeddings for `initiator` to read, in this order.
    Hold {
        /// The hold's id (the fence of its read scope).
        hold: TransferId,
        /// The caller's engine id (whose session the scope opens on).
        initiator: String,
        /// SHA-256 digests of the images ([`pdserve_gpu::vision::ImageDigest`]).
        digests: Vec<[u8; 32]>,
    },
    /// The read of this hold finished: free it.
    Release(TransferId),
}

impl EcRequest {
    /// Its name in logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::OpenSession { .. } => "open_session",
            Self::Hold { .. } => "hold",
            Self::Release(_) => "release",
        }
    }

    fn validate(&self) -> Result<(), EncoderError> {
        match self {
            Self::Info | Self::Release(_) => Ok(()),
            Self::OpenSession { initiator, .. } => name("initiator", initiator),
            Self::Hold {
                initiator, digests, ..
            } => {
                name("initiator", initiator)?;
                if digests.is_empty() || digests.len() > MAX_HOLD_IMAGES {
                    return Err(EncoderError::Protocol(format!(
                        "a hold names 1..={MAX_HOLD_IMAGES} images, got {}",
                        digests.len()
                    )));
                }
                Ok(())
            }
        }
    }
}

/// Images held for a reader.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct HeldImages {
    /// The hold.
    pub hold: TransferId,
    /// Offset in the hold region of each image's slot, in the order asked.
    pub offsets: Vec<u64>,
    /// How long they stay held unless released, in ms.
    pub lease_ms: u64,
}

/// An answer of the encoder protocol.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum EcAnswer {
    /// The handshake's answer.
    Info(EncoderInfo),
    /// A read session's key.
    Session(SessionOffer),
    /// The images are held.
    Held(HeldImages),
    /// The hold was freed; `was_held`: its lease was still alive (so what was read is good).
    Released {
        /// Whether it was still held.
        was_held: bool,
    },
    /// The request failed.
    Failed(EncoderError),
}

impl EcAnswer {
    /// Its name in logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Info(_) => "info",
            Self::Session(_) => "session",
            Self::Held(_) => "held",
            Self::Released { .. } => "released",
            Self::Failed(_) => "failed",
        }
    }

    fn validate(&self) -> Result<(), EncoderError> {
        match self {
            Self::Info(i) => {
                name("engine_id", &i.engine_id)?;
                name("model", &i.model)?;
                name("backend", &i.backend)?;
                name("transfer_addr", &i.transfer_addr)?;
                name("preprocessing", &i.preprocessing)
            }
            Self::Session(s) => name("transfer_addr", &s.transfer_addr),
            Self::Held(h) if h.offsets.len() > MAX_HOLD_IMAGES => Err(EncoderError::Protocol(
                format!("a hold of {} images", h.offsets.len()),
            )),
            Self::Held(_) | Self::Released { .. } | Self::Failed(_) => Ok(()),
        }
    }
}

fn name(what: &str, s: &str) -> Result<(), EncoderError> {
    if s.len() > MAX_NAME_BYTES {
        return Err(EncoderError::Protocol(format!(
            "{what} of {} bytes, more than {MAX_NAME_BYTES}",
            s.len()
        )));
    }
    Ok(())
}

fn frame(bytes: &[u8]) -> Result<(), EncoderError> {
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(EncoderError::Protocol(format!(
            "a frame of {} bytes, more than {MAX_FRAME_BYTES}",
            bytes.len()
        )));
    }
    Ok(())
}

/// Encodes a request.
///
/// # Errors
/// [`EncoderError::Protocol`] when rkyv cannot encode it.
pub fn encode_request(request: &EcRequest) -> Result<Vec<u8>, EncoderError> {
    to_archive(request)
        .map(|b| b.to_vec())
        .map_err(|e| EncoderError::Protocol(e.to_string()))
}

/// Decodes and validates a request.
///
/// # Errors
/// [`EncoderError::Protocol`] for bytes that are not a valid, bounded request.
pub fn decode_request(bytes: &[u8]) -> Result<EcRequest, EncoderError> {
    frame(bytes)?;
    let request: EcRequest = from_archive(bytes)
        .map_err(|e| EncoderError::Protocol(format!("bad request frame: {e}")))?;
    request.validate()?;
    Ok(request)
}

/// Encodes an answer.
///
/// # Errors
/// [`EncoderError::Protocol`] when rkyv cannot encode it.
pub fn encode_answer(answer: &EcAnswer) -> Result<Vec<u8>, EncoderError> {
    to_archive(answer)
        .map(|b| b.to_vec())
        .map_err(|e| EncoderError::Protocol(e.to_string()))
}

/// Decodes and validates an answer.
///
/// # Errors
/// [`EncoderError::Protocol`] for bytes that are not a valid, bounded answer.
pub fn decode_answer(bytes: &[u8]) -> Result<EcAnswer, EncoderError> {
    frame(bytes)?;
    let answer: EcAnswer = from_archive(bytes)
        .map_err(|e| EncoderError::Protocol(format!("bad answer frame: {e}")))?;
    answer.validate()?;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn requests_and_answers_round_trip() {
        let requests = [
            EcRequest::Info,
            EcRequest::OpenSession {
                initiator: "p0".into(),
                fresh: true,
            },
            EcRequest::Hold {
                hold: TransferId(9),
                initiator: "p0".into(),
                digests: vec![[7; 32], [8; 32]],
            },
            EcRequest::Release(TransferId(9)),
        ];
        for r in requests {
            assert_eq!(decode_request(&encode_request(&r).unwrap()).unwrap(), r);
        }
        let answers = [
            EcAnswer::Held(HeldImages {
                hold: TransferId(9),
                offsets: vec![0, 4096],
                lease_ms: 500,
            }),
            EcAnswer::Released { was_held: false },
            EcAnswer::Failed(EncoderError::NotCached("abcd".into())),
        ];
        for a in answers {
            assert_eq!(decode_answer(&encode_answer(&a).unwrap()).unwrap(), a);
        }
    }

    #[test]
    fn unbounded_requests_are_refused_by_name() {
        let too_many = EcRequest::Hold {
            hold: TransferId(1),
            initiator: "p".into(),
            digests: vec![[0; 32]; MAX_HOLD_IMAGES + 1],
        };
        let e = decode_request(&encode_request(&too_many).unwrap()).unwrap_err();
        assert!(e.to_string().contains("1..=64 images"), "{e}");
        let none = EcRequest::Hold {
            hold: TransferId(1),
            initiator: "p".into(),
            digests: Vec::new(),
        };
        assert!(decode_request(&encode_request(&none).unwrap()).is_err());
        let long = EcRequest::OpenSession {
            initiator: "x".repeat(MAX_NAME_BYTES + 1),
            fresh: false,
        };
        let e = decode_request(&encode_request(&long).unwrap()).unwrap_err();
        assert!(e.to_string().contains("initiator"), "{e}");
        let e = decode_request(&vec![0u8; MAX_FRAME_BYTES + 1]).unwrap_err();
        assert!(e.to_string().contains("frame"), "{e}");
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(&bytes);
            let _ = decode_answer(&bytes);
        }
    }
}
