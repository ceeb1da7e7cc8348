//! Fuzz targets of the decoders in `pdserve-actors` that read remote bytes:
//!
//! | target | decoder | who sends the bytes |
//! |---|---|---|
//! | `peer_request` | `protocol::decode_request`, then `service::validate_prefill` | a decode instance (control plane `kv/1`, or `POST /v1/kv/peer`) |
//! | `peer_answer` | `protocol::decode_answer`, then `plan::validate_peer` / `plan::plan_pull` | a prefill instance |
//! | `openai_request` | `openai::parse_request`, `resolve_max_tokens`, `SamplingParams::validate`, `kv_directive` | an HTTP client |
//! | `kv_transfer_params` | `openai::kv_directive` | an HTTP client (or the proxy) |
//! | `kv_events` | `KvEventBatch::check`, `KvIndex::apply` (inputs as JSON; on the wire a batch is a typed rkyv `KvEvents` message, bounded by `wire::bounds` and fuzzed with the control frames in `runtime`) | an instance (control plane) |
//! | `registration` | `Registration::validate` (inputs as JSON; on the wire a registration is a typed rkyv `Register`, fuzzed with the control frames in `runtime`) | an instance registering with the proxy |
//!
//! See `runtime/tests/fuzz_support` and docs/testing.md, "Fuzzing".

#[path = "../../runtime/tests/fuzz_support/mod.rs"]
mod fuzz_support;

use fuzz_support::{draw, Target, Verdict};
use pdserve_actors::control_plane::Registration;
use pdserve_actors::handoff::plan::{check_blocks, plan_pull, validate_peer};
use pdserve_actors::handoff::protocol::{
    compat_hash, decode_answer, decode_request, encode_answer, encode_request, HandoffError,
    HeldKv, KvPeerInfo, PeerAnswer, PeerRequest, PlacementAsk, PrefillAnswer, PrefillMode,
    PrefillRequest, RankKv, SessionOffer, MAX_HANDOFF_BLOCKS, MAX_NAME_BYTES, MAX_PROMPT_TOKENS,
    MAX_RANKS, MAX_RANK_REGIONS, MAX_RENEW_IDS,
};
use pdserve_actors::handoff::service::{validate_prefill, PromptLimits};
use pdserve_actors::kv_events::{HashScheme, KvEventBatch, KvIndex, KvOp, TierEvents};
use pdserve_actors::openai::{
    kv_directive, parse_json, parse_request, resolve_max_tokens, KvDirective, KvTransferParams,
    PromptInput, MAX_CHOICES, MAX_CHOICES_TOTAL,
};
use pdserve_actors::RequestError;
use pdserve_core::handoff::kv_path::{self, KvPlacement, RankPlacement};
use pdserve_gpu::kv::{KvDtype, KvLayout};
use pdserve_gpu::sampling::{
    LogitBias, SamplingParams, TokenLogprobs, TopLogprob, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
};
use pdserve_runtime::ids::TransferId;
use pdserve_runtime::role::Role;
use proptest::collection::vec;
use proptest::prelude::*;
use serde_json::{json, Value};

