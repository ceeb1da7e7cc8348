//! The transfer engine built from the serving config: every `transfer.*` engine key reaches
//! the engine, and an engine listening on `0.0.0.0` publishes a reachable address.

use pdserve_runtime::config::{ServeConfig, ServeFlags};
use pdserve_transport::{BackendKind, TcpIntegrity, TransferConfig, TransferEngine, TransferOp};

#[test]
fn every_transfer_key_reaches_the_engine_config() {
    let flags = ServeFlags {
        transfer: Some("tcp".into()),
        name: Some("decode-3".into()),
        transfer_listen: Some("0.0.0.0:0".into()),
        transfer_advertise_addr: Some("10.1.2.3".into()),
        transfer_io_threads: Some(3),
        transfer_memcpy_threads: Some(5),
        transfer_queue_depth: Some(77),
        transfer_piece_bytes: Some(256 << 10),
        transfer_tcp_connections: Some(7),
        transfer_registration_chunk_bytes: Some(64 << 20),
        transfer_require_auth: Some(true),
        transfer_tcp_integrity: Some("encrypt".into()),
        rdma_devices: Some("mlx5_0,mlx5_1".into()),
        rdma_port: Some(2),
        rdma_gid_index: Some(3),
        rdma_mtu: Some(4096),
        rdma_send_queue_depth: Some(128),
        rdma_cq_depth: Some(256),
        ..Default::default()
    };
    let cfg = ServeConfig::load(None, &flags).unwrap();
    let t = TransferConfig::from_serve_config(&cfg).unwrap();
    assert_eq!(t.backend, BackendKind::Tcp);
    assert_eq!(t.name, "decode-3");
    assert_eq!(t.listen.to_string(), "0.0.0.0:0");
    assert_eq!(t.advertise_addr.as_deref(), Some("10.1.2.3"));
    assert_eq!(
        (
            t.io_threads,
            t.queue_depth,
            t.piece_bytes,
            t.tcp_connections
        ),
        (3, 77, 256 << 10, 7)
    );
    assert_eq!(t.memcpy_threads, 5);
    assert_eq!(t.max_registration_bytes, Some(64 << 20));
    assert!(t.require_auth);
    assert_eq!(t.tcp_integrity, TcpIntegrity::Encrypt);
    assert_eq!(t.rdma.devices, vec!["mlx5_0", "mlx5_1"]);
    assert_eq!(
        (t.rdma.port, t.rdma.gid_index, t.rdma.mtu),
        (2, Some(3), Some(4096))
    );
    assert_eq!((t.rdma.send_queue_depth, t.rdma.cq_depth), (128, 256));
    // Defaults are the engine's own defaults.
    let d = TransferConfig::from_serve_config(&ServeConfig::default()).unwrap();
    let n = TransferConfig::new(BackendKind::Shm, "instance-0");
    assert_eq!(
        (
            d.io_threads,
            d.memcpy_threads,
            d.queue_depth,
            d.piece_bytes,
            d.tcp_connections
        ),
        (
            n.io_threads,
            n.memcpy_threads,
            n.queue_depth,
            n.piece_bytes,
            n.tcp_connections
        )
    );
    assert_eq!(d.rdma, n.rdma);
}

#[test]
fn rdma_settings_are_validated_without_a_device() {
    TransferConfig::new(BackendKind::Rdma, "r")
        .validate()
        .unwrap();
    for (mutate, needle) in [
        (
            (|c: &mut TransferConfig| c.rdma.devices = vec!["mlx5_0".into(), "mlx5_0".into()])
                as fn(&mut TransferConfig),
            "listed twice",
        ),
        (|c| c.rdma.mtu = Some(9000), "mtu"),
        (|c| c.rdma.port = 0, "port"),
        (|c| c.rdma.cq_depth = 1, "cq_depth"),
        (|c| c.advertise_addr = Some("nope".into()), "advertise_addr"),
    ] {
        let mut c = TransferConfig::new(BackendKind::Rdma, "r");
        mutate(&mut c);
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains(needle), "{needle}: {e}");
    }
}

#[test]
fn an_engine_on_an_unspecified_address_publishes_a_reachable_one() {
    let mut cfg = TransferConfig::new(BackendKind::Tcp, "anywhere");
    cfg.listen = "0.0.0.0:0".parse().unwrap();
    let engine = TransferEngine::new(cfg.clone()).unwrap();
    let published: std::net::SocketAddr = engine.address().parse().unwrap();
    assert!(!published.ip().is_unspecified(), "{published}");
    assert_ne!(published.port(), 0);
    // Towards a peer on loopback: the loopback address, and it answers there.
    let to_local = engine.address_for("127.0.0.1:9");
    assert_eq!(to_local, format!("127.0.0.1:{}", published.port()));
    let peer = TransferEngine::new(TransferConfig::new(BackendKind::Tcp, "peer")).unwrap();
    let region = engine.allocate_and_register(4096).unwrap();
    region.write_at(0, &[5; 4096]).unwrap();
    let local = peer.allocate_and_register(4096).unwrap();
    let session = peer.connect_blocking(&to_local).unwrap();
    session
        .submit(&[TransferOp::read(local.id(), 0, region.id(), 0, 4096)])
        .unwrap()
        .wait_blocking(std::time::Duration::from_secs(10))
        .unwrap();
    assert_eq!(local.read_at(0, 4096).unwrap(), vec![5; 4096]);
    // A configured address wins, with the bound port unless it names one.
    cfg.advertise_addr = Some("10.9.8.7".into());
    let e = TransferEngine::new(cfg.clone()).unwrap();
    let port = e.address().rsplit(':').next().unwrap().to_string();
    assert_eq!(e.address(), format!("10.9.8.7:{port}"));
    assert_eq!(e.address_for("127.0.0.1:9"), e.address());
    cfg.advertise_addr = Some("10.9.8.7:4000".into());
    assert_eq!(TransferEngine::new(cfg).unwrap().address(), "10.9.8.7:4000");
}
