//! Fuzz targets of the decoders in `pdserve-runtime` that read remote bytes: control-plane
//! frames (`wire::decode_frame`, the streaming `FrameDecoder`), region descriptors (the
//! archive `wire::from_archive::<Vec<RegionDescriptor>>` a transfer engine decodes from a
//! peer's `GET_REGIONS` answer), and an instance's inspect snapshot as JSON (what
//! `pdserve inspect --json` prints and renders; on the control plane the snapshot travels as a
//! typed `Inspect` message, fuzzed with the control frames). See `fuzz_support` and docs/testing.md,
//! "Fuzzing".

#[path = "fuzz_support/mod.rs"]
mod fuzz_support;

use fuzz_support::{draw, Target, Verdict};
use pdserve_runtime::supervision::{render_tree, ActorSnapshot, ActorState, InstanceSnapshot};
use pdserve_runtime::wire::kv_events::{KvEventBatch, KvOp, TierEvents};
use pdserve_runtime::wire::{
    decode_frame, encode_frame, from_archive, to_archive, ControlMessage, Envelope, EnvelopeKind,
    ErrorMessage, FrameDecoder, Heartbeat, Hello, InspectAnswer, LoadFigures, RegionChunk,
    RegionDescriptor, Registration, RegistrationError, RegistrationField, Role, ShmHandle,
    WireError, FRAME_HEADER_BYTES,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

/// The frame limit the targets decode under (a receiver's `max_frame_bytes`).
const MAX_FRAME: usize = 64 << 10;

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![
        Just(Role::Colocated),
        Just(Role::Prefill),
        Just(Role::Decode),
        Just(Role::Proxy),
        Just(Role::Other),
    ]
}

fn region() -> impl Strategy<Value = RegionDescriptor> {
    (
        any::<u64>(),
        any::<u64>(),
        vec(
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(
                |(offset, len, addr, rkey)| RegionChunk {
                    offset,
                    len,
                    addr,
                    rkey,
                },
            ),
            0..4,
        ),
        proptest::option::of(
            ("[a-z0-9-]{0,40}", any::<u64>(), any::<[u8; 16]>()).prop_map(
                |(socket, key, ticket)| ShmHandle {
                    socket,
                    key,
                    ticket,
                },
            ),
        ),
    )
        .prop_map(|(id, len, chunks, shm)| RegionDescriptor {
            id,
            len,
            chunks,
            shm,
        })
}

fn message() -> impl Strategy<Value = ControlMessage> {
    let text = || ".{0,24}";
    prop_oneof![
        (text(), text(), role(), text()).prop_map(|(cluster, node, role, version)| {
            ControlMessage::Hello(Hello {
                cluster,
                node,
                role,
                version,
            })
        }),
        (text(), any::<u64>(), any::<[u32; 2]>(), any::<[u64; 2]>()).prop_map(
            |(node, seq, [running, waiting], [free_blocks, total_blocks])| {
                ControlMessage::Heartbeat(Heartbeat {
                    node,
                    seq,
                    load: LoadFigures {
                        running,
                        waiting,
                        free_blocks,
                        total_blocks,
                    },
                })
            }
        ),
        Just(ControlMessage::GetRegisteredMemory),
        vec(region(), 0..4).prop_map(|regions| ControlMessage::RegisteredMemory { regions }),
        vec(any::<u8>(), 0..64).prop_map(|bytes| ControlMessage::Notify { bytes }),
        any::<u64>().prop_map(|nonce| ControlMessage::Ping { nonce }),
        any::<u64>().prop_map(|nonce| ControlMessage::Pong { nonce }),
        (text(), text())
            .prop_map(|(kind, message)| ControlMessage::Error(ErrorMessage { kind, message })),
        (text(), vec(any::<u8>(), 0..256))
            .prop_map(|(topic, body)| ControlMessage::Opaque { topic, body }),
        typed_control(),
    ]
}