/// The instance the peer-protocol targets answer as: one TP rank, 2 layers, 8 blocks of 4
/// tokens, 4 KV heads of 8 f32.
fn ours() -> KvPeerInfo {
    KvPeerInfo {
        engine_id: "prefill-0".into(),
        compat_key: "k".into(),
        compat_hash: compat_hash("k"),
        transfer_addr: "127.0.0.1:7200".into(),
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

/// The same memory split over two TP ranks (a peer with another TP size).
fn ours_tp2() -> KvPeerInfo {
    let mut info = ours();
    let rank = |heads: (usize, usize), regions| RankKv {
        heads,
        layout: KvLayout {
            num_kv_heads: 2,
            ..info.ranks[0].layout
        },
        regions,
    };
    info.ranks = vec![rank((0, 2), vec![1, 2]), rank((2, 4), vec![3, 4])];
    info
}

const LIMITS: PromptLimits = PromptLimits {
    vocab_size: 1000,
    max_model_len: 32,
};
const BLOCK_SIZE: usize = 4;

fn bound(what: &str, n: usize, max: usize) -> Result<(), String> {
    if n > max {
        return Err(format!("accepted {what} of {n}, past the limit of {max}"));
    }
    Ok(())
}

fn info_bounds(info: &KvPeerInfo) -> Result<(), String> {
    for (what, s) in [
        ("engine_id", &info.engine_id),
        ("compat_key", &info.compat_key),
        ("compat_hash", &info.compat_hash),
        ("transfer_addr", &info.transfer_addr),
        ("backend", &info.backend),
    ] {
        bound(what, s.len(), MAX_NAME_BYTES)?;
    }
    bound("ranks", info.ranks.len(), MAX_RANKS)?;
    for r in &info.ranks {
        bound("rank regions", r.regions.len(), MAX_RANK_REGIONS)?;
    }
    Ok(())
}

/// A KV placement's counts and lengths (the placement exchange, issue 31).
fn placement_bounds(p: &KvPlacement) -> Result<(), String> {
    bound("placement engine_id", p.engine_id.len(), MAX_NAME_BYTES)?;
    bound("boot_id", p.host.boot_id.len(), kv_path::MAX_BOOT_ID_BYTES)?;
    bound("placement ranks", p.ranks.len(), MAX_RANKS)?;
    for r in &p.ranks {
        if let RankPlacement::Device(d) = r {
            bound("region sizes", d.region_bytes.len(), MAX_RANK_REGIONS)?;
            bound("handles", d.handles.len(), MAX_RANK_REGIONS)?;
            for h in &d.handles {
                bound("handle bytes", h.handle.len(), kv_path::IPC_HANDLE_BYTES)?;
            }
        }
    }
    Ok(())
}

/// Every bias within [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (NaN is not).
fn logit_bias_in_range(biases: &[LogitBias]) -> bool {
    biases
        .iter()
        .all(|b| (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b.bias))
}

fn request_bounds(req: &PeerRequest) -> Result<(), String> {
    match req {
        PeerRequest::Renew(ids) => bound("Renew ids", ids.len(), MAX_RENEW_IDS),
        PeerRequest::PrefillImages(p) => {
            bound(
                "images",
                p.images.len(),
                pdserve_actors::handoff::protocol::MAX_PROMPT_IMAGES,
            )?;
            bound("encoder_url", p.encoder_url.len(), MAX_NAME_BYTES)?;
            request_bounds(&PeerRequest::Prefill(p.prefill.clone()))
        }
        PeerRequest::Prefill(p) => {
            bound("prompt", p.prompt.len(), MAX_PROMPT_TOKENS)?;
            bound("stop strings", p.sampling.stop.len(), MAX_STOP_STRINGS)?;
            bound(
                "stop_token_ids",
                p.sampling.stop_token_ids.len(),
                MAX_STOP_TOKEN_IDS,
            )?;
            bound(
                "logit_bias",
                p.sampling.logit_bias.len(),
                MAX_LOGIT_BIAS_ENTRIES,
            )?;
            if !logit_bias_in_range(&p.sampling.logit_bias) {
                return Err(format!(
                    "decode_request let through logit_bias {:?}",
                    p.sampling.logit_bias
                ));
            }
            if let PrefillMode::Push {
                peer,
                block_ids,
                session,
            } = &p.mode
            {
                info_bounds(peer)?;
                bound("push blocks", block_ids.len(), MAX_HANDOFF_BLOCKS)?;
                if let Some(s) = session {
                    bound("session address", s.transfer_addr.len(), MAX_NAME_BYTES)?;
                }
            }
            Ok(())
        }
        PeerRequest::OpenSession { initiator, .. } | PeerRequest::OpenRead { initiator, .. } => {
            bound("initiator", initiator.len(), MAX_NAME_BYTES)
        }
        PeerRequest::Info | PeerRequest::Release(_) | PeerRequest::Abort(_) => Ok(()),
        PeerRequest::Placement(ask) => {
            info_bounds(&ask.info)?;
            placement_bounds(&ask.placement)
        }
    }
}

fn check_request(input: &[u8]) -> Result<Verdict, String> {
    let req = match decode_request(input) {
        Ok(r) => r,
        Err(HandoffError::Protocol(_)) => return Ok(Verdict::Rejected),
        Err(e) => {
            return Err(format!(
                "decode_request failed with a {} error: {e}",
                e.kind()
            ))
        }
    };
    request_bounds(&req)?;
    // Round trip: what decoded encodes again to the same value (compared as encodings: floats
    // of the sampling may be NaN, which `==` never equals).
    let bytes = encode_request(&req).map_err(|e| e.to_string())?;
    let back = decode_request(&bytes).map_err(|e| format!("re-encoded request refused: {e}"))?;
    if encode_request(&back).map_err(|e| e.to_string())? != bytes {
        return Err(format!("round trip changed {req:?} into {back:?}"));
    }
    // What the prefill instance does next with a Prefill: its pure checks.
    if let PeerRequest::Prefill(p) = req {
        for info in [ours(), ours_tp2()] {
            let Ok(valid) = validate_prefill(p.clone(), LIMITS, &info, BLOCK_SIZE) else {
                continue;
            };
            let job = &valid.job;
            if job.prompt.is_empty()
                || job.prompt.len() + 1 > LIMITS.max_model_len
                || job.prompt.iter().any(|&t| t as usize >= LIMITS.vocab_size)
            {
                return Err(format!(
                    "validate_prefill accepted the prompt {:?}",
                    job.prompt
                ));
            }
            job.params
                .validate(LIMITS.vocab_size)
                .map_err(|e| format!("validate_prefill accepted bad sampling: {e}"))?;
            if let Some(t) = &valid.target {
                // Destination blocks are the decode instance's: inside its (validated) pool.
                let pool = t.peer.ranks[0].layout.num_blocks;
                if t.blocks.iter().any(|&b| b as usize >= pool)
                    || t.blocks.len() + t.skip_blocks != job.prompt.len().div_ceil(BLOCK_SIZE)
                {
                    return Err(format!(
                        "validate_prefill accepted push blocks {:?} (skip {}) for {} tokens",
                        t.blocks,
                        t.skip_blocks,
                        job.prompt.len()
                    ));
                }
            }
        }
    }
    Ok(Verdict::Accepted)
}

fn check_answer(input: &[u8]) -> Result<Verdict, String> {
    let answer = match decode_answer(input) {
        Ok(a) => a,
        Err(HandoffError::Protocol(_)) => return Ok(Verdict::Rejected),
        Err(e) => {
            return Err(format!(
                "decode_answer failed with a {} error: {e}",
                e.kind()
            ))
        }
    };
    match &answer {
        PeerAnswer::Info(info) => info_bounds(info)?,
        PeerAnswer::Prefilled(a) => {
            if let Some(h) = &a.held {
                bound("held blocks", h.block_ids.len(), MAX_HANDOFF_BLOCKS)?;
            }
            if let Some(lp) = &a.first_logprobs {
                // Counts bounded and every value a finite logprob: what reaches a JSON answer.
                lp.validate(usize::MAX, MAX_LOGPROBS as usize)
                    .map_err(|e| format!("decode_answer let through logprobs: {e}"))?;
            }
        }
        PeerAnswer::Renewed { unknown } => bound("Renewed ids", unknown.len(), MAX_RENEW_IDS)?,
        PeerAnswer::Session(s) => bound("session address", s.transfer_addr.len(), MAX_NAME_BYTES)?,
        PeerAnswer::Placement(p) => placement_bounds(p)?,
        _ => {}
    }
    let bytes = encode_answer(&answer).map_err(|e| e.to_string())?;
    let back = decode_answer(&bytes).map_err(|e| format!("re-encoded answer refused: {e}"))?;
    if back != answer {
        return Err(format!("round trip changed {answer:?} into {back:?}"));
    }
    // What the decode instance does next: the handshake and the read plan.
    for local in [ours(), ours_tp2()] {
        match &answer {
            PeerAnswer::Info(theirs) if validate_peer(&local, theirs).is_ok() => {
                plan(&local, theirs, &[0, 1], &[2, 3], 2 * BLOCK_SIZE)?;
            }
            PeerAnswer::Prefilled(PrefillAnswer {
                held: Some(HeldKv { block_ids, .. }),
                ..
            }) => {
                let n = block_ids.len().min(8);
                let local_blocks: Vec<u32> = (0..n as u32).collect();
                plan(&local, &ours(), &local_blocks, block_ids, n * BLOCK_SIZE)?;
            }
            _ => {}
        }
    }
    Ok(Verdict::Accepted)
}

/// Plans a pull and checks that every planned op stays inside the regions both sides
/// published.
fn plan(
    local: &KvPeerInfo,
    theirs: &KvPeerInfo,
    local_blocks: &[u32],
    remote_blocks: &[u32],
    tokens: usize,
) -> Result<(), String> {
    if check_blocks(local, theirs, local_blocks, remote_blocks, tokens).is_err() {
        return Ok(());
    }
    let batches = plan_pull(local, theirs, local_blocks, remote_blocks, tokens)
        .map_err(|e| format!("plan_pull refused checked blocks: {e}"))?;
    let region_len = |info: &KvPeerInfo, region: u64| {
        info.ranks.iter().find_map(|r| {
            r.regions
                .iter()
                .position(|&id| id == region)
                .map(|_| region_bytes(&r.layout))
        })
    };
    for op in batches.iter().flatten() {
        let ours_len = region_len(local, op.local_region).ok_or_else(|| {
            format!(
                "an op reads into region {} we never published",
                op.local_region
            )
        })?;
        let theirs_len = region_len(theirs, op.remote_region).ok_or_else(|| {
            format!(
                "an op reads region {} the peer never published",
                op.remote_region
            )
        })?;
        let fits = |off: u64, len: u64| off.checked_add(op.len).is_some_and(|e| e <= len);
        if !fits(op.local_offset, ours_len) || !fits(op.remote_offset, theirs_len) {
            return Err(format!("an op runs past a region: {op:?}"));
        }
    }
    Ok(())
}

/// `KvLayout::region_bytes` without overflow (a peer's layout may hold absurd counts):
/// saturates at `u64::MAX`, so an absurd region is never "too short" by wrapping.
fn region_bytes(l: &KvLayout) -> u64 {
    [
        2,
        l.num_blocks,
        l.num_kv_heads,
        l.block_size,
        l.head_dim,
        l.dtype.size(),
    ]
    .iter()
    .try_fold(1u64, |acc, &n| acc.checked_mul(n as u64))
    .unwrap_or(u64::MAX)
}

fn sampling() -> impl Strategy<Value = SamplingParams> {
    let logprobs = || proptest::option::of(prop_oneof![0u32..=24, any::<u32>()]);
    (
        (
            prop_oneof![Just(0.0f32), 0.0f32..3.0, any::<f32>()],
            proptest::option::of(any::<u32>()),
            prop_oneof![Just(1.0f32), any::<f32>()],
            any::<Option<u64>>(),
            vec(".{0,8}", 0..3),
            vec(any::<u32>(), 0..4),
            any::<bool>(),
        )
            .prop_map(
                |(temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos)| {
                    SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        seed,
                        stop,
                        stop_token_ids,
                        ignore_eos,
                        ..SamplingParams::default()
                    }
                },
            ),
        logprobs(),
        logprobs(),
        // Hostile biases: past the count bound, non-finite or huge values, any ids.
        prop_oneof![0..3usize, 299..303usize].prop_flat_map(|n| {
            vec(
                (any::<u32>(), prop_oneof![-100.0f32..=100.0, any::<f32>()])
                    .prop_map(|(token, bias)| LogitBias { token, bias }),
                n,
            )
        }),
    )
        .prop_map(
            |(p, logprobs, prompt_logprobs, logit_bias)| SamplingParams {
                logprobs,
                prompt_logprobs,
                logit_bias,
                ..p
            },
        )
}

/// Logprobs as a hostile prefill instance might send them: any count, any floats.
fn token_logprobs() -> impl Strategy<Value = TokenLogprobs> {
    let value = prop_oneof![-30.0f32..=0.0, any::<f32>()];
    (
        any::<u32>(),
        value.clone(),
        vec((any::<u32>(), value), 0..=24),
    )
        .prop_map(|(token, logprob, top)| TokenLogprobs {
            token,
            logprob,
            top: top
                .into_iter()
                .map(|(token, logprob)| TopLogprob { token, logprob })
                .collect(),
        })
}

fn transfer_id() -> impl Strategy<Value = TransferId> {
    any::<u128>().prop_map(TransferId)
}

fn peer_info() -> impl Strategy<Value = KvPeerInfo> {
    (
        prop_oneof![Just(ours()), Just(ours_tp2())],
        vec((0usize..6, 0usize..6, 0usize..10, 0usize..3), 0..3),
        any::<bool>(),
    )
        .prop_map(|(mut info, edits, push_rank)| {
            // Small edits of a valid layout: the interesting inputs are near-valid ones.
            for (rank, field, value, what) in edits {
                let n = info.ranks.len();
                let r = &mut info.ranks[rank % n];
                match (field, what) {
                    (0, _) => r.heads.0 = value,
                    (1, _) => r.heads.1 = value,
                    (2, _) => r.layout.num_blocks = value,
                    (3, _) => r.layout.num_layers = value,
                    (4, _) => r.layout.num_kv_heads = value,
                    (_, 0) => r.regions.push(value as u64),
                    _ => {
                        r.regions.pop();
                    }
                }
            }
            if push_rank {
                let last = info.ranks[info.ranks.len() - 1].clone();
                info.ranks.push(last);
            }
            info
        })
}

fn placement() -> impl Strategy<Value = KvPlacement> {
    let device = (
        any::<[u8; 16]>(),
        any::<bool>(),
        vec(any::<u64>(), 0..4),
        vec((vec(any::<u8>(), 60..68), any::<u64>()), 0..4),
    )
        .prop_map(|(gpu_uuid, ipc_export, region_bytes, handles)| {
            RankPlacement::Device(kv_path::DeviceRank {
                gpu_uuid,
                ordinal: 0,
                ipc_export,
                region_bytes,
                handles: handles
                    .into_iter()
                    .map(|(handle, bytes)| kv_path::IpcRegion { handle, bytes })
                    .collect(),
            })
        });
    (
        ".{0,16}",
        ".{0,40}",
        any::<u64>(),
        vec(prop_oneof![Just(RankPlacement::Host), device], 0..3),
    )
        .prop_map(|(engine_id, boot_id, proof_id, ranks)| KvPlacement {
            engine_id,
            host: kv_path::HostIdentity {
                boot_id,
                proof_id,
                nonce: [4; 32],
            },
            ranks,
        })
}

fn request() -> impl Strategy<Value = PeerRequest> {
    prop_oneof![
        Just(PeerRequest::Info),
        (peer_info(), placement()).prop_map(|(info, placement)| PeerRequest::Placement(Box::new(
            PlacementAsk { info, placement }
        ))),
        (
            transfer_id(),
            vec(0u32..1100, 0..40),
            sampling(),
            proptest::option::of((peer_info(), vec(0u32..10, 0..12), any::<bool>())),
            0u32..4,
        )
            .prop_map(|(transfer, prompt, sampling, push, cached_blocks)| {
                PeerRequest::Prefill(PrefillRequest {
                    transfer,
                    prompt,
                    sampling,
                    mode: match push {
                        None => PrefillMode::Pull,
                        Some((peer, block_ids, session)) => PrefillMode::Push {
                            peer,
                            block_ids,
                            session: session.then(|| SessionOffer {
                                key: [3; 32],
                                transfer_addr: "127.0.0.1:7300".into(),
                            }),
                        },
                    },
                    cached_blocks,
                })
            }),
        vec(transfer_id(), 0..8).prop_map(PeerRequest::Renew),
        transfer_id().prop_map(PeerRequest::Release),
        transfer_id().prop_map(PeerRequest::Abort),
        (".{0,16}", any::<bool>())
            .prop_map(|(initiator, fresh)| PeerRequest::OpenSession { initiator, fresh }),
        (transfer_id(), ".{0,16}").prop_map(|(transfer, initiator)| PeerRequest::OpenRead {
            transfer,
            initiator
        }),
    ]
}

fn answer() -> impl Strategy<Value = PeerAnswer> {
    prop_oneof![
        peer_info().prop_map(PeerAnswer::Info),
        placement().prop_map(|p| PeerAnswer::Placement(Box::new(p))),
        (
            transfer_id(),
            any::<u32>(),
            proptest::option::of((vec(0u32..12, 0..10), any::<u64>())),
            any::<u64>(),
            proptest::option::of(token_logprobs()),
            any::<u32>(),
        )
            .prop_map(
                |(
                    transfer,
                    first_token,
                    held,
                    computed_at_unix_us,
                    first_logprobs,
                    cached_tokens,
                )| {
                    PeerAnswer::Prefilled(PrefillAnswer {
                        transfer,
                        first_token,
                        first_logprobs,
                        held: held.map(|(block_ids, lease_ms)| HeldKv {
                            block_ids,
                            lease_ms,
                        }),
                        computed_at_unix_us,
                        cached_tokens,
                    })
                }
            ),
        vec(transfer_id(), 0..8).prop_map(|unknown| PeerAnswer::Renewed { unknown }),
        any::<bool>().prop_map(|was_held| PeerAnswer::Released { was_held }),
        any::<bool>().prop_map(|found| PeerAnswer::Aborted { found }),
        ".{0,16}".prop_map(|a| PeerAnswer::Session(SessionOffer {
            key: [9; 32],
            transfer_addr: a
        })),
        Just(PeerAnswer::ReadOpened),
        (".{0,16}", ".{0,16}").prop_map(|(kind, message)| PeerAnswer::Failed(
            HandoffError::PrefillFailed { kind, message }
        )),
    ]
}

#[test]
fn peer_requests() {
    let report = Target::new("peer_request").run(check_request, |runner| {
        encode_request(&draw(runner, request())).expect("encodes")
    });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

#[test]
fn peer_answers() {
    let report = Target::new("peer_answer").run(check_answer, |runner| {
        encode_answer(&draw(runner, answer())).expect("encodes")
    });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

/// The instance the HTTP targets answer as.
const MAX_MODEL_LEN: usize = 2048;
const VOCAB: usize = 49152;

fn check_openai(input: &[u8]) -> Result<Verdict, String> {
    let mut accepted = false;
    for chat in [false, true] {
        let req = match parse_request(input, chat) {
            Ok(r) => r,
            Err(RequestError::BadRequest(_)) => continue,
            Err(e) => {
                return Err(format!(
                    "parse_request failed with a {} error: {e}",
                    e.kind()
                ))
            }
        };
        // Sane, bounded fields.
        let p = &req.params;
        let in_range = p.temperature.is_finite()
            && (0.0..=2.0).contains(&p.temperature)
            && p.top_p > 0.0
            && p.top_p <= 1.0
            && (0.0..=1.0).contains(&p.min_p)
            && (-2.0..=2.0).contains(&p.presence_penalty)
            && (-2.0..=2.0).contains(&p.frequency_penalty)
            && p.repetition_penalty > 0.0
            && p.repetition_penalty <= 10.0
            && p.top_k != Some(0)
            && p.stop.len() <= MAX_STOP_STRINGS
            && p.logprobs.is_none_or(|n| n <= MAX_LOGPROBS)
            && p.prompt_logprobs.is_none_or(|n| n <= MAX_LOGPROBS)
            && (p.prompt_logprobs.is_none() || req.echo)
            && p.logit_bias.len() <= MAX_LOGIT_BIAS_ENTRIES
            && logit_bias_in_range(&p.logit_bias)
            && (1..=MAX_CHOICES).contains(&req.n)
            && req.n * (1 + req.more_prompts.len()) <= MAX_CHOICES_TOTAL
            && (req.n == 1 || req.resume_tokens.is_empty())
            && (req.max_tokens != Some(0) || req.echo);
        if !in_range {
            return Err(format!(
                "accepted out-of-range sampling: {p:?}, max_tokens {:?}",
                req.max_tokens
            ));
        }
        // `top_k` is what the client asked for (clamped to u32), never a truncation of it.
        let body: Value = serde_json::from_slice(input).map_err(|e| e.to_string())?;
        if let Some(k) = body.get("top_k").and_then(Value::as_i64).filter(|&k| k > 0) {
            let want = u32::try_from(k).unwrap_or(u32::MAX);
            if p.top_k != Some(want) {
                return Err(format!("top_k {k} became {:?}", p.top_k));
            }
        }
        match (&req.prompt, chat) {
            (PromptInput::Chat(m), true) if !m.is_empty() => {}
            (PromptInput::Text(_) | PromptInput::Tokens(_), false) => {}
            (other, _) => return Err(format!("chat={chat} accepted the prompt {other:?}")),
        }
        // What the handler does next: resolve max_tokens against the prompt, validate the
        // sampling, read kv_transfer_params.
        let prompt_len = match &req.prompt {
            PromptInput::Tokens(t) => t.len(),
            PromptInput::Text(s) => s.len(),
            PromptInput::Chat(m) => m.len(),
        };
        match resolve_max_tokens(req.max_tokens_to_run(), chat, prompt_len, MAX_MODEL_LEN) {
            Ok(n) => {
                if n == 0 || prompt_len + n > MAX_MODEL_LEN {
                    return Err(format!(
                        "resolved max_tokens {n} for a prompt of {prompt_len}"
                    ));
                }
                let mut params = req.params.clone();
                params.max_tokens = n;
                let _ = params.validate(VOCAB);
            }
            Err(RequestError::ContextOverflow { .. }) => {}
            Err(e) => return Err(format!("resolve_max_tokens: unexpected {e}")),
        }
        check_directive(req.kv_transfer_params.as_ref(), "http")?;
        accepted = true;
    }
    Ok(if accepted {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    })
}

/// Checks what `kv_directive` made of `params`.
fn check_directive(params: Option<&Value>, scheme: &str) -> Result<bool, String> {
    let directive = match kv_directive(params, scheme) {
        Ok(d) => d,
        Err(RequestError::BadRequest(_)) => return Ok(false),
        Err(e) => {
            return Err(format!(
                "kv_directive failed with a {} error: {e}",
                e.kind()
            ))
        }
    };
    let p = params.cloned().unwrap_or(Value::Null);
    let peer = match &directive {
        KvDirective::None | KvDirective::HoldForDecode(_) => return Ok(true),
        KvDirective::DriveRemote { peer, .. } => peer,
        KvDirective::FromPrefill {
            peer,
            block_ids,
            first_token,
            first_logprobs,
            ..
        } => {
            if let Some(lp) = first_logprobs {
                lp.validate(usize::MAX, MAX_LOGPROBS as usize)
                    .map_err(|e| format!("kv_directive let through logprobs: {e}"))?;
                if lp.token != *first_token {
                    return Err(format!(
                        "logprobs for {} accepted for T0 {first_token}",
                        lp.token
                    ));
                }
            }
            if p.get("remote_block_ids")
                .and_then(Value::as_array)
                .map(Vec::len)
                != Some(block_ids.len())
            {
                return Err(format!("block ids {block_ids:?} are not the ones sent"));
            }
            peer
        }
    };
    let host = p["remote_host"].as_str().unwrap_or_default();
    let port = p["remote_port"].as_u64().unwrap_or_default();
    if host.is_empty() || host.contains('/') || !(1..=65535).contains(&port) {
        return Err(format!("accepted host {host:?} port {port}"));
    }
    // A bare IPv6 address is bracketed (and written canonically) in the URL.
    let host = match host.parse::<std::net::Ipv6Addr>() {
        Ok(v6) => format!("[{v6}]"),
        Err(_) => host.to_string(),
    };
    if peer.url != format!("{scheme}://{host}:{port}") {
        return Err(format!(
            "the peer's url {} is not {scheme}://{host}:{port}",
            peer.url
        ));
    }
    Ok(true)
}

fn check_kv_params(input: &[u8]) -> Result<Verdict, String> {
    let Ok(v) = parse_json(input) else {
        return Ok(Verdict::Rejected);
    };
    let mut accepted = false;
    for scheme in ["http", "https"] {
        accepted |= check_directive(Some(&v), scheme)?;
    }
    Ok(if accepted {
        Verdict::Accepted
    } else {
        Verdict::Rejected
    })
}

fn openai_body() -> impl Strategy<Value = Value> {
    let number = prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        (0u64..5).prop_map(Value::from),
        Just(Value::Null),
    ];
    (
        prop_oneof![
            ".{0,24}".prop_map(Value::from),
            vec(any::<u32>(), 0..6).prop_map(|t| json!(t)),
            vec(0u64..70_000, 1..4).prop_map(|t| json!([t])),
        ],
        vec(
            (
                prop_oneof![Just("user"), Just("system"), Just("assistant"), Just("wizard")],
                ".{0,12}"
            ),
            0..3,
        ),
        vec(
            (
                prop_oneof![
                    Just("max_tokens"),
                    Just("max_completion_tokens"),
                    Just("temperature"),
                    Just("top_p"),
                    Just("top_k"),
                    Just("min_p"),
                    Just("seed"),
                    Just("n"),
                    Just("presence_penalty"),
                    Just("repetition_penalty"),
                    Just("logprobs"),
                    Just("logit_bias"),
                    Just("best_of"),
                ],
                number,
            ),
            0..5,
        ),
        vec(".{0,4}", 0..3),
        proptest::option::of(kv_params()),
        any::<bool>(),
    )
        .prop_map(|(prompt, messages, numbers, stop, kv, stream)| {
            let mut body = json!({
                "model": "m",
                "prompt": prompt,
                "messages": messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect::<Vec<_>>(),
                "stop": stop,
                "stream": stream,
            });
            for (k, v) in numbers {
                body[k] = v;
            }
            if let Some(kv) = kv {
                body["kv_transfer_params"] = kv;
            }
            body
        })
}

fn kv_params() -> impl Strategy<Value = Value> {
    (
        any::<bool>(),
        prop_oneof![Just("10.0.0.1".to_string()), ".{0,12}"],
        prop_oneof![Just(8100u64), any::<u64>()],
        proptest::option::of(vec(any::<u32>(), 0..6)),
        proptest::option::of(any::<u64>()),
        prop_oneof![
            Just(Value::Null),
            any::<u128>().prop_map(|t| Value::from(format!("{t:032x}"))),
            "[0-9a-fA-Fg]{0,34}".prop_map(Value::from),
        ],
        proptest::option::of(prop_oneof![Just("10.0.0.1:7100".to_string()), ".{0,12}"]),
    )
        .prop_map(|(decode, host, port, blocks, first, transfer, control)| {
            let mut v = json!({
                "do_remote_decode": decode && port % 2 == 0,
                "do_remote_prefill": !decode || port % 3 == 0,
                "remote_host": host,
                "remote_port": port,
                "transfer_id": transfer,
                "remote_engine_id": "prefill-0",
            });
            if let Some(b) = blocks {
                v["remote_block_ids"] = json!(b);
            }
            if let Some(f) = first {
                v["first_token_id"] = json!(f);
                v["kv_lease_ms"] = json!(f);
            }
            if let Some(c) = control {
                v["remote_control_addr"] = json!(c);
            }
            v
        })
}

#[test]
fn openai_requests() {
    let report = Target::new("openai_request")
        .dictionary(fuzz_support::JSON_TOKENS)
        .run(check_openai, |runner| {
            serde_json::to_vec(&draw(runner, openai_body())).expect("encodes")
        });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

#[test]
fn kv_transfer_params() {
    let report = Target::new("kv_transfer_params")
        .dictionary(fuzz_support::JSON_TOKENS)
        .run(check_kv_params, |runner| {
            serde_json::to_vec(&draw(runner, kv_params())).expect("encodes")
        });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

/// The proxy's bound on indexed hashes per instance in these targets.
const INDEX_MAX: usize = 64;

fn check_kv_events(input: &[u8]) -> Result<Verdict, String> {
    let Ok(batch) = serde_json::from_slice::<KvEventBatch>(input) else {
        return Ok(Verdict::Rejected);
    };
    let json = serde_json::to_vec(&batch).map_err(|e| e.to_string())?;
    let back: KvEventBatch =
        serde_json::from_slice(&json).map_err(|e| format!("re-encoded batch refused: {e}"))?;
    if back != batch {
        return Err(format!("round trip changed {batch:?} into {back:?}"));
    }
    // What the proxy does with it.
    let mut index = KvIndex::new(INDEX_MAX);
    index.register(
        "http://10.0.0.1:8000",
        HashScheme {
            block_size: 16,
            salt: 1,
        },
    );
    // A batch the index refuses (an unknown medium, too many events) changes nothing but
    // dropping what it knew of the instance; either way the bound holds.
    let verdict = match batch.check() {
        Ok(_) => Verdict::Accepted,
        Err(_) => Verdict::Rejected,
    };
    let first = index.apply("http://10.0.0.1:8000", batch.clone());
    let second = index.apply("http://10.0.0.1:8000", batch);
    if first.is_ok() != (verdict == Verdict::Accepted) || first != second {
        return Err(format!(
            "apply disagrees with check: {first:?} / {second:?}"
        ));
    }
    for size in index.sizes() {
        if size.blocks > INDEX_MAX {
            return Err(format!(
                "{} indexes {} hashes, bound {INDEX_MAX}",
                size.url, size.blocks
            ));
        }
        if verdict == Verdict::Rejected && size.blocks != 0 {
            return Err(format!("a refused batch left {} hashes", size.blocks));
        }
    }
    Ok(verdict)
}

#[test]
fn kv_events() {
    let report = Target::new("kv_events")
        .dictionary(fuzz_support::JSON_TOKENS)
        .run(check_kv_events, |runner| {
            let (snapshot, ops, tiers) = draw(
                runner,
                (
                    proptest::option::of(vec(any::<u64>(), 0..80)),
                    vec((any::<bool>(), vec(0u64..100, 0..40)), 0..4),
                    vec(
                        (
                            0usize..5,
                            proptest::option::of(vec(0u64..100, 0..40)),
                            vec((any::<bool>(), vec(0u64..100, 0..20)), 0..3),
                        ),
                        0..3,
                    ),
                ),
            );
            let ops_of = |ops: Vec<(bool, Vec<u64>)>| -> Vec<KvOp> {
                ops.into_iter()
                    .map(|(s, v)| if s { KvOp::Stored(v) } else { KvOp::Removed(v) })
                    .collect()
            };
            let batch = KvEventBatch {
                snapshot,
                ops: ops_of(ops),
                tiers: tiers
                    .into_iter()
                    .map(|(m, snapshot, ops)| TierEvents {
                        medium: ["host", "disk", "shared", "pool", "tape"][m].into(),
                        snapshot,
                        ops: ops_of(ops),
                    })
                    .collect(),
            };
            serde_json::to_vec(&batch).expect("encodes")
        });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

fn check_registration(input: &[u8]) -> Result<Verdict, String> {
    let Ok(reg) = serde_json::from_slice::<Registration>(input) else {
        return Ok(Verdict::Rejected);
    };
    let json = serde_json::to_vec(&reg).map_err(|e| e.to_string())?;
    let back: Registration = serde_json::from_slice(&json)
        .map_err(|e| format!("re-encoded registration refused: {e}"))?;
    if back != reg {
        return Err(format!("round trip changed {reg:?} into {back:?}"));
    }
    if reg.validate("decode-0").is_err() {
        return Ok(Verdict::Rejected);
    }
    let range = pdserve_runtime::config::HEARTBEAT_MS_RANGE;
    if reg.node != "decode-0"
        || !reg.role.is_instance()
        || !range.contains(&reg.heartbeat_ms)
        || reg.control_addr.parse::<std::net::SocketAddr>().is_err()
        || reg.block_size.is_some() != reg.cache_salt.is_some()
        || reg.block_size.is_some_and(|b| !(1..=4096).contains(&b))
    {
        return Err(format!("validate accepted {reg:?}"));
    }
    Ok(Verdict::Accepted)
}

fn sample_registration() -> Registration {
    Registration {
        node: "decode-0".into(),
        role: Role::Decode,
        url: "http://10.0.0.2:8000".into(),
        control_addr: "10.0.0.2:7100".into(),
        heartbeat_ms: 500,
        block_size: Some(16),
        cache_salt: Some(0xfeed),
    }
}

#[test]
fn registrations() {
    let report = Target::new("registration")
        .dictionary(fuzz_support::JSON_TOKENS)
        .run(check_registration, |runner| {
            let mut reg = sample_registration();
            let (url, control, hb, bs, salt, role) = draw(
                runner,
                (
                    prop_oneof![
                        Just("http://10.0.0.2:8000".to_string()),
                        "(http|https|ftp)://[a-z0-9.:\\[\\]@]{0,16}(/[a-z]{0,4})?"
                    ],
                    prop_oneof![Just("10.0.0.2:7100".to_string()), "[0-9.:\\[\\]a-f]{0,20}"],
                    prop_oneof![Just(500u64), any::<u64>()],
                    proptest::option::of(prop_oneof![0usize..5000, any::<usize>()]),
                    any::<Option<u64>>(),
                    prop_oneof![
                        Just(Role::Prefill),
                        Just(Role::Decode),
                        Just(Role::Colocated),
                        Just(Role::Proxy),
                        Just(Role::Other)
                    ],
                ),
            );
            (reg.url, reg.control_addr, reg.heartbeat_ms) = (url, control, hb);
            (reg.block_size, reg.cache_salt, reg.role) = (bs, salt, role);
            serde_json::to_vec(&reg).expect("encodes")
        });
    assert!(report.accepted > 0, "no input decoded: {report:?}");
}

/// A same-GPU placement of `ours()`'s one rank, with or without its IPC handles.
fn placement_for_corpus(handles: bool) -> KvPlacement {
    let rank = &ours().ranks[0];
    let bytes = rank.layout.region_bytes() as u64;
    KvPlacement {
        engine_id: ours().engine_id,
        host: kv_path::HostIdentity {
            boot_id: "0f4c2d8e-5b1a-4c7e-9d3f-2a6b8c1e4f70".into(),
            proof_id: 0x1234_5678_9abc_def0,
            nonce: [0x5a; 32],
        },
        ranks: vec![RankPlacement::Device(kv_path::DeviceRank {
            gpu_uuid: [0x11; 16],
            ordinal: 0,
            ipc_export: true,
            region_bytes: vec![bytes; rank.layout.num_layers],
            handles: if handles {
                (0..rank.layout.num_layers)
                    .map(|l| kv_path::IpcRegion {
                        handle: vec![l as u8; kv_path::IPC_HANDLE_BYTES],
                        bytes,
                    })
                    .collect()
            } else {
                Vec::new()
            },
        })],
    }
}

fn requests_for_corpus() -> Vec<(&'static str, PeerRequest)> {
    let t = TransferId(0xabc);
    vec![
        ("info", PeerRequest::Info),
        (
            "placement",
            PeerRequest::Placement(Box::new(PlacementAsk {
                info: ours(),
                placement: placement_for_corpus(false),
            })),
        ),
        (
            "prefill-pull",
            PeerRequest::Prefill(PrefillRequest {
                transfer: t,
                prompt: vec![1, 2, 3, 4, 5],
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_k: Some(40),
                    seed: Some(3),
                    stop: vec!["\n\n".into()],
                    stop_token_ids: vec![2],
                    logit_bias: vec![LogitBias {
                        token: 4,
                        bias: -100.0,
                    }],
                    ..SamplingParams::default()
                },
                mode: PrefillMode::Pull,
                cached_blocks: 0,
            }),
        ),
        (
            "prefill-push",
            PeerRequest::Prefill(PrefillRequest {
                transfer: t,
                prompt: vec![5; 9],
                sampling: SamplingParams::greedy(1),
                mode: PrefillMode::Push {
                    peer: ours_tp2(),
                    block_ids: vec![3, 4],
                    session: Some(SessionOffer {
                        key: [7; 32],
                        transfer_addr: "127.0.0.1:9".into(),
                    }),
                },
                cached_blocks: 1,
            }),
        ),
        ("renew", PeerRequest::Renew(vec![t, TransferId(1)])),
        ("release", PeerRequest::Release(t)),
        ("abort", PeerRequest::Abort(t)),
        (
            "open-session",
            PeerRequest::OpenSession {
                initiator: "decode-0".into(),
                fresh: true,
            },
        ),
        (
            "open-read",
            PeerRequest::OpenRead {
                transfer: t,
                initiator: "decode-0".into(),
            },
        ),
    ]
}

fn answers_for_corpus() -> Vec<(&'static str, PeerAnswer)> {
    let t = TransferId(0xabc);
    vec![
        ("info", PeerAnswer::Info(ours())),
        ("info-tp2", PeerAnswer::Info(ours_tp2())),
        (
            "prefilled-pull",
            PeerAnswer::Prefilled(PrefillAnswer {
                transfer: t,
                first_token: 17,
                first_logprobs: None,
                held: Some(HeldKv {
                    block_ids: vec![1, 2],
                    lease_ms: 30_000,
                }),
                computed_at_unix_us: 5,
                cached_tokens: 16,
            }),
        ),
        (
            "prefilled-push",
            PeerAnswer::Prefilled(PrefillAnswer {
                transfer: t,
                first_token: 17,
                first_logprobs: Some(TokenLogprobs {
                    token: 17,
                    logprob: -0.25,
                    top: vec![
                        TopLogprob {
                            token: 17,
                            logprob: -0.25,
                        },
                        TopLogprob {
                            token: 3,
                            logprob: -1.5,
                        },
                    ],
                }),
                held: None,
                computed_at_unix_us: 5,
                cached_tokens: 16,
            }),
        ),
        ("renewed", PeerAnswer::Renewed { unknown: vec![t] }),
        ("released", PeerAnswer::Released { was_held: true }),
        ("aborted", PeerAnswer::Aborted { found: false }),
        (
            "session",
            PeerAnswer::Session(SessionOffer {
                key: [1; 32],
                transfer_addr: "127.0.0.1:7200".into(),
            }),
        ),
        ("read-opened", PeerAnswer::ReadOpened),
        (
            "placement",
            PeerAnswer::Placement(Box::new(placement_for_corpus(true))),
        ),
        (
            "failed",
            PeerAnswer::Failed(HandoffError::Timeout {
                what: "prefill".into(),
                secs: 30,
            }),
        ),
    ]
}

/// Hostile variants of a valid rkyv archive: truncated, and with each aligned 4- and 8-byte
/// word near its end (where rkyv puts the root's lengths and offsets) set to the largest
/// values.
fn hostile_archives(name: &str, valid: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = vec![(
        format!("hostile-{name}-truncated.bin"),
        valid[..valid.len() / 2].to_vec(),
    )];
    let n = valid.len();
    for (i, at) in (n.saturating_sub(24)..n).step_by(4).enumerate() {
        let mut v = valid.to_vec();
        let end = (at + 4).min(n);
        v[at..end].copy_from_slice(&u32::MAX.to_le_bytes()[..end - at]);
        out.push((format!("hostile-{name}-u32-max-{i}.bin"), v));
    }
    let mut v = valid.to_vec();
    if n >= 8 {
        v[n - 8..].copy_from_slice(&u64::MAX.to_le_bytes());
        out.push((format!("hostile-{name}-u64-max.bin"), v));
    }
    out
}

/// Rewrites the corpora of this file's targets from the encoders, plus hand-made hostile
/// inputs.
#[test]
#[ignore = "rewrites the corpus in the repository; run by hand after a format change"]
fn regenerate_corpus() {
    let mut entries = Vec::new();
    for (name, req) in requests_for_corpus() {
        let bytes = encode_request(&req).expect("encodes");
        if name.starts_with("prefill") || name == "renew" {
            entries.extend(hostile_archives(name, &bytes));
        }
        entries.push((format!("valid-{name}.bin"), bytes));
    }
    // Past the bounds: more renew ids than MAX_RENEW_IDS.
    entries.push((
        "hostile-renew-past-bound.bin".into(),
        encode_request(&PeerRequest::Renew(vec![TransferId(7); MAX_RENEW_IDS + 1]))
            .expect("encodes"),
    ));
    entries.push(("hostile-empty.bin".into(), Vec::new()));
    fuzz_support::write_corpus("peer_request", &entries);

    let mut entries = Vec::new();
    for (name, answer) in answers_for_corpus() {
        let bytes = encode_answer(&answer).expect("encodes");
        if name.starts_with("info") || name.starts_with("prefilled") {
            entries.extend(hostile_archives(name, &bytes));
        }
        entries.push((format!("valid-{name}.bin"), bytes));
    }
    let mut wide = ours();
    wide.ranks = vec![wide.ranks[0].clone(); MAX_RANKS + 1];
    entries.push((
        "hostile-info-too-many-ranks.bin".into(),
        encode_answer(&PeerAnswer::Info(wide)).expect("encodes"),
    ));
    fuzz_support::write_corpus("peer_answer", &entries);

    let deep = format!(
        "{{\"prompt\":{}1{}}}",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    let huge_array = format!(
        "{{\"prompt\":[{}1],\"stop_token_ids\":[{}1]}}",
        "1,".repeat(8000),
        "0,".repeat(8000)
    );
    let openai: Vec<(String, Vec<u8>)> = [
        ("valid-completion", json!({"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_k": 40, "stop": ["\n"], "stream": true, "stream_options": {"include_usage": true}})),
        ("valid-tokens", json!({"prompt": [1, 2, 3], "max_tokens": 4, "seed": 7, "return_token_ids": true})),
        ("valid-chat", json!({"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 16, "top_p": 0.9})),
        ("valid-remote-prefill", json!({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.0.0.1", "remote_port": 8100, "remote_engine_id": "prefill-0", "remote_control_addr": "10.0.0.1:7100", "transfer_id": "000000000000000000000000000000ab"}})),
        ("valid-resume", json!({"prompt": [5, 6], "resume_tokens": [7, 8], "max_tokens": 3})),
        ("valid-chat-logprobs", json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 5})),
        ("valid-echo-score", json!({"prompt": "The sky is blue", "echo": true, "max_tokens": 0, "logprobs": 1, "temperature": 0})),
        ("hostile-top-logprobs-21", json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21})),
        ("hostile-logprobs-u64-max", json!({"prompt": "x", "logprobs": u64::MAX, "echo": true})),
        ("valid-prompt-list", json!({"prompt": ["a b", [1, 2, 3], "c"], "n": 2, "max_tokens": 3})),
        ("hostile-prompt-list-65", json!({"prompt": vec!["x"; 65], "n": 16})),
        ("valid-n-choices", json!({"prompt": "x", "n": 4, "seed": 3, "temperature": 1, "stream": true})),
        ("hostile-n-and-best-of", json!({"prompt": "x", "n": 17, "best_of": u64::MAX})),
        ("valid-logit-bias", json!({"prompt": "x", "logit_bias": {"5": 100, "6": -100, "7": 0.5}})),
        ("hostile-logit-bias-301", json!({"prompt": "x", "logit_bias": (0..301).map(|i| (i.to_string(), json!(1))).collect::<serde_json::Map<String, Value>>()})),
        ("hostile-logit-bias-values", json!({"prompt": "x", "logit_bias": {"4294967296": 1, "1": 1e308, "2": "100", "-3": 5}})),
        ("hostile-max-tokens-u64-max", json!({"prompt": "x", "max_tokens": u64::MAX})),
        ("hostile-max-tokens-negative", json!({"prompt": "x", "max_tokens": -1})),
        ("hostile-top-k-u32-overflow", json!({"prompt": "x", "top_k": 4_294_967_297u64})),
        ("hostile-absurd-floats", json!({"prompt": "x", "temperature": 1e308, "top_p": -0.0, "presence_penalty": -1e-320})),
        ("hostile-token-past-u32", json!({"prompt": [4_294_967_296u64], "stop_token_ids": [-1]})),
    ]
    .into_iter()
    .map(|(n, v)| (format!("{n}.json"), serde_json::to_vec(&v).expect("encodes")))
    .chain([
        ("hostile-nested-10k.json".to_string(), deep.into_bytes()),
        ("hostile-huge-arrays.json".to_string(), huge_array.into_bytes()),
        ("hostile-non-utf8.json".to_string(), b"{\"prompt\":\"\xff\xfe\xc0\x80\"}".to_vec()),
        ("hostile-lone-surrogate.json".to_string(), b"{\"prompt\":\"\\ud800\"}".to_vec()),
        ("hostile-absurd-number.json".to_string(), b"{\"prompt\":\"x\",\"max_tokens\":1e999}".to_vec()),
        ("hostile-truncated.json".to_string(), b"{\"prompt\":\"x\",\"max_tok".to_vec()),
    ])
    .collect();
    fuzz_support::write_corpus("openai_request", &openai);

    let one_hop = KvTransferParams {
        do_remote_decode: false,
        do_remote_prefill: true,
        remote_host: Some("10.0.0.1".into()),
        remote_port: Some(8100),
        remote_engine_id: Some("prefill-0".into()),
        remote_control_addr: Some("10.0.0.1:7100".into()),
        remote_block_ids: None,
        transfer_id: format!("{:032x}", 0xabc),
        first_token_id: None,
        first_token_logprobs: None,
        kv_lease_ms: None,
        cached_tokens: None,
    };
    let two_hop = KvTransferParams {
        remote_block_ids: Some(vec![1, 2, 3]),
        first_token_id: Some(17),
        first_token_logprobs: Some(TokenLogprobs {
            token: 17,
            logprob: -0.5,
            top: vec![TopLogprob {
                token: 4,
                logprob: -0.25,
            }],
        }),
        kv_lease_ms: Some(30_000),
        cached_tokens: Some(16),
        remote_control_addr: None,
        ..one_hop.clone()
    };
    let hold = KvTransferParams {
        do_remote_decode: true,
        do_remote_prefill: false,
        remote_host: None,
        remote_port: None,
        ..one_hop.clone()
    };
    let kv: Vec<(String, Vec<u8>)> = [
        ("valid-one-hop", serde_json::to_value(&one_hop).expect("encodes")),
        ("valid-two-hop", serde_json::to_value(&two_hop).expect("encodes")),
        ("valid-hold-for-decode", serde_json::to_value(&hold).expect("encodes")),
        ("hostile-port-u64-max", json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": u64::MAX})),
        ("hostile-host-with-path", json!({"do_remote_prefill": true, "remote_host": "h/x", "remote_port": 1})),
        ("hostile-transfer-id-long", json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "transfer_id": "f".repeat(40)})),
        ("hostile-block-ids-negative", json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_block_ids": [-1], "first_token_id": 1, "transfer_id": "1"})),
        ("hostile-lease-absurd", json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_block_ids": [1], "first_token_id": 1, "transfer_id": "1", "kv_lease_ms": 1e300})),
        ("hostile-not-an-object", json!([1, 2, 3])),
        ("hostile-logprobs-too-many", json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_block_ids": [1], "first_token_id": 1, "transfer_id": "1",
            "first_token_logprobs": {"token": 1, "logprob": -1.0, "top": vec![json!({"token": 1, "logprob": -1.0}); 21]}})),
        ("hostile-logprobs-positive", json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_block_ids": [1], "first_token_id": 1, "transfer_id": "1",
            "first_token_logprobs": {"token": 1, "logprob": 1e300, "top": []}})),
    ]
    .into_iter()
    .map(|(n, v)| (format!("{n}.json"), serde_json::to_vec(&v).expect("encodes")))
    .collect();
    fuzz_support::write_corpus("kv_transfer_params", &kv);

    let batch = KvEventBatch {
        snapshot: Some(vec![1, 2, 3]),
        ops: vec![KvOp::Stored(vec![4, 5]), KvOp::Removed(vec![1])],
        tiers: vec![TierEvents {
            medium: "host".into(),
            snapshot: Some(vec![7]),
            ops: vec![KvOp::Stored(vec![1])],
        }],
    };
    let delta = KvEventBatch {
        snapshot: None,
        ops: vec![KvOp::Removed(vec![u64::MAX]), KvOp::Stored(vec![9])],
        tiers: Vec::new(),
    };
    let many = format!(
        "{{\"snapshot\":[{}0],\"ops\":[{{\"stored\":[{}0]}}]}}",
        (1..4000).map(|i| format!("{i},")).collect::<String>(),
        (1..2000).map(|i| format!("{},", i * 7)).collect::<String>()
    );
    fuzz_support::write_corpus(
        "kv_events",
        &[
            (
                "valid-snapshot-and-ops.json".into(),
                serde_json::to_vec(&batch).expect("encodes"),
            ),
            (
                "valid-delta.json".into(),
                serde_json::to_vec(&delta).expect("encodes"),
            ),
            ("valid-empty.json".into(), b"{}".to_vec()),
            ("hostile-many-hashes.json".into(), many.into_bytes()),
            (
                "hostile-negative-hash.json".into(),
                b"{\"ops\":[{\"stored\":[-1]}]}".to_vec(),
            ),
            (
                "hostile-hash-past-u64.json".into(),
                b"{\"snapshot\":[18446744073709551616]}".to_vec(),
            ),
            (
                "hostile-unknown-op.json".into(),
                b"{\"ops\":[{\"moved\":[1]}]}".to_vec(),
            ),
            (
                "hostile-nested-10k.json".into(),
                format!("{{\"ops\":{}{}}}", "[".repeat(10_000), "]".repeat(10_000)).into_bytes(),
            ),
        ],
    );

    let reg = sample_registration();
    let plain = Registration {
        block_size: None,
        cache_salt: None,
        role: Role::Prefill,
        ..reg.clone()
    };
    let text = serde_json::to_string(&reg).expect("encodes");
    fuzz_support::write_corpus(
        "registration",
        &[
            (
                "valid-with-kv-events.json".into(),
                text.clone().into_bytes(),
            ),
            (
                "valid-plain.json".into(),
                serde_json::to_vec(&plain).expect("encodes"),
            ),
            (
                "hostile-heartbeat-u64-max.json".into(),
                text.replace("500", &u64::MAX.to_string()).into_bytes(),
            ),
            (
                "hostile-block-size-zero.json".into(),
                text.replace("\"block_size\":16", "\"block_size\":0")
                    .into_bytes(),
            ),
            (
                "hostile-url-unspecified.json".into(),
                text.replace("10.0.0.2:8000", "[::]:8000").into_bytes(),
            ),
            (
                "hostile-node-control-chars.json".into(),
                text.replace("decode-0", "decode-0\\u0000").into_bytes(),
            ),
            (
                "hostile-role-proxy.json".into(),
                text.replace("\"decode\"", "\"proxy\"").into_bytes(),
            ),
        ],
    );
}
