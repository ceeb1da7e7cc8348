//! Control plane: typed round trips over mutual-TLS QUIC, rejection of bad frames, refusal of
//! strangers, reconnects and heartbeats.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{wait_until, Cluster};
use pdserve_runtime::wire::{
    encode_frame, ControlMessage, Envelope, EnvelopeKind, ErrorMessage, Heartbeat, Hello,
    LoadFigures, RegionChunk, RegionDescriptor, Role, ShmHandle,
};
use pdserve_transport::control::tls::{
    provider, ClusterCredentials, ALPN_CONTROL, MEMBER_SERVER_NAME,
};
use pdserve_transport::control::{Backoff, ControlClient, ControlConfig, ControlEndpoint};
use pdserve_transport::TransportError;
use tokio::sync::mpsc;

fn config(role: Role) -> ControlConfig {
    ControlConfig {
        role,
        request_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(3),
        ..ControlConfig::default()
    }
}

/// Answers every request with the same message; forwards one-way messages to the channel.
fn spawn_echo(ep: Arc<ControlEndpoint>) -> mpsc::Receiver<ControlMessage> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(conn) = ep.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Some(inc) = conn.recv().await {
                    match inc.responder {
                        Some(r) => {
                            let _ = r.respond(inc.message).await;
                        }
                        None => {
                            let _ = tx.send(inc.message).await;
                        }
                    }
                }
            });
        }
    });
    rx
}

