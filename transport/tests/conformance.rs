//! The transfer-engine conformance suite, run against every backend this machine can run:
//! `local` (two engines in this process), and `shm`, `tcp`, `quic` with the peer in a second
//! process (`pdserve-transfer-peer`). `rdma` runs the same suite with `--features rdma` where
//! `ibv_devices` lists a device.

mod common;

use std::time::Duration;

use common::{engine_config, wait_until, Cluster, Peer, STEP};
use pdserve_transport::peer::{fill_pattern, fnv1a};
use pdserve_transport::{
    BackendAvailability, BackendKind, BatchStatus, OpKind, RegisteredRegion, Side, TransferEngine,
    TransferOp, TransportError,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PEER_LENS: [u64; 2] = [1 << 20, 384 << 10];
const LOCAL_LENS: [u64; 2] = [768 << 10, 1 << 20];
/// Registrations are split at 192 KiB so pieces also cross chunk boundaries.
const MAX_REG: Option<u64> = Some(192 << 10);

struct Setup {
    _cluster: Option<Cluster>,
    engine: TransferEngine,
    peer: Peer,
    seed: u64,
}

fn setup(backend: BackendKind, seed: u64) -> Setup {
    let cluster = (backend == BackendKind::Quic).then(|| Cluster::new("conformance"));
    let peer = Peer::start(backend, &PEER_LENS, seed, cluster.as_ref(), MAX_REG);
    let engine = TransferEngine::new(engine_config(
        backend,
        "initiator",
        cluster.as_ref(),
        MAX_REG,
    ))
    .unwrap();
    Setup {
        _cluster: cluster,
        engine,
        peer,
        seed,
    }
}

fn local_regions(
    engine: &TransferEngine,
    rng: &mut StdRng,
) -> (Vec<RegisteredRegion>, Vec<Vec<u8>>) {
    let mut regions = Vec::new();
    let mut shadows = Vec::new();
    for &len in &LOCAL_LENS {
        let r = engine.allocate_and_register(len as usize).unwrap();
        let mut data = vec![0u8; len as usize];
        rng.fill(&mut data[..]);
        r.write_at(0, &data).unwrap();
        regions.push(r);
        shadows.push(data);
    }
    (regions, shadows)
}

fn overlaps(used: &[(usize, u64, u64)], which: usize, off: u64, len: u64) -> bool {
    used.iter()
        .any(|&(w, o, l)| w == which && off < o + l && o < off + len)
}

/// Random ops with disjoint ranges on each side (ops of one batch are unordered).
fn random_batch(
    rng: &mut StdRng,
    local_ids: &[u64],
    remote_ids: &[u64],
) -> Vec<(TransferOp, usize, usize)> {
    let mut ops = Vec::new();
    let (mut used_l, mut used_r) = (Vec::new(), Vec::new());
    let n = rng.random_range(1..=12);
    let mut tries = 0;
    while ops.len() < n && tries < 200 {
        tries += 1;
        let li = rng.random_range(0..local_ids.len());
        let ri = rng.random_range(0..remote_ids.len());
        let len = match rng.random_range(0..10) {
            0..=5 => rng.random_range(1..=4096u64),
            6..=8 => rng.random_range(4096..=96 << 10),
            _ => rng.random_range(96 << 10..=320 << 10),
        };
        let lo = rng.random_range(0..=LOCAL_LENS[li] - len);
        let ro = rng.random_range(0..=PEER_LENS[ri] - len);
        if overlaps(&used_l, li, lo, len) || overlaps(&used_r, ri, ro, len) {
            continue;
        }
        used_l.push((li, lo, len));
        used_r.push((ri, ro, len));
        let kind = if rng.random_bool(0.5) {
            OpKind::Write
        } else {
            OpKind::Read
        };
        let op = TransferOp {
            kind,
            local_region: local_ids[li],
            local_offset: lo,
            remote_region: remote_ids[ri],
            remote_offset: ro,
            len,
        };
        ops.push((op, li, ri));
        // Sometimes a contiguous follower, which the engine coalesces.
        if rng.random_bool(0.2)
            && lo + 2 * len <= LOCAL_LENS[li]
            && ro + 2 * len <= PEER_LENS[ri]
            && !overlaps(&used_l, li, lo + len, len)
            && !overlaps(&used_r, ri, ro + len, len)
        {
            used_l.push((li, lo + len, len));
            used_r.push((ri, ro + len, len));
            ops.push((
                TransferOp {
                    local_offset: lo + len,
                    remote_offset: ro + len,
                    ..op
                },
                li,
                ri,
            ));
        }
    }
    ops
}

async fn random_batches_land_byte_exact(backend: BackendKind) {
    let mut s = setup(backend, 11);
    let mut rng = StdRng::seed_from_u64(0xC0FFEE ^ backend as u64);
    let session = s.engine.connect(&s.peer.address()).await.unwrap();
    let remote_ids = s.peer.region_ids();
    // Descriptors were fetched and validated at connect; chunking is visible there only.
    session
        .expect_layout(&[(remote_ids[0], PEER_LENS[0]), (remote_ids[1], PEER_LENS[1])])
        .unwrap();
    assert!(session.remote_regions().iter().all(|d| d.chunks.len() > 1));
    let mut remote_shadow: Vec<Vec<u8>> = PEER_LENS
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut v = vec![0u8; len as usize];
            fill_pattern(&mut v, s.seed, i);
            v
        })
        .collect();
    let (locals, mut local_shadow) = local_regions(&s.engine, &mut rng);
    let local_ids: Vec<u64> = locals.iter().map(|r| r.id()).collect();
    let mut total_ops = 0;
    for _round in 0..25 {
        let batch = random_batch(&mut rng, &local_ids, &remote_ids);
        total_ops += batch.len();
        let ops: Vec<TransferOp> = batch.iter().map(|b| b.0).collect();
        let handle = session.submit(&ops).unwrap();
        handle.wait(STEP).await.unwrap();
        assert!(matches!(handle.status(), BatchStatus::Done));
        for (op, li, ri) in &batch {
            let (lo, ro, len) = (
                op.local_offset as usize,
                op.remote_offset as usize,
                op.len as usize,
            );
            match op.kind {
                OpKind::Write => {
                    let src = local_shadow[*li][lo..lo + len].to_vec();
                    remote_shadow[*ri][ro..ro + len].copy_from_slice(&src);
                }
                OpKind::Read => {
                    let src = remote_shadow[*ri][ro..ro + len].to_vec();
                    local_shadow[*li][lo..lo + len].copy_from_slice(&src);
                }
            }
        }
        for (r, shadow) in locals.iter().zip(&local_shadow) {
            assert!(
                r.read_at(0, shadow.len()).unwrap() == *shadow,
                "local region differs after a batch"
            );
        }
    }
    assert!(total_ops >= 25);
    // The receiver itself sees exactly the bytes written (after the notification).
    let expect = fnv1a(remote_shadow.iter().map(Vec::as_slice));
    assert_eq!(
        s.peer.check(&session).await,
        expect,
        "peer memory differs from the model"
    );
    // And reading everything back gives the same bytes.
    let scratch = s
        .engine
        .allocate_and_register(PEER_LENS[0] as usize)
        .unwrap();
    for (i, &rid) in remote_ids.iter().enumerate() {
        let h = session
            .submit(&[TransferOp::read(scratch.id(), 0, rid, 0, PEER_LENS[i])])
            .unwrap();
        h.wait(STEP).await.unwrap();
        assert!(scratch.read_at(0, PEER_LENS[i] as usize).unwrap() == remote_shadow[i]);
    }
}

