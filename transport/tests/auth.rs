//! Authenticated transfer sessions on the backends whose connections can be authenticated
//! (`tcp`, `shm`, `quic`): a client without the session key, or with a wrong one, gets nothing
//! and changes nothing; operations outside the grant are refused; a key is spent once its
//! session ended; a fenced scope's late writes never land. The target runs in this process
//! (so the test can look at its memory before and after), the initiator talks to it over real
//! loopback sockets.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{engine_config, wait_until, Cluster, STEP};
use pdserve_transport::peer::{fill_pattern, PEER_NODE};
use pdserve_transport::{
    Access, BackendKind, BatchStatus, RegionGrant, RegisteredRegion, SessionCredentials,
    SessionGrant, SessionGrantGuard, SessionKey, TransferEngine, TransferOp, TransportError,
};

const LEN: usize = 1 << 20;

struct Target {
    _cluster: Option<Cluster>,
    engine: TransferEngine,
    regions: Vec<RegisteredRegion>,
    initiator: TransferEngine,
}

impl Target {
    fn new(backend: BackendKind) -> Self {
        let cluster = (backend == BackendKind::Quic).then(|| Cluster::new("auth"));
        let mut cfg = engine_config(backend, PEER_NODE, cluster.as_ref(), None);
        cfg.require_auth = true;
        let engine = TransferEngine::new(cfg).unwrap();
        let regions: Vec<_> = (0..2)
            .map(|i| {
                let r = engine.allocate_and_register(LEN).unwrap();
                let mut buf = vec![0u8; LEN];
                fill_pattern(&mut buf, 77, i);
                r.write_at(0, &buf).unwrap();
                r
            })
            .collect();
        let initiator =
            TransferEngine::new(engine_config(backend, "initiator", cluster.as_ref(), None))
                .unwrap();
        Self {
            _cluster: cluster,
            engine,
            regions,
            initiator,
        }
    }

    fn snapshot(&self) -> Vec<Vec<u8>> {
        self.regions
            .iter()
            .map(|r| r.read_at(0, LEN).unwrap())
            .collect()
    }

    fn grant(&self, regions: Vec<RegionGrant>) -> (SessionKey, SessionGrantGuard) {
        let key = SessionKey::generate().unwrap();
        let guard = self
            .engine
            .grant_session(SessionGrant {
                key: key.clone(),
                peer: "initiator".into(),
                regions,
            })
            .unwrap();
        (key, guard)
    }

    fn local(&self, byte: u8) -> RegisteredRegion {
        let r = self.initiator.allocate_and_register(LEN).unwrap();
        r.write_at(0, &vec![byte; LEN]).unwrap();
        r
    }
}

fn assert_unauthenticated<T: std::fmt::Debug>(r: Result<T, TransportError>, what: &str) {
    match r {
        Err(TransportError::Unauthenticated(_)) => {}
        other => panic!("{what}: expected Unauthenticated, got {other:?}"),
    }
}

/// Speaks the wire protocol by hand, without proving a key: HELLO, then `op` on `region`.
/// Returns the answer's status byte and how many payload bytes came back (0 if closed).
fn raw_request(addr: &str, backend: &str, op: u8, region: u64, payload: &[u8]) -> (u8, usize) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(STEP)).unwrap();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let hello = format!("{backend}\nmallory\n{}", boot.trim());
    let header = |op: u8, region: u64, len: u64| {
        let mut h = [0u8; 48];
        h[0] = op;
        h[8..16].copy_from_slice(&1u64.to_le_bytes());
        h[16..24].copy_from_slice(&region.to_le_bytes());
        h[32..40].copy_from_slice(&len.to_le_bytes());
        h
    };
    s.write_all(&header(1, 0, hello.len() as u64)).unwrap();
    s.write_all(hello.as_bytes()).unwrap();
    let mut ans = [0u8; 32];
    s.read_exact(&mut ans).unwrap();
    assert_eq!(ans[0], 0, "HELLO is answered");
    let nonce_len = u64::from_le_bytes(ans[24..32].try_into().unwrap()) as usize;
    let mut nonce = vec![0u8; nonce_len];
    s.read_exact(&mut nonce).unwrap();
    let len = if op == 4 { 4096 } else { payload.len() as u64 };
    s.write_all(&header(op, region, len)).unwrap();
    let _ = s.write_all(payload);
    s.read_exact(&mut ans).unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    (ans[0], rest.len())
}