fn every_message() -> Vec<ControlMessage> {
    vec![
        ControlMessage::Hello(Hello {
            cluster: "c".into(),
            node: "n".into(),
            role: Role::Decode,
            version: "9".into(),
        }),
        ControlMessage::Heartbeat(Heartbeat {
            node: "n".into(),
            seq: 3,
            load: LoadFigures {
                running: 1,
                waiting: 2,
                free_blocks: 30,
                total_blocks: 40,
            },
        }),
        ControlMessage::GetRegisteredMemory,
        ControlMessage::RegisteredMemory {
            regions: vec![RegionDescriptor {
                id: 4,
                len: 1 << 20,
                chunks: vec![RegionChunk {
                    offset: 0,
                    len: 1 << 20,
                    addr: 1,
                    rkey: 2,
                }],
                shm: Some(ShmHandle {
                    socket: "pdserve-shm-10-0000000000000011".into(),
                    key: 12,
                    ticket: [1; 16],
                }),
            }],
        },
        ControlMessage::Notify {
            bytes: b"kv ready".to_vec(),
        },
        ControlMessage::Ping { nonce: 77 },
        ControlMessage::Pong { nonce: 78 },
        ControlMessage::Opaque {
            topic: "pd.handshake".into(),
            body: vec![9; 5000],
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_type_round_trips_and_errors_are_typed() {
    let cluster = Cluster::new("ctl");
    let server =
        Arc::new(ControlEndpoint::bind(&cluster.member("peer"), config(Role::Prefill)).unwrap());
    let mut one_way = spawn_echo(server.clone());
    let client = ControlEndpoint::bind(&cluster.member("initiator"), config(Role::Decode)).unwrap();
    let conn = client.connect(server.local_addr().unwrap()).await.unwrap();
    assert_eq!(conn.peer().node, "peer");
    assert_eq!(conn.peer().role, Role::Prefill);
    assert_eq!(conn.peer().cluster, "ctl");
    for m in every_message() {
        let back = conn.request(m.clone()).await.unwrap();
        match &m {
            // Pings are answered by the connection itself.
            ControlMessage::Ping { nonce } => {
                assert_eq!(back, ControlMessage::Pong { nonce: *nonce })
            }
            _ => assert_eq!(back, m),
        }
        conn.send(m.clone()).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), one_way.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, m);
    }
    // An Error answer becomes a typed error.
    let err = conn
        .request(ControlMessage::Error(ErrorMessage {
            kind: "busy".into(),
            message: "later".into(),
        }))
        .await
        .unwrap_err();
    assert!(
        matches!(err, TransportError::Remote { ref kind, .. } if kind == "busy"),
        "{err:?}"
    );
    assert!(conn.ping().await.unwrap() < Duration::from_secs(5));
}

async fn raw_request(conn: &quinn::Connection, bytes: &[u8]) -> ControlMessage {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(bytes).await.unwrap();
    send.finish().unwrap();
    let answer = recv.read_to_end(1 << 20).await.unwrap();
    pdserve_runtime::wire::decode_frame(&answer, 1 << 20)
        .unwrap()
        .0
        .message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_truncated_and_oversized_frames_are_rejected_and_the_connection_survives() {
    let cluster = Cluster::new("ctl");
    let mut cfg = config(Role::Prefill);
    cfg.max_frame_bytes = 64 << 10;
    let server = Arc::new(ControlEndpoint::bind(&cluster.member("peer"), cfg).unwrap());
    let _rx = spawn_echo(server.clone());
    let client = ControlEndpoint::bind(&cluster.member("initiator"), config(Role::Decode)).unwrap();
    let conn = client.connect(server.local_addr().unwrap()).await.unwrap();
    let q = conn.quic_connection();

    let kind_of = |m: ControlMessage| match m {
        ControlMessage::Error(e) => e.kind,
        other => panic!("expected an error, got {other:?}"),
    };
    // Garbage payload with a correct length prefix.
    let mut garbage = 40u32.to_le_bytes().to_vec();
    garbage.extend([0xA5; 40]);
    assert_eq!(kind_of(raw_request(q, &garbage).await), "malformed_frame");
    // A valid frame cut short.
    let good = encode_frame(
        &Envelope {
            id: 1,
            kind: EnvelopeKind::Request,
            message: ControlMessage::Notify {
                bytes: vec![1; 100],
            },
        },
        1 << 20,
    )
    .unwrap();
    assert_eq!(
        kind_of(raw_request(q, &good[..good.len() - 7]).await),
        "truncated_frame"
    );
    assert_eq!(kind_of(raw_request(q, &good[..2]).await), "truncated_frame");
    // A valid payload with bytes flipped inside.
    let mut flipped = good.clone();
    for i in (8..flipped.len()).step_by(5) {
        flipped[i] ^= 0xFF;
    }
    let answer = raw_request(q, &flipped).await;
    assert!(
        matches!(
            answer,
            ControlMessage::Error(_) | ControlMessage::Notify { .. }
        ),
        "{answer:?}"
    );
    // A header announcing more than the maximum.
    let mut huge = (1u32 << 30).to_le_bytes().to_vec();
    huge.extend([0; 16]);
    assert_eq!(kind_of(raw_request(q, &huge).await), "frame_too_large");
    // A response where a request belongs.
    let resp = encode_frame(
        &Envelope {
            id: 1,
            kind: EnvelopeKind::Response,
            message: ControlMessage::GetRegisteredMemory,
        },
        1 << 20,
    )
    .unwrap();
    assert_eq!(kind_of(raw_request(q, &resp).await), "protocol");
    // The connection still works.
    conn.ping().await.unwrap();
    assert_eq!(
        conn.request(ControlMessage::GetRegisteredMemory)
            .await
            .unwrap(),
        ControlMessage::GetRegisteredMemory
    );
    // Oversized messages are refused before sending, too.
    let err = client_big(&conn).await;
    assert_eq!(err.kind(), "remote", "{err:?}");
}

async fn client_big(conn: &pdserve_transport::control::ControlConnection) -> TransportError {
    // The client allows 16 MiB; the server only 64 KiB, so the server answers frame_too_large.
    conn.request(ControlMessage::Opaque {
        topic: "big".into(),
        body: vec![0; 100 << 10],
    })
    .await
    .unwrap_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_cluster_certificate_is_refused() {
    let cluster = Cluster::new("ctl");
    let server =
        Arc::new(ControlEndpoint::bind(&cluster.member("peer"), config(Role::Prefill)).unwrap());
    let addr = server.local_addr().unwrap();
    // A client that trusts the cluster CA but presents no certificate.
    let mut roots = rustls::RootCertStore::empty();
    {
        use rustls_pki_types::pem::PemObject;
        let ca = rustls_pki_types::CertificateDer::from_pem_slice(
            cluster.member("peer").ca_cert_pem().as_bytes(),
        )
        .unwrap();
        roots.add(ca).unwrap();
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN_CONTROL.to_vec()];
    let qcfg = quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap(),
    ));
    let mut stranger = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    stranger.set_default_client_config(qcfg);
    let outcome = async {
        let conn = stranger.connect(addr, MEMBER_SERVER_NAME).unwrap().await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(
            &encode_frame(
                &Envelope {
                    id: 1,
                    kind: EnvelopeKind::Request,
                    message: ControlMessage::Ping { nonce: 1 },
                },
                1 << 20,
            )
            .unwrap(),
        )
        .await?;
        let _ = send.finish();
        let answer = recv.read_to_end(1 << 20).await?;
        Ok::<_, Box<dyn std::error::Error>>(answer)
    };
    let res = tokio::time::timeout(Duration::from_secs(10), outcome)
        .await
        .expect("refusal must not hang");
    assert!(res.is_err(), "a stranger got an answer: {res:?}");
    assert!(wait_until(Duration::from_secs(5), || server.refused_connections() >= 1).await);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), server.accept())
            .await
            .is_err(),
        "stranger reached accept()"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_of_another_cluster_is_refused_both_ways() {
    let ours = Cluster::new("ours");
    let server =
        Arc::new(ControlEndpoint::bind(&ours.member("peer"), config(Role::Prefill)).unwrap());
    // Same cluster *name*, different CA: still a stranger.
    let theirs = ClusterCredentials::ephemeral("ours")
        .unwrap()
        .issue("intruder")
        .unwrap();
    let intruder = Arc::new(ControlEndpoint::bind(&theirs, config(Role::Decode)).unwrap());
    let err = intruder
        .connect(server.local_addr().unwrap())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Unauthenticated(_) | TransportError::PeerGone { .. }
        ),
        "{err:?}"
    );
    assert!(wait_until(Duration::from_secs(5), || server.refused_connections() >= 1).await);
    // And our member does not accept their server either.
    let member = ControlEndpoint::bind(&ours.member("initiator"), config(Role::Decode)).unwrap();
    let err = member
        .connect(intruder.local_addr().unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, TransportError::Unauthenticated(_)), "{err:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), server.accept())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_reconnects_with_backoff_and_sends_heartbeats() {
    let cluster = Cluster::new("ctl");
    let server =
        Arc::new(ControlEndpoint::bind(&cluster.member("peer"), config(Role::Proxy)).unwrap());
    let addr = server.local_addr().unwrap();
    let (hb_tx, mut hb_rx) = mpsc::channel(64);
    let srv = server.clone();
    let accept_task = tokio::spawn(async move {
        while let Some(conn) = srv.accept().await {
            let hb_tx = hb_tx.clone();
            tokio::spawn(async move {
                while let Some(inc) = conn.recv().await {
                    if let ControlMessage::Heartbeat(hb) = &inc.message {
                        let _ = hb_tx.send(hb.clone()).await;
                    }
                    if let Some(r) = inc.responder {
                        let _ = r.respond(inc.message).await;
                    }
                }
            });
        }
    });
    let endpoint = Arc::new(
        ControlEndpoint::bind(&cluster.member("initiator"), config(Role::Decode)).unwrap(),
    );
    let backoff = Backoff {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
        max_attempts: 30,
    };
    let client = Arc::new(ControlClient::new(endpoint, addr, backoff));
    let cancel = tokio_util::sync::CancellationToken::new();
    let load = || LoadFigures {
        running: 2,
        waiting: 1,
        free_blocks: 10,
        total_blocks: 20,
    };
    let hb_task = client
        .clone()
        .spawn_heartbeats(Duration::from_millis(30), load, cancel.clone());
    let mut seqs = Vec::new();
    while seqs.len() < 3 {
        let hb = tokio::time::timeout(Duration::from_secs(5), hb_rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(hb.node, "initiator");
        assert_eq!(hb.load, load());
        seqs.push(hb.seq);
    }
    // Each heartbeat travels on its own stream, so they may arrive in any order (they did,
    // on a loaded machine: [1, 5, 2]); each carries its own number, counted from 1.
    let mut sorted = seqs.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(
        sorted.len(),
        seqs.len(),
        "a heartbeat number repeated: {seqs:?}"
    );
    assert!(sorted[0] >= 1, "{seqs:?}");
    assert_eq!(
        client
            .request(ControlMessage::GetRegisteredMemory)
            .await
            .unwrap(),
        ControlMessage::GetRegisteredMemory
    );
    assert_eq!(client.connects(), 1);

    // The server goes away and comes back on the same port. The live connection is taken
    // before the close: taken after, it may already be seen dead (the close frame is fast),
    // and `connection()` would then be reconnecting to a port nobody serves yet.
    let conn = client.connection().await.unwrap();
    accept_task.abort();
    server.close();
    drop(server);
    assert!(
        wait_until(Duration::from_secs(10), || !conn.is_alive()).await,
        "close not noticed"
    );
    // The old socket closes once its connections have drained; rebind as soon as it has.
    let mut server2 = None;
    assert!(
        wait_until(Duration::from_secs(10), || {
            server2 = ControlEndpoint::bind(
                &cluster.member("peer"),
                ControlConfig {
                    listen: addr,
                    ..config(Role::Proxy)
                },
            )
            .ok();
            server2.is_some()
        })
        .await,
        "port never freed"
    );
    let server2 = Arc::new(server2.unwrap());
    let _rx = spawn_echo(server2.clone());
    let back = client
        .request(ControlMessage::Ping { nonce: 5 })
        .await
        .unwrap();
    assert_eq!(back, ControlMessage::Pong { nonce: 5 });
    assert!(client.connects() >= 2, "reconnected");
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), hb_task)
        .await
        .unwrap()
        .unwrap();
}