/// The control plane's typed exchanges (registration, draining, inspect requests).
fn typed_control() -> impl Strategy<Value = ControlMessage> {
    let text = || ".{0,24}";
    prop_oneof![
        (
            text(),
            role(),
            text(),
            text(),
            any::<u64>(),
            any::<Option<u32>>(),
            any::<Option<u64>>()
        )
            .prop_map(
                |(node, role, url, control_addr, heartbeat_ms, block_size, cache_salt)| {
                    ControlMessage::Register(Box::new(Registration {
                        node,
                        role,
                        url,
                        control_addr,
                        heartbeat_ms,
                        block_size: block_size.map(|b| b as usize),
                        cache_salt,
                    }))
                }
            ),
        text().prop_map(|proxy| ControlMessage::Registered { proxy }),
        text().prop_map(
            |message| ControlMessage::RegistrationRefused(RegistrationError::new(
                RegistrationField::Url,
                message
            ))
        ),
        Just(ControlMessage::Draining),
        Just(ControlMessage::DrainingAck),
        Just(ControlMessage::InspectRequest),
        Just(ControlMessage::Inspect(Box::new(InspectAnswer::Instance(
            sample_snapshot()
        )))),
        kv_events().prop_map(|b| ControlMessage::KvEvents(Box::new(b))),
    ]
}

/// A batch of KV events (the proxy checks media and counts after decoding).
fn kv_events() -> impl Strategy<Value = KvEventBatch> {
    let ops = || {
        vec((any::<bool>(), vec(any::<u64>(), 0..8)), 0..3).prop_map(|ops| {
            ops.into_iter()
                .map(|(s, v)| if s { KvOp::Stored(v) } else { KvOp::Removed(v) })
                .collect::<Vec<_>>()
        })
    };
    (
        proptest::option::of(vec(any::<u64>(), 0..16)),
        ops(),
        vec(
            (
                ".{0,8}",
                proptest::option::of(vec(any::<u64>(), 0..8)),
                ops(),
            ),
            0..3,
        ),
    )
        .prop_map(|(snapshot, ops, tiers)| KvEventBatch {
            snapshot,
            ops,
            tiers: tiers
                .into_iter()
                .map(|(medium, snapshot, ops)| TierEvents {
                    medium,
                    snapshot,
                    ops,
                })
                .collect(),
        })
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (
        any::<u64>(),
        prop_oneof![
            Just(EnvelopeKind::OneWay),
            Just(EnvelopeKind::Request),
            Just(EnvelopeKind::Response),
        ],
        message(),
    )
        .prop_map(|(id, kind, message)| Envelope { id, kind, message })
}

/// One valid envelope of every message kind.
fn sample_envelopes() -> Vec<Envelope> {
    let messages = vec![
        ControlMessage::Hello(Hello {
            cluster: "pdserve".into(),
            node: "prefill-0".into(),
            role: Role::Prefill,
            version: "0.1.0".into(),
        }),
        ControlMessage::Heartbeat(Heartbeat {
            node: "decode-0".into(),
            seq: 42,
            load: LoadFigures {
                running: 3,
                waiting: 1,
                free_blocks: 100,
                total_blocks: 512,
            },
        }),
        ControlMessage::GetRegisteredMemory,
        ControlMessage::RegisteredMemory {
            regions: sample_regions(),
        },
        ControlMessage::Notify {
            bytes: b"CHECK".to_vec(),
        },
        ControlMessage::Ping { nonce: 7 },
        ControlMessage::Pong { nonce: 7 },
        ControlMessage::Error(ErrorMessage {
            kind: "malformed_frame".into(),
            message: "bad".into(),
        }),
        ControlMessage::Opaque {
            topic: "kv/1".into(),
            body: vec![0xA5; 48],
        },
    ];
    messages
        .into_iter()
        .enumerate()
        .map(|(i, message)| Envelope {
            id: i as u64,
            kind: [
                EnvelopeKind::OneWay,
                EnvelopeKind::Request,
                EnvelopeKind::Response,
            ][i % 3],
            message,
        })
        .collect()
}

fn sample_regions() -> Vec<RegionDescriptor> {
    vec![
        RegionDescriptor {
            id: 1,
            len: 1 << 20,
            chunks: vec![RegionChunk {
                offset: 0,
                len: 1 << 20,
                addr: 0x7f00_0000_0000,
                rkey: 0x1234,
            }],
            shm: None,
        },
        RegionDescriptor {
            id: 2,
            len: 8192,
            chunks: vec![
                RegionChunk {
                    offset: 0,
                    len: 4096,
                    addr: 0,
                    rkey: 0,
                },
                RegionChunk {
                    offset: 4096,
                    len: 4096,
                    addr: 0,
                    rkey: 0,
                },
            ],
            shm: Some(ShmHandle {
                socket: "pdserve-shm-4242-00ff00ff00ff00ff".into(),
                key: 17,
                ticket: [0x5a; 16],
            }),
        },
    ]
}

fn frame(env: &Envelope) -> Vec<u8> {
    encode_frame(env, MAX_FRAME).expect("a sample frame encodes")
}