async fn bad_operations_are_refused_with_typed_errors(backend: BackendKind) {
    let mut s = setup(backend, 5);
    let session = s.engine.connect(&s.peer.address()).await.unwrap();
    let rids = s.peer.region_ids();
    let local = s.engine.allocate_and_register(64 << 10).unwrap();
    let l = local.id();
    type Expect = fn(&TransportError) -> bool;
    let cases: Vec<(TransferOp, Expect)> = vec![
        (TransferOp::write(999, 0, rids[0], 0, 10), |e| {
            matches!(
                e,
                TransportError::UnknownRegion {
                    side: Side::Local,
                    id: 999
                }
            )
        }),
        (TransferOp::write(l, 0, 777, 0, 10), |e| {
            matches!(
                e,
                TransportError::UnknownRegion {
                    side: Side::Remote,
                    id: 777
                }
            )
        }),
        (TransferOp::write(l, (64 << 10) - 5, rids[0], 0, 10), |e| {
            matches!(
                e,
                TransportError::OutOfBounds {
                    side: Side::Local,
                    ..
                }
            )
        }),
        (
            TransferOp::read(l, 0, rids[1], PEER_LENS[1] - 5, 10),
            |e| matches!(e, TransportError::OutOfBounds { side: Side::Remote, region_len, .. } if *region_len == PEER_LENS[1]),
        ),
        (TransferOp::read(l, 0, rids[1], u64::MAX - 2, 10), |e| {
            matches!(
                e,
                TransportError::OutOfBounds {
                    side: Side::Remote,
                    ..
                }
            )
        }),
    ];
    for (op, check) in cases {
        let err = session.submit(&[op]).unwrap_err();
        assert!(check(&err), "{op:?} gave {err:?}");
    }
    assert!(matches!(
        session.expect_layout(&[(rids[0], 12345)]),
        Err(TransportError::LayoutMismatch(_))
    ));
    assert!(matches!(
        session.expect_layout(&[(4242, 1)]),
        Err(TransportError::LayoutMismatch(_))
    ));

    // The peer deregisters a region. With the stale view, the target itself refuses (all but
    // shm, where the initiator owns the mapping until it refreshes); after a refresh the
    // initiator refuses at submit.
    s.peer.drop_last_region(&session).await;
    if backend != BackendKind::Shm {
        let h = session
            .submit(&[TransferOp::write(l, 0, rids[1], 0, 100)])
            .unwrap();
        let err = h.wait(STEP).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::UnknownRegion {
                    side: Side::Remote,
                    ..
                }
            ),
            "{err:?}"
        );
    }
    let regions = session.refresh_regions().await.unwrap();
    assert_eq!(regions.len(), 1);
    let err = session
        .submit(&[TransferOp::write(l, 0, rids[1], 0, 100)])
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::UnknownRegion {
                side: Side::Remote,
                ..
            }
        ),
        "{err:?}"
    );
    // Refusals leave the session working.
    local.write_at(0, &[7u8; 100]).unwrap();
    session
        .submit(&[TransferOp::write(l, 0, rids[0], 0, 100)])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap();
    // A local region deregistered (dropped) is unknown afterwards.
    drop(local);
    let err = session
        .submit(&[TransferOp::write(l, 0, rids[0], 0, 100)])
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::UnknownRegion {
                side: Side::Local,
                ..
            }
        ),
        "{err:?}"
    );
}

