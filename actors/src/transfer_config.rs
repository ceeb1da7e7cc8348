//! The serving config's `[transfer]` section as the transfer engine's own [`TransferConfig`].
//!
//! The mapping lives here, on the side that knows both: `pdserve-transport` knows nothing of
//! the serving config, and `pdserve-runtime` (below it) nothing of the engine.

use pdserve_runtime::config::ServeConfig;
use pdserve_transport::control::tls::MemberCredentials;
use pdserve_transport::{RdmaConfig, Result, TransferConfig, TransportError};

/// The transfer engine an instance configured by `cfg` runs: `transfer.*` (backend,
/// listen address, advertised address, engine knobs, keys, integrity, RDMA) and, with
/// `transfer.credentials_dir`, the member credentials of `instance.name`.
///
/// # Errors
/// [`TransportError::Config`] naming the bad key; credential loading errors.
pub(crate) fn from_serve_config(cfg: &ServeConfig) -> Result<TransferConfig> {
    let t = &cfg.transfer;
    let key_err = |key: &str, e: &dyn std::fmt::Display| {
        TransportError::Config(format!("transfer.{key}: {e}"))
    };
    let mut c = TransferConfig::new(t.backend, cfg.instance.name.clone());
    c.listen = t.listen.parse().map_err(|e| key_err("listen", &e))?;
    c.advertise_addr = t.advertise_addr.clone();
    c.io_threads = t.io_threads;
    c.memcpy_threads = t.memcpy_threads;
    c.queue_depth = t.queue_depth;
    c.piece_bytes = t.piece_bytes;
    c.tcp_connections = t.tcp_connections;
    c.max_registration_bytes = t.registration_chunk_bytes;
    c.require_auth = t.require_auth;
    c.tcp_integrity = t
        .tcp_integrity
        .parse()
        .map_err(|e| key_err("tcp_integrity", &e))?;
    c.rdma = RdmaConfig {
        devices: t.rdma_device_list(),
        port: t.rdma_port,
        gid_index: t.rdma_gid_index,
        mtu: t.rdma_mtu,
        send_queue_depth: t.rdma_send_queue_depth,
        cq_depth: t.rdma_cq_depth,
    };
    if let Some(dir) = &t.credentials_dir {
        c.credentials = Some(
            MemberCredentials::load(std::path::Path::new(dir), &cfg.instance.name)
                .map_err(|e| key_err("credentials_dir", &e))?,
        );
    }
    c.validate()?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_runtime::config::ServeFlags;
    use pdserve_transport::{BackendKind, TcpIntegrity};

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
        let t = from_serve_config(&cfg).unwrap();
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
        let d = from_serve_config(&ServeConfig::default()).unwrap();
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
}
