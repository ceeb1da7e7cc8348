//! The transfer engine's configuration: RDMA settings are checked without a device, and an
//! engine listening on `0.0.0.0` publishes a reachable address. (That every `transfer.*` key
//! of the serving config reaches the engine is tested where the mapping lives, in
//! `pdserve-actors`.)

use pdserve_transport::{BackendKind, TransferConfig, TransferEngine, TransferOp};

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