/// A member that declares full-size frames on several streams and never sends them holds at
/// most `ASSEMBLY_BUDGET_BYTES` of its connection's assembly: its further frames wait (they
/// are not read, so nothing is allocated for them), other members' connections are served
/// meanwhile, and the waiting frame is served once a held one goes away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_in_assembly_are_bounded_per_connection() {
    use pdserve_transport::control::ASSEMBLY_BUDGET_BYTES;
    let cluster = Cluster::new("ctl");
    let server =
        Arc::new(ControlEndpoint::bind(&cluster.member("peer"), config(Role::Prefill)).unwrap());
    let _rx = spawn_echo(server.clone());
    let addr = server.local_addr().unwrap();
    let hog = ControlEndpoint::bind(&cluster.member("initiator"), config(Role::Decode)).unwrap();
    let conn = hog.connect(addr).await.unwrap();
    let q = conn.quic_connection().clone();
    // Full-size frames (16 MiB declared, one byte sent) until the budget is taken.
    let frame = 16usize << 20;
    let mut hogs = Vec::new();
    for _ in 0..ASSEMBLY_BUDGET_BYTES / frame {
        let (mut send, recv) = q.open_bi().await.unwrap();
        send.write_all(&(frame as u32).to_le_bytes()).await.unwrap();
        send.write_all(&[0]).await.unwrap();
        hogs.push((send, recv));
    }
    let echo = ControlMessage::Notify { bytes: vec![7; 10] };
    // Another member is served at once.
    pdserve_transport::control::tls::issue_member(&cluster.path(), "other").unwrap();
    let other = ControlEndpoint::bind(&cluster.member("other"), config(Role::Decode)).unwrap();
    let other = other.connect(addr).await.unwrap();
    assert_eq!(other.request(echo.clone()).await.unwrap(), echo);
    // The hog's next frame waits for room...
    let waiting = {
        let q = q.clone();
        let bytes = encode_frame(
            &Envelope {
                id: 99,
                kind: EnvelopeKind::Request,
                message: echo.clone(),
            },
            1 << 20,
        )
        .unwrap();
        tokio::spawn(async move { raw_request(&q, &bytes).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a frame past the budget was read");
    // ...and is served once a held frame's stream is reset.
    let (mut send, _recv) = hogs.pop().unwrap();
    send.reset(quinn::VarInt::from_u32(0)).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the waiting frame was never served")
        .unwrap();
    assert_eq!(answer, echo);
}