/// Many large writes (2 GiB): the batch a stalled or killed peer interrupts.
fn long_batch(local: &RegisteredRegion, remote: u64) -> Vec<TransferOp> {
    (0..4000)
        .map(|i| TransferOp::write(local.id(), 0, remote, (i % 2) * (512 << 10), 512 << 10))
        .collect()
}

/// `wait` with a short timeout, bounded from outside: while the transfer is stalled, only the
/// timeout inside `wait` can end it, and it must do so by itself.
async fn wait_short(handle: &pdserve_transport::BatchHandle) -> TransportError {
    tokio::time::timeout(STEP, handle.wait(Duration::from_millis(20)))
        .await
        .expect("wait(20 ms) did not return by itself while the transfer was stalled")
        .unwrap_err()
}

async fn killed_peer_gives_timely_error_and_survivor_keeps_working(backend: BackendKind) {
    let mut s = setup(backend, 3);
    let session = s.engine.connect(&s.peer.address()).await.unwrap();
    let rids = s.peer.region_ids();
    let local = s.engine.allocate_and_register(1 << 20).unwrap();
    // The batch is submitted while the transfer is stalled, so it is certainly unfinished
    // when the peer dies, however fast this machine copies.
    let stall = s.peer.stall(&s.engine);
    let handle = session.submit(&long_batch(&local, rids[0])).unwrap();
    s.peer.kill();
    s.peer.unstall(stall);
    // The peer's death ends the batch (`PeerGone`), not the caller's 20 s timeout: liveness
    // detection (peer_timeout = 2 s in these tests, a reset or a dead pid sooner) noticed it.
    let err = handle.wait(Duration::from_secs(20)).await.unwrap_err();
    assert!(
        matches!(err, TransportError::PeerGone { .. }),
        "the death of the peer must end the batch as PeerGone: {err:?}"
    );
    assert!(wait_until(STEP, || !session.is_alive()).await);
    assert!(matches!(
        session.submit(&[TransferOp::write(local.id(), 0, rids[0], 0, 8)]),
        Err(TransportError::PeerGone { .. })
    ));

    // The survivor serves a new peer.
    let cluster = (backend == BackendKind::Quic).then(|| Cluster::new("survivor"));
    let engine2;
    let engine = if let Some(c) = &cluster {
        // A fresh cluster needs fresh credentials on this side too.
        engine2 =
            TransferEngine::new(engine_config(backend, "initiator", Some(c), MAX_REG)).unwrap();
        &engine2
    } else {
        &s.engine
    };
    let mut peer2 = Peer::start(backend, &PEER_LENS, 9, cluster.as_ref(), MAX_REG);
    let local2 = engine.allocate_and_register(1 << 20).unwrap();
    local2.write_at(0, &[0xAB; 4096]).unwrap();
    let session2 = engine.connect(&peer2.address()).await.unwrap();
    let r2 = peer2.region_ids();
    session2
        .submit(&[TransferOp::write(local2.id(), 0, r2[0], 8192, 4096)])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap();
    let mut expect: Vec<Vec<u8>> = PEER_LENS
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut v = vec![0u8; len as usize];
            fill_pattern(&mut v, 9, i);
            v
        })
        .collect();
    expect[0][8192..12288].fill(0xAB);
    assert_eq!(
        peer2.check(&session2).await,
        fnv1a(expect.iter().map(Vec::as_slice))
    );
    // The original engine (same one for all but quic) also still works locally.
    s.engine.allocate_and_register(4096).unwrap();
}