/// Checks one input as a stream of control frames: `decode_frame` over the whole buffer,
/// frame after frame, and the streaming decoder fed the same bytes in pieces must agree;
/// every envelope that decodes encodes again and decodes to itself.
fn check_frames(input: &[u8]) -> Result<Verdict, String> {
    let mut decoded = Vec::new();
    let mut at = 0;
    let mut end_error = None;
    while at < input.len() {
        match decode_frame(&input[at..], MAX_FRAME) {
            Ok((env, used)) => {
                let len = u32::from_le_bytes(input[at..at + 4].try_into().expect("4 bytes"));
                if used != FRAME_HEADER_BYTES + len as usize || used > input.len() - at {
                    return Err(format!("frame at {at}: used {used} of a {len}-byte frame"));
                }
                let again = encode_frame(&env, usize::MAX).map_err(|e| e.to_string())?;
                let (back, _) = decode_frame(&again, usize::MAX)
                    .map_err(|e| format!("re-encoded frame does not decode: {e}"))?;
                if back != env {
                    return Err(format!("round trip changed {env:?} into {back:?}"));
                }
                decoded.push(env);
                at += used;
            }
            Err(e) => {
                if let WireError::FrameTooLarge { len, max } = &e {
                    if len <= max {
                        return Err(format!("{e} for a frame within the limit"));
                    }
                }
                end_error = Some(e);
                break;
            }
        }
    }
    // The streaming decoder, fed the bytes in pieces sized from the input itself.
    let mut dec = FrameDecoder::new(MAX_FRAME);
    let mut streamed = Vec::new();
    let mut stream_error = None;
    let mut fed = 0;
    let mut step = 0;
    'feed: while fed < input.len() {
        let piece = 1 + (input[step % input.len()] as usize * 7 + step) % 97;
        let end = (fed + piece).min(input.len());
        dec.push(&input[fed..end]);
        fed = end;
        step += 1;
        loop {
            match dec.next_frame() {
                Ok(Some(env)) => streamed.push(env),
                Ok(None) => break,
                Err(e) => {
                    stream_error = Some(e);
                    break 'feed;
                }
            }
        }
    }
    if streamed != decoded {
        return Err(format!(
            "the streaming decoder yielded {} frames, decode_frame {}",
            streamed.len(),
            decoded.len()
        ));
    }
    match (&end_error, &stream_error) {
        (Some(WireError::Truncated { .. }) | None, None) => {}
        // Same kind (a malformed archive's message names buffer addresses).
        (Some(a), Some(b)) if a.kind() == b.kind() => {}
        (a, b) => {
            return Err(format!(
                "decode_frame ended with {a:?}, the stream with {b:?}"
            ))
        }
    }
    Ok(if decoded.is_empty() {
        Verdict::Rejected
    } else {
        Verdict::Accepted
    })
}