async fn unauthenticated_and_wrong_key_clients_get_nothing_and_change_nothing(
    backend: BackendKind,
) {
    let t = Target::new(backend);
    let mut notes = t.engine.take_notifications().unwrap();
    let (key, _guard) = t.grant(vec![RegionGrant::whole(
        t.regions[0].id(),
        Access::ReadWrite,
    )]);
    let before = t.snapshot();
    let addr = t.engine.address();

    // No key at all.
    assert_unauthenticated(t.initiator.connect(&addr).await, "no key");
    // A key the target never granted.
    let wrong = SessionCredentials {
        key: SessionKey::generate().unwrap(),
    };
    assert_unauthenticated(t.initiator.connect_with(&addr, wrong).await, "wrong key");
    // The right key id with other key bytes cannot forge a proof either: the id is derived
    // from the key, so a different key names a different (unknown) grant.
    // By hand, skipping the key proof: writes, reads, notifications and descriptors refused.
    if backend != BackendKind::Quic {
        let rid = t.regions[0].id();
        for (op, payload) in [
            (3u8, vec![0xAA; 4096]),
            (4, vec![]),
            (5, b"CHECK".to_vec()),
            (2, vec![]),
        ] {
            let (status, bytes) = raw_request(&addr, backend.as_str(), op, rid, &payload);
            assert_eq!(status, 6, "op {op}: answered unauthenticated");
            assert!(
                bytes < 256,
                "op {op}: {bytes} bytes came back (only the refusal text)"
            );
        }
    }
    assert!(t.engine.refused_sessions() >= 2);
    assert_eq!(
        t.snapshot(),
        before,
        "an unauthenticated client changed target memory"
    );
    assert!(
        notes.try_recv().is_err(),
        "an unauthenticated notification was delivered"
    );

    // The granted key works, and its writes are visible: the check above could see a change.
    let session = t
        .initiator
        .connect_with(&addr, SessionCredentials { key })
        .await
        .unwrap();
    let local = t.local(0x11);
    session
        .submit(&[TransferOp::write(local.id(), 0, t.regions[0].id(), 0, 4096)])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap();
    assert_eq!(t.regions[0].read_at(0, 4096).unwrap(), vec![0x11; 4096]);
}

async fn operations_outside_the_grant_are_refused(backend: BackendKind) {
    let t = Target::new(backend);
    let (r0, r1) = (t.regions[0].id(), t.regions[1].id());
    let (key, _guard) = t.grant(vec![
        RegionGrant::range(r0, 65536, 65536, Access::Write),
        RegionGrant::range(r0, 0, 4096, Access::Read),
    ]);
    let session = t
        .initiator
        .connect_with(&t.engine.address(), SessionCredentials { key })
        .await
        .unwrap();
    // Only the granted region is visible.
    let visible: Vec<u64> = session.remote_regions().iter().map(|d| d.id).collect();
    assert_eq!(visible, vec![r0]);
    let local = t.local(0x22);
    let before = t.snapshot();
    let refused = [
        TransferOp::write(local.id(), 0, r0, 65536 - 1, 100), // starts before the range
        TransferOp::write(local.id(), 0, r0, 65536 + 65000, 1000), // runs past it
        TransferOp::write(local.id(), 0, r0, 0, 100),         // read-only bytes
        TransferOp::read(local.id(), 0, r0, 65536, 100),      // write-only bytes
    ];
    for op in refused {
        let err = match session.submit(&[op]) {
            Err(e) => e, // shm: the initiator's engine checks the grant it was told
            Ok(h) => h.wait(STEP).await.unwrap_err(),
        };
        assert!(
            matches!(err, TransportError::NotGranted { .. }),
            "{op:?} gave {err:?}"
        );
    }
    // A region outside the grant is not even known to the session.
    let err = session
        .submit(&[TransferOp::write(local.id(), 0, r1, 0, 100)])
        .unwrap_err();
    assert!(
        matches!(err, TransportError::UnknownRegion { .. }),
        "{err:?}"
    );
    assert_eq!(
        t.snapshot(),
        before,
        "a refused operation changed target memory"
    );
    // Inside the grant works, both ways.
    session
        .submit(&[
            TransferOp::write(local.id(), 0, r0, 65536, 65536),
            TransferOp::read(local.id(), 65536, r0, 0, 4096),
        ])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap();
    assert_eq!(
        t.regions[0].read_at(65536, 65536).unwrap(),
        vec![0x22; 65536]
    );
    assert_eq!(
        local.read_at(65536, 4096).unwrap(),
        before[0][..4096].to_vec()
    );
}

