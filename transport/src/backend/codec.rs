//! The frame codec of the byte-stream protocol (`tcp`, `quic`, and the control connection of
//! `shm` and `rdma`): headers, op and status codes, the bounds a peer's frames are held to,
//! and the payloads of greetings, refusals and answers. Pure functions over bytes, no I/O:
//! the connection code that reads and writes frames is `proto.rs`.
//!
//! Requests are a fixed 48-byte header (`op, req id, region, offset, len, fence`) followed by
//! `len` payload bytes for writes, greetings and notifications; answers are a fixed 32-byte
//! header (`status, req id, aux, len`) followed by `len` payload bytes. Every length a peer
//! declares is checked against a bound here before the connection code reads or allocates
//! for it.

use std::collections::HashSet;

use pdserve_runtime::wire::{from_archive, RegionDescriptor};

use crate::auth::{FenceId, RegionGrant, NONCE_BYTES, SESSION_SCOPE, TAG_BYTES};
use crate::error::{Result, Side, TransportError};

pub(crate) const REQ_HEADER: usize = 48;
pub(crate) const RESP_HEADER: usize = 32;
/// Largest payload the target drains for a refused write before giving up on the connection.
pub(crate) const MAX_DRAIN: u64 = 1 << 30;
/// Largest descriptor list accepted from a peer.
pub(crate) const MAX_REGIONS_BYTES: u64 = 64 << 20;
/// Largest error text accepted from a peer.
pub(crate) const MAX_ERROR_BYTES: u64 = 64 << 10;

pub(crate) const OP_HELLO: u8 = 1;
pub(crate) const OP_GET_REGIONS: u8 = 2;
pub(crate) const OP_WRITE: u8 = 3;
pub(crate) const OP_READ: u8 = 4;
pub(crate) const OP_NOTIFY: u8 = 5;
/// RDMA: exchange queue-pair endpoints (payload: JSON endpoint; answer: the target's).
pub(crate) const OP_RDMA_CONNECT: u8 = 6;
/// Proves the session key (payload: [`crate::auth::AUTH_REQUEST_BYTES`]); answer: the
/// server's proof and the session scope's grants (JSON).
pub(crate) const OP_AUTH: u8 = 7;
/// RDMA: the target's memory keys of every region on each of its devices (JSON).
pub(crate) const OP_RDMA_KEYS: u8 = 8;

pub(crate) const ST_OK: u8 = 0;
pub(crate) const ST_REGIONS: u8 = 1;
pub(crate) const ST_DATA: u8 = 2;
pub(crate) const ST_UNKNOWN_REGION: u8 = 3;
pub(crate) const ST_OUT_OF_BOUNDS: u8 = 4;
pub(crate) const ST_ERROR: u8 = 5;
/// The connection has not proven a session key (payload: message); the target closes it.
pub(crate) const ST_UNAUTHENTICATED: u8 = 6;
/// Outside the session's grant (payload: JSON of the refused op).
pub(crate) const ST_NOT_GRANTED: u8 = 7;
/// The op's scope is fenced (aux: the fence id).
pub(crate) const ST_FENCED: u8 = 8;

