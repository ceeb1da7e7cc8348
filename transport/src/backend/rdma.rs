//! The `rdma` backend (cargo feature `rdma`): one-sided RDMA READ/WRITE with ibverbs.
//!
//! Without the feature, or on a machine where `ibv_devices` lists no device, creating an
//! `rdma` engine fails with [`TransportError::Unsupported`]; a device named in
//! `RdmaConfig::devices` that is not there fails with [`TransportError::RdmaDevice`]. The
//! choices that need no device (which devices, which GID) are plain functions here, tested
//! everywhere.

use std::sync::Arc;

use crate::error::{Result, TransportError};
use crate::seam::{Backend, EngineCore};

#[cfg(feature = "rdma")]
#[path = "rdma_verbs.rs"]
mod verbs;

/// Whether an RDMA device is present (always false without the `rdma` feature).
pub(crate) fn device_available() -> bool {
    #[cfg(feature = "rdma")]
    {
        verbs::device_available()
    }
    #[cfg(not(feature = "rdma"))]
    {
        false
    }
}

pub(crate) fn new_backend(core: &Arc<EngineCore>) -> Result<Box<dyn Backend>> {
    #[cfg(feature = "rdma")]
    {
        verbs::RdmaBackend::new(core).map(|b| Box::new(b) as Box<dyn Backend>)
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = core;
        Err(TransportError::Unsupported(
            "this build has no rdma backend (cargo feature `rdma`)".into(),
        ))
    }
}

/// The devices to open: the `requested` ones, in order, or the first `available` one when
/// none is requested.
///
/// # Errors
/// [`TransportError::Unsupported`] when no device is available;
/// [`TransportError::RdmaDevice`] naming a requested device that is not there.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn select_devices(requested: &[String], available: &[String]) -> Result<Vec<String>> {
    if available.is_empty() {
        return Err(TransportError::Unsupported(
            "no RDMA device (ibv_devices lists none)".into(),
        ));
    }
    if requested.is_empty() {
        return Ok(vec![available[0].clone()]);
    }
    requested
        .iter()
        .map(|d| {
            if available.contains(d) {
                Ok(d.clone())
            } else {
                Err(TransportError::RdmaDevice {
                    device: d.clone(),
                    reason: "no such device".into(),
                    available: available.to_vec(),
                })
            }
        })
        .collect()
}

/// One entry of a port's GID table: index, type as sysfs names it (`RoCE v2`, `IB/RoCE v1`),
/// the GID.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) struct GidEntry {
    pub(crate) index: u32,
    pub(crate) kind: String,
    pub(crate) gid: [u8; 16],
}

/// The GID index RoCE traffic should use when none is configured: the first RoCE v2 entry
/// whose GID is an IPv4-mapped address (`::ffff:a.b.c.d`), which routes over IPv4 fabrics
/// (what most RoCE v2 deployments run); else the first RoCE v2 entry with a non-zero GID.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn pick_roce_gid(entries: &[GidEntry]) -> Option<u32> {
    let v2 = |e: &&GidEntry| e.kind.trim().eq_ignore_ascii_case("RoCE v2");
    let ipv4_mapped =
        |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    entries
        .iter()
        .filter(v2)
        .find(|e| ipv4_mapped(&e.gid))
        .or_else(|| {
            entries
                .iter()
                .filter(v2)
                .find(|e| e.gid.iter().any(|&b| b != 0))
        })
        .map(|e| e.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_selected_by_name_or_refused_with_the_list() {
        let here = vec!["mlx5_0".to_string(), "mlx5_1".to_string()];
        assert_eq!(select_devices(&[], &here).unwrap(), vec!["mlx5_0"]);
        assert_eq!(
            select_devices(&["mlx5_1".into(), "mlx5_0".into()], &here).unwrap(),
            vec!["mlx5_1", "mlx5_0"]
        );
        match select_devices(&["mlx5_7".into()], &here).unwrap_err() {
            TransportError::RdmaDevice {
                device, available, ..
            } => {
                assert_eq!(device, "mlx5_7");
                assert_eq!(available, here);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(select_devices(&[], &[]).unwrap_err().kind(), "unsupported");
    }

    #[test]
    fn the_roce_v2_ipv4_gid_is_picked() {
        let mut v4 = [0u8; 16];
        v4[10] = 0xff;
        v4[11] = 0xff;
        v4[12..].copy_from_slice(&[10, 0, 0, 5]);
        let mut v6 = [0u8; 16];
        v6[0] = 0xfe;
        v6[1] = 0x80;
        v6[15] = 1;
        let e = |index, kind: &str, gid| GidEntry {
            index,
            kind: kind.into(),
            gid,
        };
        let table = vec![
            e(0, "IB/RoCE v1", v6),
            e(1, "RoCE v2", v6),
            e(2, "IB/RoCE v1", v4),
            e(3, "RoCE v2", v4),
        ];
        assert_eq!(pick_roce_gid(&table), Some(3));
        assert_eq!(
            pick_roce_gid(&table[..3]),
            Some(1),
            "no IPv4: the first v2 GID"
        );
        assert_eq!(pick_roce_gid(&table[..1]), None, "RoCE v1 only");
        assert_eq!(
            pick_roce_gid(&[e(0, "RoCE v2", [0; 16])]),
            None,
            "an empty slot"
        );
    }
}