async fn timeouts_fire_and_the_engine_recovers(backend: BackendKind) {
    let mut s = setup(backend, 4);
    let session = s.engine.connect(&s.peer.address()).await.unwrap();
    let rids = s.peer.region_ids();
    let local = s.engine.allocate_and_register(1 << 20).unwrap();
    let stall = s.peer.stall(&s.engine);
    let handle = session.submit(&long_batch(&local, rids[0])).unwrap();
    let err = wait_short(&handle).await;
    assert!(matches!(err, TransportError::Timeout { .. }), "{err:?}");
    assert!(matches!(
        handle.status(),
        BatchStatus::Failed(TransportError::Timeout { .. })
    ));
    s.peer.unstall(stall);
    // The abandoned batch drains (its remaining pieces are skipped) and new work goes through.
    local.write_at(0, &[0x5A; 1000]).unwrap();
    let h = session
        .submit(&[TransferOp::write(local.id(), 0, rids[1], 0, 1000)])
        .unwrap();
    h.wait(Duration::from_secs(20)).await.unwrap();
    let back = s.engine.allocate_and_register(4096).unwrap();
    session
        .submit(&[TransferOp::read(back.id(), 0, rids[1], 0, 1000)])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap();
    assert_eq!(back.read_at(0, 1000).unwrap(), vec![0x5A; 1000]);
    assert!(
        matches!(
            handle.status(),
            BatchStatus::Failed(TransportError::Timeout { .. })
        ),
        "a batch given up stays failed with its timeout"
    );
}