async fn a_key_is_refused_after_its_session_ended(backend: BackendKind) {
    let t = Target::new(backend);
    let (key, guard) = t.grant(vec![RegionGrant::whole(t.regions[0].id(), Access::Read)]);
    let addr = t.engine.address();
    let session = t
        .initiator
        .connect_with(&addr, SessionCredentials { key: key.clone() })
        .await
        .unwrap();
    assert!(guard.live_connections() >= 1);
    assert!(!guard.has_ended());
    session.close();
    drop(session);
    assert!(
        wait_until(STEP, || guard.has_ended()).await,
        "the target never saw the session end"
    );
    assert_unauthenticated(
        t.initiator
            .connect_with(&addr, SessionCredentials { key: key.clone() })
            .await,
        "replayed key",
    );
    // A revoked grant's key is refused as well (a fresh key, never used, then revoked).
    let (key2, guard2) = t.grant(vec![RegionGrant::whole(t.regions[0].id(), Access::Read)]);
    drop(guard2);
    assert_unauthenticated(
        t.initiator
            .connect_with(&addr, SessionCredentials { key: key2 })
            .await,
        "revoked key",
    );
}

/// A write batch of a scope the target fenced never lands after `fence` returned, although
/// the initiator keeps sending it: the target may reuse the blocks at once.
async fn late_writes_of_a_fenced_scope_never_land(backend: BackendKind) {
    let t = Target::new(backend);
    let (key, guard) = t.grant(vec![]);
    let rid = t.regions[0].id();
    let scope = guard
        .allow(7, &[RegionGrant::whole(rid, Access::Write)])
        .unwrap();
    let session = t
        .initiator
        .connect_with(&t.engine.address(), SessionCredentials { key })
        .await
        .unwrap();
    let local = t.local(0x33);
    let writes: Vec<TransferOp> = (0..4000u64)
        .map(|i| TransferOp::write(local.id(), 0, rid, (i % 2) * (512 << 10), 512 << 10))
        .collect();
    let handle = session.submit_fenced(scope.id(), &writes).unwrap();
    assert!(
        wait_until(STEP, || !matches!(
            handle.status(),
            BatchStatus::Pending { completed: 0, .. }
        ))
        .await,
        "batch never started"
    );
    // The target gives the hand-off up (a timeout, a cancel) and reuses the blocks at once.
    assert!(guard.fence(scope.id()));
    t.regions[0].write_at(0, &vec![0xEE; LEN]).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let now = t.regions[0].read_at(0, LEN).unwrap();
    let changed = now.iter().filter(|&&b| b != 0xEE).count();
    assert_eq!(
        changed, 0,
        "{changed} bytes landed after the scope was fenced"
    );
    let err = handle.wait(STEP).await.unwrap_err();
    assert!(
        matches!(err, TransportError::Fenced { fence: 7 }),
        "{err:?}"
    );
    drop(scope);
    // The session serves the next scope.
    let next = guard
        .allow(8, &[RegionGrant::range(rid, 0, 4096, Access::Write)])
        .unwrap();
    session
        .submit_fenced(next.id(), &[TransferOp::write(local.id(), 0, rid, 0, 4096)])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap();
    assert_eq!(t.regions[0].read_at(0, 4096).unwrap(), vec![0x33; 4096]);
    // And the fenced scope stays refused.
    let err = session
        .submit_fenced(7, &[TransferOp::write(local.id(), 0, rid, 0, 4096)])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::Fenced { fence: 7 }),
        "{err:?}"
    );
}