#[test]
fn control_frames() {
    let report = Target::new("control_frame")
        .dictionary(&[
            &[0xff, 0xff, 0xff, 0xff],
            &[0, 0, 1, 0],
            &[0, 0, 0, 0],
            b"kv/1",
        ])
        .run(check_frames, |runner: &mut TestRunner| {
            let envs = draw(runner, vec(envelope(), 1..4));
            let mut out = Vec::new();
            for env in &envs {
                out.extend(frame(env));
            }
            out
        });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

fn check_regions(input: &[u8]) -> Result<Verdict, String> {
    match from_archive::<Vec<RegionDescriptor>>(input) {
        Ok(regions) => {
            let again = to_archive(&regions).map_err(|e| e.to_string())?;
            let back = from_archive::<Vec<RegionDescriptor>>(&again)
                .map_err(|e| format!("re-encoded descriptors do not decode: {e}"))?;
            if back != regions {
                return Err(format!("round trip changed {regions:?} into {back:?}"));
            }
            Ok(Verdict::Accepted)
        }
        Err(WireError::Malformed(_)) => Ok(Verdict::Rejected),
        Err(e) => Err(format!("unexpected error kind: {e}")),
    }
}

#[test]
fn region_descriptors() {
    let report = Target::new("region_descriptors").run(check_regions, |runner| {
        let regions = draw(runner, vec(region(), 0..6));
        to_archive(&regions).expect("encodes").to_vec()
    });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

fn sample_snapshot() -> InstanceSnapshot {
    let actor = |name: &str, kind: &str, state, children| ActorSnapshot {
        name: name.into(),
        kind: kind.into(),
        state,
        restarts: 1,
        mailbox_depth: 2,
        last_error: Some("worker failure:\nboom".into()),
        uptime_s: 12.5,
        children,
    };
    InstanceSnapshot {
        instance: "decode-0".into(),
        role: "decode".into(),
        model: "smollm2-135m".into(),
        tp: 2,
        waiting: 1,
        running: 4,
        kv_blocks_total: 512,
        kv_blocks_free: 300,
        kv_blocks_used: 212,
        preemptions: 1,
        transfers_in_flight: 2,
        bytes_sent: 3 << 20,
        bytes_received: 5 << 30,
        transfer_failures: 1,
        kv_blocks_cached: 40,
        prompt_tokens: 1000,
        prompt_tokens_cached: 250,
        cache_evictions: 3,
        local_prefills: 1,
        handoffs_done: 9,
        handoff_bytes: 9 << 20,
        handoff_bytes_skipped: 1 << 20,
        kv_tiers: Vec::new(),
        kv_paths: Vec::new(),
        encoder: None,
        actors: actor(
            "decode-0",
            "InstanceSupervisor",
            ActorState::Running,
            vec![
                actor("scheduler", "Scheduler", ActorState::Running, vec![]),
                actor("tp-worker-0", "TpWorker", ActorState::Restarting, vec![]),
            ],
        ),
    }
}

fn check_snapshot(input: &[u8]) -> Result<Verdict, String> {
    match serde_json::from_slice::<InstanceSnapshot>(input) {
        Ok(snap) => {
            // What `pdserve inspect` does with it.
            let _ = render_tree(&snap, false);
            let _ = render_tree(&snap, true);
            let json = serde_json::to_vec(&snap).map_err(|e| e.to_string())?;
            let back: InstanceSnapshot = serde_json::from_slice(&json)
                .map_err(|e| format!("re-encoded snapshot does not decode: {e}"))?;
            // serde_json parses floats to the nearest value only within an ulp or so (no
            // `float_roundtrip`): compare uptimes loosely and everything else exactly.
            let (mut a, mut b) = (snap, back);
            if !same_uptimes(&mut a.actors, &mut b.actors) || a != b {
                return Err(format!("round trip changed {a:?} into {b:?}"));
            }
            Ok(Verdict::Accepted)
        }
        Err(_) => Ok(Verdict::Rejected),
    }
}

/// Whether the two trees' uptimes agree within float parsing error; zeroes them.
fn same_uptimes(a: &mut ActorSnapshot, b: &mut ActorSnapshot) -> bool {
    let close = (a.uptime_s - b.uptime_s).abs() <= 1e-9 * a.uptime_s.abs().max(1e-300);
    a.uptime_s = 0.0;
    b.uptime_s = 0.0;
    close
        && a.children.len() == b.children.len()
        && a.children
            .iter_mut()
            .zip(b.children.iter_mut())
            .all(|(x, y)| same_uptimes(x, y))
}

fn actor_strategy() -> impl Strategy<Value = ActorSnapshot> {
    let leaf = (
        ".{0,12}",
        any::<u32>(),
        any::<usize>(),
        proptest::option::of(".{0,16}"),
        any::<f64>(),
    )
        .prop_map(
            |(name, restarts, mailbox_depth, last_error, uptime_s)| ActorSnapshot {
                name,
                kind: "TpWorker".into(),
                state: ActorState::Running,
                restarts,
                mailbox_depth,
                last_error,
                // JSON has no NaN or infinity.
                uptime_s: if uptime_s.is_finite() { uptime_s } else { 0.0 },
                children: Vec::new(),
            },
        );
    leaf.prop_recursive(4, 16, 4, |inner| {
        (inner.clone(), vec(inner, 0..4)).prop_map(|(mut a, children)| {
            a.children = children;
            a
        })
    })
}

#[test]
fn instance_snapshots() {
    let report = Target::new("instance_snapshot")
        .dictionary(fuzz_support::JSON_TOKENS)
        .run(check_snapshot, |runner| {
            let mut snap = sample_snapshot();
            let figures = draw(runner, any::<[u64; 12]>());
            snap.preemptions = figures[0];
            snap.transfers_in_flight = figures[1];
            snap.bytes_sent = figures[2];
            snap.bytes_received = figures[3];
            snap.transfer_failures = figures[4];
            snap.prompt_tokens = figures[5];
            snap.prompt_tokens_cached = figures[6];
            snap.cache_evictions = figures[7];
            snap.handoffs_done = figures[8] % 3;
            snap.handoff_bytes = figures[9];
            snap.handoff_bytes_skipped = figures[10];
            snap.kv_blocks_free = figures[11] as usize;
            snap.actors = draw(runner, actor_strategy());
            serde_json::to_vec(&snap).expect("encodes")
        });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

/// Rewrites `fuzz/corpus/{control_frame,region_descriptors,instance_snapshot}/` from the
/// encoders, plus hand-made hostile inputs.
#[test]
#[ignore = "rewrites the corpus in the repository; run by hand after a format change"]
fn regenerate_corpus() {
    let envs = sample_envelopes();
    let mut frames: Vec<(String, Vec<u8>)> = envs
        .iter()
        .map(|env| {
            let name = format!("valid-{:?}", env.message)
                .split(['(', ' ', '{'])
                .next()
                .unwrap_or("message")
                .to_lowercase();
            (format!("{name}-{}.bin", env.id), frame(env))
        })
        .collect();
    let all: Vec<u8> = envs.iter().flat_map(frame).collect();
    frames.push(("valid-stream-of-all.bin".into(), all));
    let opaque = frame(&envs[8]);
    let mut huge_len = opaque.clone();
    huge_len[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut truncated = opaque.clone();
    truncated.truncate(opaque.len() / 2);
    let mut vec_len = opaque.clone();
    let n = vec_len.len();
    // The Opaque body's archived length sits near the end of the archive: overwrite the last
    // 8 bytes (length and offset of the root's fields) with the largest values.
    vec_len[n - 8..].copy_from_slice(&[0xff; 8]);
    frames.extend([
        ("hostile-length-u32-max.bin".into(), huge_len),
        ("hostile-truncated.bin".into(), truncated),
        ("hostile-archive-lengths-max.bin".into(), vec_len),
        ("hostile-empty-frame.bin".into(), vec![0, 0, 0, 0]),
        ("hostile-garbage.bin".into(), {
            let mut g = 40u32.to_le_bytes().to_vec();
            g.extend([0xA5; 40]);
            g
        }),
    ]);
    fuzz_support::write_corpus("control_frame", &frames);

    let regions = sample_regions();
    let archive = to_archive(&regions).expect("encodes").to_vec();
    let mut max = archive.clone();
    let n = max.len();
    max[n - 8..].copy_from_slice(&[0xff; 8]);
    fuzz_support::write_corpus(
        "region_descriptors",
        &[
            ("valid-two-regions.bin".into(), archive.clone()),
            (
                "valid-none.bin".into(),
                to_archive(&Vec::<RegionDescriptor>::new())
                    .expect("encodes")
                    .to_vec(),
            ),
            ("hostile-lengths-max.bin".into(), max),
            (
                "hostile-truncated.bin".into(),
                archive[..archive.len() - 3].to_vec(),
            ),
        ],
    );

    let snap = serde_json::to_vec_pretty(&sample_snapshot()).expect("encodes");
    let deep = format!(
        "{{\"actors\":{}1{}}}",
        "{\"children\":[".repeat(10_000),
        "]}".repeat(10_000)
    );
    let mut overflow = sample_snapshot();
    overflow.handoffs_done = 1;
    overflow.handoff_bytes = u64::MAX;
    overflow.handoff_bytes_skipped = u64::MAX;
    overflow.prompt_tokens = 1;
    overflow.prompt_tokens_cached = u64::MAX;
    let text = String::from_utf8(snap.clone()).expect("JSON is UTF-8");
    fuzz_support::write_corpus(
        "instance_snapshot",
        &[
            ("valid-decode.json".into(), snap.clone()),
            (
                "valid-overflowing-figures.json".into(),
                serde_json::to_vec(&overflow).expect("encodes"),
            ),
            ("hostile-nested-10k.json".into(), deep.into_bytes()),
            (
                "hostile-negative-figures.json".into(),
                text.replace("\"tp\": 2", "\"tp\": -2").into_bytes(),
            ),
            (
                "hostile-absurd-numbers.json".into(),
                text.replace("\"waiting\": 1", "\"waiting\": 1e999")
                    .into_bytes(),
            ),
            (
                "hostile-non-utf8.json".into(),
                text.replace("decode-0", "\u{fffd}")
                    .into_bytes()
                    .into_iter()
                    .map(|b| if b == 0xef { 0xff } else { b })
                    .collect(),
            ),
            (
                "hostile-truncated.json".into(),
                snap[..snap.len() / 2].to_vec(),
            ),
        ],
    );
}