/// Whether an answer status is a refusal whose error [`decode_refusal`] decodes.
pub(crate) fn is_refusal(status: u8) -> bool {
    matches!(
        status,
        ST_UNKNOWN_REGION
            | ST_OUT_OF_BOUNDS
            | ST_ERROR
            | ST_UNAUTHENTICATED
            | ST_NOT_GRANTED
            | ST_FENCED
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReqHeader {
    pub(crate) op: u8,
    pub(crate) req: u64,
    pub(crate) region: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// The scope the op belongs to ([`SESSION_SCOPE`] for the session's own).
    pub(crate) fence: FenceId,
}

impl ReqHeader {
    /// A control request (no region) carrying `len` payload bytes.
    pub(crate) fn control(op: u8, req: u64, len: usize) -> Self {
        Self {
            op,
            req,
            region: 0,
            offset: 0,
            len: len as u64,
            fence: SESSION_SCOPE,
        }
    }

    pub(crate) fn encode(&self) -> [u8; REQ_HEADER] {
        let mut b = [0u8; REQ_HEADER];
        b[0] = self.op;
        b[8..16].copy_from_slice(&self.req.to_le_bytes());
        b[16..24].copy_from_slice(&self.region.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..48].copy_from_slice(&self.fence.to_le_bytes());
        b
    }
    pub(crate) fn decode(b: &[u8; REQ_HEADER]) -> Self {
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Self {
            op: b[0],
            req: u(8..16),
            region: u(16..24),
            offset: u(24..32),
            len: u(32..40),
            fence: u(40..48),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RespHeader {
    pub(crate) status: u8,
    pub(crate) req: u64,
    pub(crate) aux: u64,
    pub(crate) len: u64,
}

impl RespHeader {
    pub(crate) fn encode(&self) -> [u8; RESP_HEADER] {
        let mut b = [0u8; RESP_HEADER];
        b[0] = self.status;
        b[8..16].copy_from_slice(&self.req.to_le_bytes());
        b[16..24].copy_from_slice(&self.aux.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }
    pub(crate) fn decode(b: &[u8; RESP_HEADER]) -> Self {
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Self {
            status: b[0],
            req: u(8..16),
            aux: u(16..24),
            len: u(24..32),
        }
    }
}

/// What a target's server loop does with a request, by its header alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// `HELLO`, `NOTIFY` or `AUTH`: a payload of at most `max_notify` bytes follows.
    Message,
    /// `GET_REGIONS`.
    GetRegions,
    /// `WRITE`: `len` bytes for target memory follow.
    Write,
    /// `READ`.
    Read,
    /// `RDMA_CONNECT` or `RDMA_KEYS`: a payload of at most `max_notify` bytes follows.
    RdmaControl,
}

/// Classifies a request header, holding the payloads of messages to `max_notify` bytes.
///
/// # Errors
/// `Protocol` for a message larger than `max_notify`, and for an unknown op (an RDMA control
/// request larger than `max_notify` counts as one): the target answers it and closes the
/// connection.
pub(crate) fn classify_request(h: &ReqHeader, max_notify: u64) -> Result<Request> {
    match h.op {
        OP_HELLO | OP_NOTIFY | OP_AUTH if h.len > max_notify => Err(TransportError::Protocol(
            format!("message of {} bytes is too large", h.len),
        )),
        OP_HELLO | OP_NOTIFY | OP_AUTH => Ok(Request::Message),
        OP_GET_REGIONS => Ok(Request::GetRegions),
        OP_WRITE => Ok(Request::Write),
        OP_READ => Ok(Request::Read),
        OP_RDMA_CONNECT | OP_RDMA_KEYS if h.len <= max_notify => Ok(Request::RdmaControl),
        other => Err(TransportError::Protocol(format!(
            "unknown request op {other}"
        ))),
    }
}

/// A greeting: the initiator's backend, engine name and host identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) backend: String,
    pub(crate) name: String,
    pub(crate) host: String,
}

/// The `HELLO` payload.
pub(crate) fn encode_hello(backend: &str, name: &str, host: &str) -> Vec<u8> {
    format!("{backend}\n{name}\n{host}").into_bytes()
}

/// Reads a `HELLO` payload (lossy UTF-8; a missing part is empty).
pub(crate) fn decode_hello(payload: &[u8]) -> Hello {
    let text = String::from_utf8_lossy(payload).to_string();
    let mut parts = text.splitn(3, '\n');
    let mut next = || parts.next().unwrap_or_default().to_string();
    Hello {
        backend: next(),
        name: next(),
        host: next(),
    }
}

/// The server nonce of a `HELLO` answer.
///
/// # Errors
/// `Unauthenticated` when the answer is not a nonce (a target without session keys).
pub(crate) fn decode_hello_answer(answer: &[u8]) -> Result<[u8; NONCE_BYTES]> {
    answer.try_into().map_err(|_| {
        TransportError::Unauthenticated(
            "the target sent no nonce: it does not support session keys".into(),
        )
    })
}

/// The answer to `AUTH`: the server's proof, then the session scope's grants (JSON).
///
/// # Errors
/// `Protocol` when the grants cannot be encoded.
pub(crate) fn encode_auth_answer(proof: &[u8], grants: &[RegionGrant]) -> Result<Vec<u8>> {
    let mut out = proof.to_vec();
    out.extend_from_slice(
        &serde_json::to_vec(grants).map_err(|e| TransportError::Protocol(e.to_string()))?,
    );
    Ok(out)
}

/// Splits the answer to `AUTH` into the server's proof and the grants' bytes (checked with
/// the proof first, decoded by [`decode_grants`] after).
///
/// # Errors
/// `Protocol` when the answer is shorter than a proof.
pub(crate) fn split_auth_answer(answer: &[u8]) -> Result<(&[u8], &[u8])> {
    if answer.len() < TAG_BYTES {
        return Err(TransportError::Protocol("short AUTH answer".into()));
    }
    Ok(answer.split_at(TAG_BYTES))
}

/// Decodes the session scope's grants of an `AUTH` answer.
///
/// # Errors
/// `Protocol` for anything but a JSON list of grants.
pub(crate) fn decode_grants(bytes: &[u8]) -> Result<Vec<RegionGrant>> {
    serde_json::from_slice(bytes).map_err(|e| TransportError::Protocol(e.to_string()))
}

/// Decodes a `GetRegions` answer.
pub(crate) fn decode_regions(bytes: &[u8]) -> Result<Vec<RegionDescriptor>> {
    Ok(from_archive::<Vec<RegionDescriptor>>(bytes)?)
}

/// The region ids (JSON list) of an `OP_RDMA_KEYS` request narrowed to `visible` (all of
/// `visible` when the request names none).
///
/// # Errors
/// `Protocol` when the request is not a JSON list of ids.
pub(crate) fn granted_ids(payload: &[u8], visible: &HashSet<u64>) -> Result<Vec<u8>> {
    let asked: Vec<u64> = if payload.is_empty() {
        visible.iter().copied().collect()
    } else {
        serde_json::from_slice(payload).map_err(|e| TransportError::Protocol(e.to_string()))?
    };
    let ids: Vec<u64> = asked
        .into_iter()
        .filter(|id| visible.contains(id))
        .collect();
    serde_json::to_vec(&ids).map_err(|e| TransportError::Protocol(e.to_string()))
}

/// How a target refuses a request: the answer's status, `aux` and payload for `e`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) status: u8,
    pub(crate) aux: u64,
    pub(crate) payload: Vec<u8>,
}

/// Encodes `e` as the refusal of a request.
pub(crate) fn encode_refusal(e: &TransportError) -> Refusal {
    let (status, aux, payload) = match e {
        TransportError::UnknownRegion { .. } => (ST_UNKNOWN_REGION, 0, Vec::new()),
        TransportError::OutOfBounds { region_len, .. } => {
            (ST_OUT_OF_BOUNDS, *region_len, Vec::new())
        }
        TransportError::Unauthenticated(m) => (ST_UNAUTHENTICATED, 0, m.as_bytes().to_vec()),
        TransportError::NotGranted { fence, .. } => (ST_NOT_GRANTED, *fence, Vec::new()),
        TransportError::Fenced { fence } => (ST_FENCED, *fence, Vec::new()),
        other => (
            ST_ERROR,
            0,
            format!("{}\n{other}", other.kind()).into_bytes(),
        ),
    };
    Refusal {
        status,
        aux,
        payload,
    }
}

/// The bytes of text an answer with status `resp.status` carries that [`decode_refusal`]
/// needs: its length for an `UNAUTHENTICATED` or `ERROR` answer of at most
/// [`MAX_ERROR_BYTES`], else 0 (a longer one is decoded as a protocol violation, unread).
pub(crate) fn refusal_text_len(resp: &RespHeader) -> usize {
    match resp.status {
        ST_UNAUTHENTICATED | ST_ERROR if resp.len <= MAX_ERROR_BYTES => resp.len as usize,
        _ => 0,
    }
}

/// The typed error of request `req` that answer `resp` refused, with the answer's text
/// (the [`refusal_text_len`] bytes that followed it).
pub(crate) fn decode_refusal(req: &ReqHeader, resp: &RespHeader, text: &[u8]) -> TransportError {
    match resp.status {
        ST_UNKNOWN_REGION => TransportError::UnknownRegion {
            side: Side::Remote,
            id: req.region,
        },
        ST_OUT_OF_BOUNDS => TransportError::OutOfBounds {
            side: Side::Remote,
            id: req.region,
            offset: req.offset,
            len: req.len,
            region_len: resp.aux,
        },
        ST_UNAUTHENTICATED if resp.len <= MAX_ERROR_BYTES => TransportError::Unauthenticated(
            format!("the target refused: {}", String::from_utf8_lossy(text)),
        ),
        ST_NOT_GRANTED => TransportError::NotGranted {
            region: req.region,
            offset: req.offset,
            len: req.len,
            write: req.op == OP_WRITE,
            fence: resp.aux,
        },
        ST_FENCED => TransportError::Fenced { fence: resp.aux },
        ST_ERROR if resp.len <= MAX_ERROR_BYTES => {
            let text = String::from_utf8_lossy(text).to_string();
            let (kind, message) = text.split_once('\n').unwrap_or(("remote", &text));
            TransportError::Remote {
                kind: kind.to_string(),
                message: message.to_string(),
            }
        }
        other => TransportError::Protocol(format!(
            "unexpected answer status {other} ({} bytes)",
            resp.len
        )),
    }
}

/// What follows the header of an answer to a control request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ControlAnswer {
    /// `OK` or `REGIONS` with this many payload bytes.
    Payload(usize),
    /// A refusal (or an unexpected status): see [`decode_refusal`].
    Refused,
}

/// Reads the header of an answer to a control request, holding its payload to
/// [`MAX_REGIONS_BYTES`].
///
/// # Errors
/// `Protocol` for an `OK` or `REGIONS` answer larger than that.
pub(crate) fn control_answer(resp: &RespHeader) -> Result<ControlAnswer> {
    match resp.status {
        ST_OK | ST_REGIONS if resp.len <= MAX_REGIONS_BYTES => {
            Ok(ControlAnswer::Payload(resp.len as usize))
        }
        ST_OK | ST_REGIONS => Err(TransportError::Protocol(format!(
            "answer of {} bytes is too large",
            resp.len
        ))),
        _ => Ok(ControlAnswer::Refused),
    }
}

/// Checks that an answer is to the request that was sent (control requests are not
/// pipelined).
///
/// # Errors
/// `Protocol` when it answers another.
pub(crate) fn check_answers(req: &ReqHeader, resp: &RespHeader) -> Result<()> {
    if resp.req != req.req {
        return Err(TransportError::Protocol(format!(
            "answer to request {} arrived for {}",
            resp.req, req.req
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rdma_key_requests_are_narrowed_to_granted_regions() {
        let visible: HashSet<u64> = [2, 5].into_iter().collect();
        let ids = |b: Vec<u8>| {
            let mut v: Vec<u64> = serde_json::from_slice(&b).unwrap();
            v.sort_unstable();
            v
        };
        assert_eq!(
            ids(granted_ids(b"[1,2,3,5]", &visible).unwrap()),
            vec![2, 5]
        );
        assert_eq!(ids(granted_ids(b"", &visible).unwrap()), vec![2, 5]);
        assert!(ids(granted_ids(b"[7]", &visible).unwrap()).is_empty());
        assert!(granted_ids(b"not json", &visible).is_err());
    }

    #[test]
    fn headers_round_trip() {
        let h = ReqHeader {
            op: OP_WRITE,
            req: 7,
            region: 3,
            offset: 1 << 40,
            len: 12345,
            fence: 99,
        };
        assert_eq!(ReqHeader::decode(&h.encode()), h);
        let r = RespHeader {
            status: ST_OUT_OF_BOUNDS,
            req: 7,
            aux: 99,
            len: 0,
        };
        assert_eq!(RespHeader::decode(&r.encode()), r);
    }

    fn req(op: u8, len: u64) -> ReqHeader {
        ReqHeader {
            op,
            req: 1,
            region: 4,
            offset: 8,
            len,
            fence: SESSION_SCOPE,
        }
    }

    fn resp(status: u8, aux: u64, len: u64) -> RespHeader {
        RespHeader {
            status,
            req: 1,
            aux,
            len,
        }
    }

    #[test]
    fn requests_are_classified_within_their_bounds() {
        let max = 100;
        for op in [OP_HELLO, OP_NOTIFY, OP_AUTH] {
            assert_eq!(
                classify_request(&req(op, max), max).unwrap(),
                Request::Message
            );
            let e = classify_request(&req(op, max + 1), max).unwrap_err();
            assert_eq!(
                e.to_string(),
                "protocol violation: message of 101 bytes is too large"
            );
        }
        for op in [OP_RDMA_CONNECT, OP_RDMA_KEYS] {
            assert_eq!(
                classify_request(&req(op, max), max).unwrap(),
                Request::RdmaControl
            );
            let e = classify_request(&req(op, max + 1), max).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("protocol violation: unknown request op {op}")
            );
        }
        // Data ops carry any length: the registry and the grant bound them.
        assert_eq!(
            classify_request(&req(OP_WRITE, u64::MAX), max).unwrap(),
            Request::Write
        );
        assert_eq!(
            classify_request(&req(OP_READ, u64::MAX), max).unwrap(),
            Request::Read
        );
        assert_eq!(
            classify_request(&req(OP_GET_REGIONS, 0), max).unwrap(),
            Request::GetRegions
        );
        for op in [0, 9, 255] {
            assert!(classify_request(&req(op, 0), max).is_err(), "{op}");
        }
    }

    #[test]
    fn refusals_round_trip_to_the_typed_error() {
        let r = req(OP_WRITE, 16);
        for e in [
            TransportError::UnknownRegion {
                side: Side::Local,
                id: 4,
            },
            TransportError::OutOfBounds {
                side: Side::Local,
                id: 4,
                offset: 8,
                len: 16,
                region_len: 20,
            },
            TransportError::Unauthenticated("no key".into()),
            TransportError::NotGranted {
                region: 4,
                offset: 8,
                len: 16,
                write: true,
                fence: 3,
            },
            TransportError::Fenced { fence: 3 },
            TransportError::Busy("full".into()),
        ] {
            let refusal = encode_refusal(&e);
            assert!(is_refusal(refusal.status), "{e}");
            let a = resp(refusal.status, refusal.aux, refusal.payload.len() as u64);
            assert_eq!(refusal_text_len(&a), refusal.payload.len());
            let back = decode_refusal(&r, &a, &refusal.payload);
            assert_eq!(
                back.kind(),
                if e.kind() == "busy" {
                    "remote"
                } else {
                    e.kind()
                }
            );
            match (&e, &back) {
                (TransportError::Busy(_), TransportError::Remote { kind, message }) => {
                    assert_eq!((kind.as_str(), message.as_str()), ("busy", "busy: full"));
                }
                (TransportError::Unauthenticated(_), TransportError::Unauthenticated(m)) => {
                    assert_eq!(m, "the target refused: no key");
                }
                _ => assert_eq!(
                    back.to_string().replace("remote", "local"),
                    e.to_string(),
                    "{e}"
                ),
            }
        }
    }

    #[test]
    fn texts_past_their_bound_are_not_read_and_fail_as_protocol_violations() {
        let r = req(OP_READ, 16);
        for status in [ST_ERROR, ST_UNAUTHENTICATED] {
            let a = resp(status, 0, MAX_ERROR_BYTES + 1);
            assert_eq!(refusal_text_len(&a), 0);
            assert_eq!(decode_refusal(&r, &a, &[]).kind(), "protocol");
            assert_eq!(
                refusal_text_len(&resp(status, 0, MAX_ERROR_BYTES)),
                MAX_ERROR_BYTES as usize
            );
        }
        assert_eq!(
            decode_refusal(&r, &resp(ST_DATA, 0, 16), &[]).kind(),
            "protocol"
        );
        assert_eq!(
            control_answer(&resp(ST_REGIONS, 0, MAX_REGIONS_BYTES)).unwrap(),
            ControlAnswer::Payload(MAX_REGIONS_BYTES as usize)
        );
        assert!(control_answer(&resp(ST_OK, 0, MAX_REGIONS_BYTES + 1)).is_err());
        assert_eq!(
            control_answer(&resp(ST_FENCED, 3, 0)).unwrap(),
            ControlAnswer::Refused
        );
        assert!(check_answers(
            &r,
            &RespHeader {
                req: 2,
                ..resp(ST_OK, 0, 0)
            }
        )
        .is_err());
    }

    #[test]
    fn greetings_and_auth_answers_decode() {
        let h = decode_hello(&encode_hello("tcp", "decode-0", "boot-id"));
        assert_eq!(
            (h.backend.as_str(), h.name.as_str(), h.host.as_str()),
            ("tcp", "decode-0", "boot-id")
        );
        assert_eq!(decode_hello(b"shm").name, "");
        assert_eq!(decode_hello(b"a\nb\nc\nd").host, "c\nd");
        assert!(decode_hello_answer(&[1; NONCE_BYTES]).is_ok());
        assert_eq!(
            decode_hello_answer(&[]).unwrap_err().kind(),
            "unauthenticated"
        );
        let grants = vec![RegionGrant::whole(3, crate::auth::Access::Read)];
        let answer = encode_auth_answer(&[9; TAG_BYTES], &grants).unwrap();
        let (proof, rest) = split_auth_answer(&answer).unwrap();
        assert_eq!(proof, &[9; TAG_BYTES]);
        assert_eq!(decode_grants(rest).unwrap(), grants);
        assert!(split_auth_answer(&[0; TAG_BYTES - 1]).is_err());
        assert!(decode_grants(b"{").is_err());
    }

    proptest! {
        /// Whatever bytes arrive, decoding them never panics, and a bound is never exceeded.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(
            head in proptest::array::uniform32(any::<u8>()),
            extra in proptest::collection::vec(any::<u8>(), 0..64),
            max in 0u64..1 << 20,
        ) {
            let mut rb = [0u8; REQ_HEADER];
            rb[..32].copy_from_slice(&head);
            rb[32..].copy_from_slice(&head[..16]);
            let h = ReqHeader::decode(&rb);
            prop_assert_eq!(ReqHeader::decode(&h.encode()), h);
            if let Ok(Request::Message | Request::RdmaControl) = classify_request(&h, max) {
                prop_assert!(h.len <= max);
            }
            let a = RespHeader::decode(&head);
            prop_assert_eq!(RespHeader::decode(&a.encode()), a);
            prop_assert!(refusal_text_len(&a) as u64 <= MAX_ERROR_BYTES);
            if let Ok(ControlAnswer::Payload(n)) = control_answer(&a) {
                prop_assert!(n as u64 <= MAX_REGIONS_BYTES);
            }
            let _ = decode_refusal(&h, &a, &extra);
            let _ = decode_hello(&extra);
            let _ = decode_grants(&extra);
            let _ = decode_regions(&extra);
            let _ = split_auth_answer(&extra);
            let _ = granted_ids(&extra, &HashSet::from([1, 2]));
        }
    }
}