macro_rules! auth_suite {
    ($($backend:ident => $kind:expr),* $(,)?) => {$(
        mod $backend {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn unauthenticated_and_wrong_key_clients_get_nothing_and_change_nothing() {
                super::unauthenticated_and_wrong_key_clients_get_nothing_and_change_nothing($kind).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn operations_outside_the_grant_are_refused() {
                super::operations_outside_the_grant_are_refused($kind).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_key_is_refused_after_its_session_ended() {
                super::a_key_is_refused_after_its_session_ended($kind).await
            }
        }
    )*};
}

auth_suite! {
    tcp => BackendKind::Tcp,
    shm => BackendKind::Shm,
    quic => BackendKind::Quic,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_late_writes_of_a_fenced_scope_never_land() {
    late_writes_of_a_fenced_scope_never_land(BackendKind::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_late_writes_of_a_fenced_scope_never_land() {
    late_writes_of_a_fenced_scope_never_land(BackendKind::Quic).await
}

#[test]
fn local_engines_refuse_session_keys() {
    let a = TransferEngine::new(engine_config(BackendKind::Local, "a", None, None)).unwrap();
    let b = TransferEngine::new(engine_config(BackendKind::Local, "b", None, None)).unwrap();
    let err = a
        .connect_blocking(&b.address())
        .and(Err::<(), _>(TransportError::Cancelled))
        .unwrap_err();
    assert_eq!(err.kind(), "cancelled", "plain local connect works");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt
        .block_on(a.connect_with(
            &b.address(),
            SessionCredentials {
                key: SessionKey::generate().unwrap(),
            },
        ))
        .unwrap_err();
    assert_eq!(err.kind(), "unsupported");
}

/// A relay between initiator and target that flips one bit of every client-to-server stream
/// at byte `at` (an on-path attacker).
fn tampering_relay(target: String, at: usize) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for client in listener.incoming().take(64) {
            let Ok(client) = client else { return };
            let Ok(server) = std::net::TcpStream::connect(&target) else {
                return;
            };
            let (mut c_read, mut s_write) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (mut s_read, mut c_write) = (server, client);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                let mut seen = 0usize;
                while let Ok(n) = c_read.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if (seen..seen + n).contains(&at) {
                        buf[at - seen] ^= 0x10;
                    }
                    seen += n;
                    if s_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s_write.shutdown(std::net::Shutdown::Both);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s_read, &mut c_write);
                let _ = c_write.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    addr
}

fn tcp_target_with(integrity: pdserve_transport::TcpIntegrity) -> Target {
    let mut t = Target::new(BackendKind::Tcp);
    let mut cfg = engine_config(BackendKind::Tcp, PEER_NODE, None, None);
    cfg.require_auth = true;
    cfg.tcp_integrity = integrity;
    t.engine = TransferEngine::new(cfg).unwrap();
    t.regions = (0..2)
        .map(|_| t.engine.allocate_and_register(LEN).unwrap())
        .collect();
    let mut icfg = engine_config(BackendKind::Tcp, "initiator", None, None);
    icfg.tcp_integrity = integrity;
    t.initiator = TransferEngine::new(icfg).unwrap();
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_integrity_modes_move_bytes_exactly_and_catch_tampering() {
    use pdserve_transport::TcpIntegrity;
    for mode in [TcpIntegrity::Mac, TcpIntegrity::Encrypt] {
        let t = tcp_target_with(mode);
        let rid = t.regions[0].id();
        let (key, _guard) = t.grant(vec![RegionGrant::whole(rid, Access::ReadWrite)]);
        let session = t
            .initiator
            .connect_with(&t.engine.address(), SessionCredentials { key })
            .await
            .unwrap();
        let local = t.local(0);
        let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
        local.write_at(0, &data).unwrap();
        // Writes of several pieces and sizes, then read everything back into the other half.
        session
            .submit(&[
                TransferOp::write(local.id(), 0, rid, 0, 300_000),
                TransferOp::write(local.id(), 300_000, rid, 300_000, (LEN - 300_000) as u64),
            ])
            .unwrap()
            .wait(STEP)
            .await
            .unwrap();
        assert!(
            t.regions[0].read_at(0, LEN).unwrap() == data,
            "{mode:?}: writes"
        );
        let back = t.local(0);
        session
            .submit(&[TransferOp::read(back.id(), 0, rid, 0, LEN as u64)])
            .unwrap()
            .wait(STEP)
            .await
            .unwrap();
        assert!(back.read_at(0, LEN).unwrap() == data, "{mode:?}: reads");
        // Notifications and descriptor refreshes travel protected too.
        session.refresh_regions().await.unwrap();
        session.notify(b"hello").await.unwrap();

        // An on-path flip of one payload bit fails the transfer instead of landing silently.
        let (key, _g) = t.grant(vec![RegionGrant::whole(
            t.regions[1].id(),
            Access::ReadWrite,
        )]);
        let relay = tampering_relay(t.engine.address(), 200_000);
        let s2 = t
            .initiator
            .connect_with(&relay, SessionCredentials { key })
            .await
            .unwrap();
        let res = s2
            .submit(&[TransferOp::write(
                local.id(),
                0,
                t.regions[1].id(),
                0,
                LEN as u64,
            )])
            .unwrap()
            .wait(STEP)
            .await;
        assert!(res.is_err(), "{mode:?}: a tampered write was acknowledged");
    }
    // Without protection the same tampering goes unnoticed (what the modes are for).
    let t = tcp_target_with(pdserve_transport::TcpIntegrity::None);
    let rid = t.regions[1].id();
    let (key, _g) = t.grant(vec![RegionGrant::whole(rid, Access::ReadWrite)]);
    let relay = tampering_relay(t.engine.address(), 200_000);
    let s = t
        .initiator
        .connect_with(&relay, SessionCredentials { key })
        .await
        .unwrap();
    let local = t.local(0x44);
    s.submit(&[TransferOp::write(local.id(), 0, rid, 0, LEN as u64)])
        .unwrap()
        .wait(STEP)
        .await
        .unwrap();
    let landed = t.regions[1].read_at(0, LEN).unwrap();
    assert_eq!(
        landed.iter().filter(|&&b| b != 0x44).count(),
        1,
        "the relay flipped one bit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_requiring_encryption_refuses_weaker_sessions() {
    let t = tcp_target_with(pdserve_transport::TcpIntegrity::Encrypt);
    let mut icfg = engine_config(BackendKind::Tcp, "initiator", None, None);
    icfg.tcp_integrity = pdserve_transport::TcpIntegrity::Mac;
    let weak = TransferEngine::new(icfg).unwrap();
    let (key, _g) = t.grant(vec![RegionGrant::whole(t.regions[0].id(), Access::Read)]);
    assert_unauthenticated(
        weak.connect_with(&t.engine.address(), SessionCredentials { key })
            .await,
        "mac against encrypt",
    );
}

/// A stranger that opens a transfer connection and never greets (no HELLO), or greets and
/// never proves a key where keys are required, is disconnected once `peer_timeout` passed:
/// it cannot hold a connection and its task open by saying nothing.
#[test]
fn a_silent_connection_is_closed_after_peer_timeout() {
    for (require_auth, greet) in [(false, false), (true, false), (true, true)] {
        let mut cfg = engine_config(BackendKind::Tcp, PEER_NODE, None, None);
        cfg.peer_timeout = Duration::from_millis(500);
        cfg.require_auth = require_auth;
        let target = TransferEngine::new(cfg).unwrap();
        let addr = target.address();
        let addr = addr.strip_prefix("tcp://").unwrap_or(&addr);
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        if greet {
            // A HELLO as the engine's own client sends it, then nothing.
            let hello = pdserve_transport::peer::hello_frame(BackendKind::Tcp, "stranger");
            sock.write_all(&hello).unwrap();
        }
        // Liveness bound (60x the timeout): the target must close it by itself.
        sock.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut buf = [0u8; 4096];
        let closed = loop {
            match sock.read(&mut buf) {
                Ok(0) => break true,
                Ok(_) => continue, // the answer to HELLO
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
                Err(e) => panic!("require_auth {require_auth}, greet {greet}: {e}"),
            }
        };
        assert!(closed);
    }
}