/// A read batch given up (timeout) lands nothing more once `wait` returned, although the
/// peer answers the reads already sent afterwards: the memory may be reused at once.
async fn late_read_answers_never_land(backend: BackendKind) {
    let mut s = setup(backend, 5);
    let session = s.engine.connect(&s.peer.address()).await.unwrap();
    let rids = s.peer.region_ids();
    let local = s.engine.allocate_and_register(1 << 20).unwrap();
    let reads: Vec<TransferOp> = (0..4000u64)
        .map(|i| {
            TransferOp::read(
                local.id(),
                (i % 2) * (512 << 10),
                rids[0],
                (i % 2) * (512 << 10),
                512 << 10,
            )
        })
        .collect();
    // Stalled: the reads are queued (held copies) or sent to a stopped peer, and every answer
    // comes after `wait` gave the batch up.
    let stall = s.peer.stall(&s.engine);
    let handle = session.submit(&reads).unwrap();
    let err = wait_short(&handle).await;
    assert!(matches!(err, TransportError::Timeout { .. }), "{err:?}");
    // The owner reuses the memory right away; answers arriving from now on must not touch it.
    local.write_at(0, &vec![0xEE; 1 << 20]).unwrap();
    s.peer.unstall(stall);
    // Later reads on the same session, 64 separate pieces (not contiguous, so not
    // coalesced): spread over every data connection, each answered after the late answers
    // queued before it on that connection (held copies likewise run first in the queue).
    let back = s.engine.allocate_and_register(8192).unwrap();
    let later: Vec<TransferOp> = (0..64u64)
        .map(|i| TransferOp::read(back.id(), i * 128, rids[1], i * 128, 64))
        .collect();
    session.submit(&later).unwrap().wait(STEP).await.unwrap();
    let now = local.read_at(0, 1 << 20).unwrap();
    let changed = now.iter().filter(|&&b| b != 0xEE).count();
    assert_eq!(
        changed, 0,
        "{changed} bytes landed after the batch timed out"
    );
}

macro_rules! conformance {
    ($($(#[$attr:meta])* $backend:ident => $kind:expr),* $(,)?) => {$(
        mod $backend {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[$attr])*
            async fn random_batches_land_byte_exact() {
                super::random_batches_land_byte_exact($kind).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[$attr])*
            async fn bad_operations_are_refused_with_typed_errors() {
                super::bad_operations_are_refused_with_typed_errors($kind).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[$attr])*
            async fn killed_peer_gives_timely_error_and_survivor_keeps_working() {
                super::killed_peer_gives_timely_error_and_survivor_keeps_working($kind).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[$attr])*
            async fn timeouts_fire_and_the_engine_recovers() {
                super::timeouts_fire_and_the_engine_recovers($kind).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[$attr])*
            async fn late_read_answers_never_land() {
                super::late_read_answers_never_land($kind).await
            }
        }
    )*};
}

conformance! {
    local => BackendKind::Local,
    shm => BackendKind::Shm,
    tcp => BackendKind::Tcp,
    quic => BackendKind::Quic,
}

// The same suite on RDMA: compiled with `--features rdma`, run with `--ignored` on a machine
// where `ibv_devices` lists a device (this development machine has none).
#[cfg(feature = "rdma")]
conformance! {
    #[ignore = "needs an RDMA device: run with --features rdma -- --ignored where ibv_devices lists one"]
    rdma => BackendKind::Rdma,
}

#[test]
fn shm_refuses_memory_a_peer_cannot_map() {
    let engine = TransferEngine::new(engine_config(BackendKind::Shm, "x", None, None)).unwrap();
    let anon = pdserve_runtime::memory::HostMemoryAllocator::allocate(
        &pdserve_runtime::memory::AnonAllocator,
        4096,
    )
    .unwrap();
    assert!(matches!(
        engine.register(anon),
        Err(TransportError::NotShareable(_))
    ));
    let shm = engine.allocator().allocate(4096).unwrap();
    let r = engine.register(shm).unwrap();
    assert!(r.descriptor().shm.is_some());
    let id = r.id();
    drop(r);
    assert!(
        engine.local_regions().iter().all(|d| d.id != id),
        "drop deregisters"
    );
}

#[test]
fn rdma_is_refused_clearly_without_a_device() {
    if BackendKind::Rdma.is_available() {
        return; // covered by the rdma suite where a device exists
    }
    let err = TransferEngine::new(engine_config(BackendKind::Rdma, "r", None, None)).unwrap_err();
    assert_eq!(err.kind(), "unsupported");
}
