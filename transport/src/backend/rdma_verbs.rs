//! The `rdma` backend over raw ibverbs (feature `rdma`): reliable-connected queue pairs and
//! one-sided RDMA WRITE / RDMA READ straight between registered regions.
//!
//! - The engine opens the devices of `RdmaConfig::devices` (or the first one listed), each on
//!   port `RdmaConfig::port`, with one protection domain each; a named device that is missing
//!   is a [`TransportError::RdmaDevice`] naming the devices that are there. On RoCE ports the
//!   GID index is `RdmaConfig::gid_index`, or the first RoCE v2 entry holding an IPv4 address
//!   ([`super::pick_roce_gid`]); the path MTU is `RdmaConfig::mtu` or the port's active MTU.
//! - Each region is registered on every device, as memory regions of at most
//!   `max_registration_bytes` (default 1 GiB; NICs limit one registration). Its descriptor
//!   carries the first device's address and rkey per chunk; the other devices' rkeys come with
//!   `OP_RDMA_KEYS`. Dropping the registration deregisters every chunk on every device.
//! - A TCP control connection (the `tcp` backend's protocol, with the session-key proof when
//!   the session is authenticated) carries the greeting, `GetRegisteredMemory`,
//!   notifications, the queue-pair endpoint exchange and the keys; the target keeps its queue
//!   pairs while that connection lives.
//! - A session owns one queue pair per local device (connected to the target's device
//!   `i mod n`), each driven by a dedicated thread (`pdserve-rdma-<peer>-<i>`) that posts
//!   pieces from a bounded queue (at most `send_queue_depth` in flight) and polls its
//!   completion queue. The pieces of a batch are striped over the queue pairs.
//!
//! A write completion means the bytes are in the target's memory as far as its NIC is
//! concerned (one-sided: the target's CPU copies nothing and runs no fence or check); see
//! docs/transport.md. This machine has no RDMA device: the backend is compiled here (`cargo
//! check --features rdma`) but its tests run only where `ibv_devices` lists a device.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;
use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};

use crate::auth::ClientAuth;
use crate::backend::codec;
use crate::backend::proto;
use crate::backend::tcp::{listen, TcpConn};
use crate::batch::{BatchState, PieceCompletion};
use crate::config::{BackendKind, RdmaConfig};
use crate::error::{Result, TransportError};
use crate::memory::{BackendRegistration, Registry};
use crate::op::OpKind;
use crate::plan::PlannedOp;
use crate::seam::{Backend, BoxFut, EngineCore, Link};

const DEFAULT_MAX_REGISTRATION: u64 = 1 << 30;

/// Whether `ibv_devices` would list a device.
pub(crate) fn device_available() -> bool {
    ibverbs::devices().map(|d| !d.is_empty()).unwrap_or(false)
}

/// Names of the devices `ibv_devices` lists.
fn device_names() -> Vec<String> {
    let mut n = 0i32;
    let mut names = Vec::new();
    // SAFETY: the list is read while held and freed once.
    unsafe {
        let list = ffi::ibv_get_device_list(&mut n);
        if list.is_null() {
            return names;
        }
        for i in 0..n.max(0) as usize {
            let dev = *list.add(i);
            let name = ffi::ibv_get_device_name(dev);
            if !name.is_null() {
                names.push(
                    std::ffi::CStr::from_ptr(name)
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
        ffi::ibv_free_device_list(list);
    }
    names
}

fn mtu_enum(bytes: u32) -> Option<ffi::ibv_mtu> {
    Some(match bytes {
        256 => ffi::IBV_MTU_256,
        512 => ffi::IBV_MTU_512,
        1024 => ffi::IBV_MTU_1024,
        2048 => ffi::IBV_MTU_2048,
        4096 => ffi::IBV_MTU_4096,
        _ => return None,
    })
}

/// The GID table of `port` of `device` as sysfs shows it (type per index), with the GIDs.
fn gid_table(ctx: *mut ffi::ibv_context, device: &str, port: u8, len: i32) -> Vec<super::GidEntry> {
    let mut out = Vec::new();
    for index in 0..len.max(0) as u32 {
        let kind = std::fs::read_to_string(format!(
            "/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}"
        ))
        .unwrap_or_default();
        // SAFETY: `gid` is written by the call before it is read; live context.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        if unsafe { ffi::ibv_query_gid(ctx, port, index as i32, &mut gid) } != 0 {
            continue;
        }
        // SAFETY: `raw` is the union's byte view, always initialised.
        out.push(super::GidEntry {
            index,
            kind,
            gid: unsafe { gid.raw },
        });
    }
    out
}

fn os_err(what: &str) -> TransportError {
    TransportError::Io(Arc::new(std::io::Error::other(format!(
        "{what}: {}",
        std::io::Error::last_os_error()
    ))))
}

/// An open device and protection domain, with the port settings queue pairs use.
struct Verbs {
    name: String,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    port: u8,
    lid: u16,
    /// This side's GID and its index (RoCE); `None` on InfiniBand.
    gid: Option<([u8; 16], u32)>,
    mtu: ffi::ibv_mtu,
    send_depth: u32,
    cq_depth: i32,
}

// SAFETY: verbs objects are thread-safe per the libibverbs documentation.
unsafe impl Send for Verbs {}
// SAFETY: as above.
unsafe impl Sync for Verbs {}

impl Verbs {
    /// Opens `name` with the settings of `cfg`.
    fn open(name: &str, cfg: &RdmaConfig, available: &[String]) -> Result<Arc<Self>> {
        let dev_err = |reason: String| TransportError::RdmaDevice {
            device: name.to_string(),
            reason,
            available: available.to_vec(),
        };
        let port = cfg.port;
        let mut n = 0i32;
        // SAFETY: plain libibverbs calls; the list is freed after opening.
        unsafe {
            let list = ffi::ibv_get_device_list(&mut n);
            if list.is_null() {
                return Err(os_err("ibv_get_device_list"));
            }
            let mut ctx = std::ptr::null_mut();
            for i in 0..n.max(0) as usize {
                let dev = *list.add(i);
                let dn = ffi::ibv_get_device_name(dev);
                if !dn.is_null() && std::ffi::CStr::from_ptr(dn).to_string_lossy() == name {
                    ctx = ffi::ibv_open_device(dev);
                    if ctx.is_null() {
                        ffi::ibv_free_device_list(list);
                        return Err(dev_err(format!(
                            "ibv_open_device: {}",
                            std::io::Error::last_os_error()
                        )));
                    }
                    break;
                }
            }
            ffi::ibv_free_device_list(list);
            if ctx.is_null() {
                return Err(dev_err("no such device".into()));
            }
            let close = |e: TransportError| {
                ffi::ibv_close_device(ctx);
                e
            };
            let mut pa: ffi::ibv_port_attr = std::mem::zeroed();
            if ffi::ibv_query_port(ctx, port, &mut pa as *mut ffi::ibv_port_attr as *mut _) != 0 {
                return Err(close(dev_err(format!(
                    "port {port}: ibv_query_port: {}",
                    std::io::Error::last_os_error()
                ))));
            }
            if pa.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
                return Err(close(dev_err(format!(
                    "port {port} is not active (state {:?})",
                    pa.state
                ))));
            }
            let mtu = match cfg.mtu {
                Some(bytes) => {
                    let m = mtu_enum(bytes)
                        .ok_or_else(|| close(dev_err(format!("unsupported mtu {bytes}"))))?;
                    if m > pa.active_mtu {
                        return Err(close(dev_err(format!(
                            "mtu {bytes} is above port {port}'s active mtu ({:?})",
                            pa.active_mtu
                        ))));
                    }
                    m
                }
                None => pa.active_mtu,
            };
            let gid = if pa.link_layer == ffi::IBV_LINK_LAYER_ETHERNET as u8 {
                let table = gid_table(ctx, name, port, pa.gid_tbl_len);
                let index = match cfg.gid_index {
                    Some(i) => i,
                    None => super::pick_roce_gid(&table).ok_or_else(|| {
                        close(dev_err(format!(
                            "port {port} has no RoCE v2 GID: set transfer.rdma_gid_index"
                        )))
                    })?,
                };
                let entry = table.iter().find(|e| e.index == index).ok_or_else(|| {
                    close(dev_err(format!(
                        "GID index {index} is not in port {port}'s table ({} entries)",
                        pa.gid_tbl_len
                    )))
                })?;
                Some((entry.gid, index))
            } else {
                None
            };
            let pd = ffi::ibv_alloc_pd(ctx);
            if pd.is_null() {
                return Err(close(os_err("ibv_alloc_pd")));
            }
            Ok(Arc::new(Self {
                name: name.to_string(),
                ctx,
                pd,
                port,
                lid: pa.lid,
                gid,
                mtu,
                send_depth: cfg.send_queue_depth,
                cq_depth: cfg.cq_depth as i32,
            }))
        }
    }
}

impl Drop for Verbs {
    fn drop(&mut self) {
        // SAFETY: created in `open`; every MR and QP holds an Arc, so they are gone by now.
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// The memory regions of one registered region; deregistered on drop.
struct MrSet {
    mrs: Vec<(u64, u64, *mut ffi::ibv_mr)>,
    _verbs: Arc<Verbs>,
}

// SAFETY: MR handles are plain pointers to verbs objects, usable from any thread.
unsafe impl Send for MrSet {}
// SAFETY: as above.
unsafe impl Sync for MrSet {}

impl MrSet {
    fn lkey(&self, offset: u64) -> Option<u32> {
        self.mrs
            .iter()
            .find(|(o, l, _)| *o <= offset && offset < o + l)
            // SAFETY: the MR lives while `self` does.
            .map(|(_, _, mr)| unsafe { (**mr).lkey })
    }
}

impl Drop for MrSet {
    fn drop(&mut self) {
        for (_, _, mr) in &self.mrs {
            // SAFETY: registered in `register`, deregistered once.
            unsafe { ffi::ibv_dereg_mr(*mr) };
        }
    }
}

/// A region's registrations, one [`MrSet`] per device (in the engine's device order).
struct RdmaRegistration {
    sets: Vec<MrSet>,
}

impl RdmaRegistration {
    /// Each chunk's offset and its rkey on each device.
    fn rkeys(&self) -> Vec<(u64, Vec<u32>)> {
        let Some(first) = self.sets.first() else {
            return Vec::new();
        };
        first
            .mrs
            .iter()
            .enumerate()
            .map(|(c, (offset, _, _))| {
                let keys = self
                    .sets
                    .iter()
                    // SAFETY: the MRs live while `self` does.
                    .map(|s| unsafe { (*s.mrs[c].2).rkey })
                    .collect();
                (*offset, keys)
            })
            .collect()
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Endpoint {
    qpn: u32,
    lid: u16,
    gid: Option<[u8; 16]>,
    /// Which of its side's devices the queue pair is on.
    device: usize,
}

/// `OP_RDMA_KEYS` answer: per region, per chunk (by offset), the rkey on each of the target's
/// devices.
type KeyTable = HashMap<u64, Vec<(u64, Vec<u32>)>>;

/// A reliable-connected queue pair with its completion queue.
struct Qp {
    verbs: Arc<Verbs>,
    cq: *mut ffi::ibv_cq,
    qp: *mut ffi::ibv_qp,
}

// SAFETY: verbs objects are thread-safe; the data path uses one thread per QP.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    fn new(verbs: Arc<Verbs>) -> Result<Self> {
        // SAFETY: plain verbs calls on live objects.
        unsafe {
            let cq = ffi::ibv_create_cq(
                verbs.ctx,
                verbs.cq_depth,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            );
            if cq.is_null() {
                return Err(os_err("ibv_create_cq"));
            }
            let mut attr: ffi::ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = cq;
            attr.recv_cq = cq;
            attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            attr.cap.max_send_wr = verbs.send_depth;
            attr.cap.max_recv_wr = 1;
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            let qp = ffi::ibv_create_qp(verbs.pd, &mut attr);
            if qp.is_null() {
                ffi::ibv_destroy_cq(cq);
                return Err(os_err("ibv_create_qp"));
            }
            Ok(Self { verbs, cq, qp })
        }
    }

    fn endpoint(&self, device: usize) -> Endpoint {
        // SAFETY: live QP.
        Endpoint {
            qpn: unsafe { (*self.qp).qp_num },
            lid: self.verbs.lid,
            gid: self.verbs.gid.map(|(g, _)| g),
            device,
        }
    }

    /// INIT → RTR → RTS against the remote endpoint (RC, remote read and write allowed).
    fn connect(&self, remote: &Endpoint) -> Result<()> {
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: attribute structs are fully initialised (zeroed, then set) before the calls.
        unsafe {
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
            a.port_num = self.verbs.port;
            a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
                .0;
            let mask =
                M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS;
            if ffi::ibv_modify_qp(self.qp, &mut a, mask.0 as i32) != 0 {
                return Err(os_err("ibv_modify_qp(INIT)"));
            }
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = self.verbs.mtu;
            a.dest_qp_num = remote.qpn;
            a.rq_psn = 0;
            a.max_dest_rd_atomic = 16;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = remote.lid;
            a.ah_attr.port_num = self.verbs.port;
            if let Some(gid) = remote.gid {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = gid;
                a.ah_attr.grh.hop_limit = 0xff;
                a.ah_attr.grh.sgid_index = self.verbs.gid.map_or(0, |(_, i)| i as u8);
            }
            let mask = M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER;
            if ffi::ibv_modify_qp(self.qp, &mut a, mask.0 as i32) != 0 {
                return Err(os_err("ibv_modify_qp(RTR)"));
            }
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.sq_psn = 0;
            a.max_rd_atomic = 16;
            let mask = M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC;
            if ffi::ibv_modify_qp(self.qp, &mut a, mask.0 as i32) != 0 {
                return Err(os_err("ibv_modify_qp(RTS)"));
            }
        }
        Ok(())
    }

    /// Posts one signaled RDMA WRITE or READ of a piece, from this QP's device's registration
    /// (`device`) of the local region.
    fn post(&self, wr_id: u64, op: &PlannedOp, device: usize) -> Result<()> {
        let mrs = op
            .local
            .backend
            .as_ref()
            .and_then(|b| b.0.downcast_ref::<RdmaRegistration>())
            .and_then(|r| r.sets.get(device))
            .ok_or_else(|| {
                TransportError::Config("local region is not registered with rdma".into())
            })?;
        let chunk = mrs
            .mrs
            .iter()
            .find(|(o, l, _)| *o <= op.local_offset && op.local_offset < o + l)
            .map(|c| c.0)
            .ok_or_else(|| {
                TransportError::LayoutMismatch("local offset outside every memory region".into())
            })?;
        let lkey = mrs.lkey(chunk).unwrap_or_default();
        let mut sge = ffi::ibv_sge {
            addr: op.local.ptr_at(op.local_offset) as u64,
            length: op.len as u32,
            lkey,
        };
        // SAFETY: the work request is fully initialised; the local range is registered and kept
        // alive by `op` until its completion is polled.
        unsafe {
            let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
            wr.wr_id = wr_id;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = match op.kind {
                OpKind::Write => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                OpKind::Read => ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            };
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.wr.rdma.remote_addr =
                op.remote_chunk.addr + (op.remote_offset - op.remote_chunk.offset);
            wr.wr.rdma.rkey = op.remote_chunk.rkey;
            let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
            let ctx = (*self.qp).context;
            let post = (*ctx)
                .ops
                .post_send
                .ok_or_else(|| TransportError::Unsupported("device has no post_send".into()))?;
            let errno = post(self.qp, &mut wr, &mut bad);
            if errno != 0 {
                return Err(TransportError::Io(Arc::new(
                    std::io::Error::from_raw_os_error(errno),
                )));
            }
        }
        Ok(())
    }

    /// Polls up to `out.len()` completions.
    fn poll(&self, out: &mut [ffi::ibv_wc]) -> Result<usize> {
        // SAFETY: `out` is writable for its length; live CQ.
        unsafe {
            let ctx = (*self.cq).context;
            let poll = (*ctx)
                .ops
                .poll_cq
                .ok_or_else(|| TransportError::Unsupported("device has no poll_cq".into()))?;
            let n = poll(self.cq, out.len() as i32, out.as_mut_ptr());
            if n < 0 {
                return Err(os_err("ibv_poll_cq"));
            }
            Ok(n as usize)
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once, QP before its CQ.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}

pub(crate) struct RdmaBackend {
    devices: Vec<Arc<Verbs>>,
    addr: SocketAddr,
    max_reg: u64,
}

impl RdmaBackend {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Result<Self> {
        let cfg = &core.config.rdma;
        let available = device_names();
        let devices = super::select_devices(&cfg.devices, &available)?
            .iter()
            .map(|name| Verbs::open(name, cfg, &available))
            .collect::<Result<Vec<_>>>()?;
        for v in &devices {
            tracing::info!(device = %v.name, port = v.port, gid_index = ?v.gid.map(|(_, i)| i), mtu = ?v.mtu, "rdma device opened");
        }
        let (hook_devices, registry) = (devices.clone(), core.registry.clone());
        let hook: proto::RdmaAcceptHook = Arc::new(move |op: u8, payload: &[u8]| {
            if op == codec::OP_RDMA_KEYS {
                let keys = key_table(&registry, payload)?;
                let answer = serde_json::to_vec(&keys)
                    .map_err(|e| TransportError::Protocol(e.to_string()))?;
                return Ok((answer, Box::new(()) as Box<dyn std::any::Any + Send>));
            }
            let remotes: Vec<Endpoint> = serde_json::from_slice(payload)
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            let mut qps = Vec::with_capacity(remotes.len());
            let mut answer = Vec::with_capacity(remotes.len());
            for (i, remote) in remotes.iter().enumerate() {
                let device = i % hook_devices.len();
                let qp = Qp::new(hook_devices[device].clone())?;
                qp.connect(remote)?;
                answer.push(qp.endpoint(device));
                qps.push(qp);
            }
            let answer =
                serde_json::to_vec(&answer).map_err(|e| TransportError::Protocol(e.to_string()))?;
            Ok((answer, Box::new(qps) as Box<dyn std::any::Any + Send>))
        });
        let addr = listen(core, BackendKind::Rdma, Some(hook))?;
        Ok(Self {
            devices,
            addr,
            max_reg: core
                .config
                .max_registration_bytes
                .unwrap_or(DEFAULT_MAX_REGISTRATION),
        })
    }
}

/// The rkeys of the regions named in `payload` (JSON list of ids; all when empty) on every
/// device.
fn key_table(registry: &Registry, payload: &[u8]) -> Result<KeyTable> {
    let ids: Vec<u64> = if payload.is_empty() {
        registry.descriptors().iter().map(|d| d.id).collect()
    } else {
        serde_json::from_slice(payload).map_err(|e| TransportError::Protocol(e.to_string()))?
    };
    let mut out = KeyTable::new();
    for id in ids {
        let Ok(entry) = registry.get(crate::error::Side::Local, id) else {
            continue;
        };
        if let Some(reg) = entry
            .backend
            .as_ref()
            .and_then(|b| b.0.downcast_ref::<RdmaRegistration>())
        {
            out.insert(id, reg.rkeys());
        }
    }
    Ok(out)
}

impl Backend for RdmaBackend {
    fn address(&self) -> String {
        self.addr.to_string()
    }
    fn allocator(&self) -> Arc<dyn HostMemoryAllocator> {
        Arc::new(AnonAllocator)
    }
    fn register(
        &self,
        mem: &Arc<dyn HostMemory>,
    ) -> Result<(
        Vec<RegionChunk>,
        Option<ShmHandle>,
        Option<BackendRegistration>,
    )> {
        let len = mem.len() as u64;
        let access = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0 as i32;
        let mut reg = RdmaRegistration { sets: Vec::new() };
        let mut chunks = Vec::new();
        for (d, verbs) in self.devices.iter().enumerate() {
            let mut set = MrSet {
                mrs: Vec::new(),
                _verbs: verbs.clone(),
            };
            let mut offset = 0u64;
            while offset < len {
                let n = self.max_reg.min(len - offset);
                let addr = mem.as_ptr().wrapping_add(offset as usize);
                // SAFETY: `addr..addr+n` lies inside the memory, which outlives the MR (the
                // entry holds both; the registration drops first).
                let mr = unsafe { ffi::ibv_reg_mr(verbs.pd, addr.cast(), n as usize, access) };
                if mr.is_null() {
                    // `set` and `reg` deregister what was registered.
                    return Err(os_err(&format!("ibv_reg_mr on {}", verbs.name)));
                }
                set.mrs.push((offset, n, mr));
                if d == 0 {
                    chunks.push(RegionChunk {
                        offset,
                        len: n,
                        addr: addr as u64,
                        // SAFETY: live MR.
                        rkey: unsafe { (*mr).rkey },
                    });
                }
                offset += n;
            }
            reg.sets.push(set);
        }
        Ok((chunks, None, Some(Box::new(reg))))
    }
    fn connect(
        &self,
        core: Arc<EngineCore>,
        addr: String,
        auth: Option<ClientAuth>,
    ) -> BoxFut<Result<Arc<dyn Link>>> {
        let devices = self.devices.clone();
        Box::pin(async move {
            let peer: Arc<str> = Arc::from(addr.as_str());
            let control = TcpConn::open(&core, &addr, peer.clone(), auth.as_ref()).await?;
            let qps = devices
                .iter()
                .map(|v| Qp::new(v.clone()))
                .collect::<Result<Vec<_>>>()?;
            let mine: Vec<Endpoint> = qps.iter().enumerate().map(|(i, q)| q.endpoint(i)).collect();
            let mine =
                serde_json::to_vec(&mine).map_err(|e| TransportError::Protocol(e.to_string()))?;
            let theirs = control.control(&peer, codec::OP_RDMA_CONNECT, mine).await?;
            let remotes: Vec<Endpoint> = serde_json::from_slice(&theirs)
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            if remotes.len() != qps.len() {
                return Err(TransportError::Protocol(format!(
                    "the target answered {} queue pairs for {}",
                    remotes.len(),
                    qps.len()
                )));
            }
            let mut lanes = Vec::with_capacity(qps.len());
            for (i, (qp, remote)) in qps.into_iter().zip(&remotes).enumerate() {
                qp.connect(remote)?;
                lanes.push(Lane::start(
                    format!("{peer}-{i}"),
                    peer.clone(),
                    qp,
                    i,
                    remote.device,
                    core.config.queue_depth,
                )?);
            }
            Ok(Arc::new(RdmaLink {
                peer,
                control,
                lanes,
                keys: std::sync::RwLock::new(Arc::new(KeyTable::new())),
                next: std::sync::atomic::AtomicUsize::new(0),
            }) as Arc<dyn Link>)
        })
    }
}

type Job = (Vec<PlannedOp>, Arc<BatchState>);

/// One queue pair of a session and the thread that drives it.
struct Lane {
    tx: SyncSender<Job>,
    alive: Arc<AtomicBool>,
    /// The target device this lane's queue pair is connected to.
    remote_device: usize,
}

impl Lane {
    fn start(
        name: String,
        peer: Arc<str>,
        qp: Qp,
        device: usize,
        remote_device: usize,
        depth: usize,
    ) -> Result<Self> {
        let (tx, rx) = sync_channel::<Job>(depth);
        let alive = Arc::new(AtomicBool::new(true));
        let send_depth = qp.verbs.send_depth as usize;
        let (alive2, peer2) = (alive.clone(), peer);
        std::thread::Builder::new().name(format!("pdserve-rdma-{name}")).spawn(move || {
            let mut pending: std::collections::VecDeque<(PlannedOp, PieceCompletion)> = Default::default();
            let mut in_flight: HashMap<u64, PieceCompletion> = HashMap::new();
            let mut next_id = 1u64;
            // SAFETY: ibv_wc is plain data; zeroed is a valid (empty) value.
            let mut wcs: Vec<ffi::ibv_wc> = vec![unsafe { std::mem::zeroed() }; 64];
            let mut open = true;
            while open || !pending.is_empty() || !in_flight.is_empty() {
                if !alive2.load(Ordering::Acquire) {
                    break; // dropping the completions fails their pieces
                }
                loop {
                    match rx.try_recv() {
                        Ok((ops, batch)) => pending.extend(ops.into_iter().map(|op| (op, PieceCompletion::new(batch.clone(), peer2.clone())))),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                }
                while in_flight.len() < send_depth {
                    let Some((op, done)) = pending.pop_front() else { break };
                    if done.is_cancelled() {
                        done.complete(Err(TransportError::Cancelled));
                        continue;
                    }
                    let id = next_id;
                    next_id += 1;
                    match qp.post(id, &op, device) {
                        Ok(()) => {
                            in_flight.insert(id, done);
                        }
                        Err(e) => done.complete(Err(e)),
                    }
                }
                match qp.poll(&mut wcs) {
                    Ok(0) if in_flight.is_empty() && pending.is_empty() => {
                        // Idle: wait for work without spinning.
                        match rx.recv_timeout(Duration::from_millis(50)) {
                            Ok((ops, batch)) => pending.extend(ops.into_iter().map(|op| (op, PieceCompletion::new(batch.clone(), peer2.clone())))),
                            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => open = false,
                        }
                    }
                    Ok(0) => std::thread::yield_now(),
                    Ok(n) => {
                        for wc in &wcs[..n] {
                            if let Some(done) = in_flight.remove(&wc.wr_id()) {
                                match wc.error() {
                                    None => done.complete(Ok(())),
                                    Some((status, vendor)) => {
                                        done.complete(Err(TransportError::peer_gone(&*peer2, format!("work completion status {status} (vendor {vendor})"))));
                                        alive2.store(false, Ordering::Release);
                                    }
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(peer = %peer2, error = %e, "rdma completion queue failed");
                        alive2.store(false, Ordering::Release);
                    }
                }
            }
            // Remaining completions drop here and fail their pieces; then the QP is destroyed.
            drop(in_flight);
            drop(pending);
            drop(qp);
        })?;
        Ok(Self {
            tx,
            alive,
            remote_device,
        })
    }
}

struct RdmaLink {
    peer: Arc<str>,
    control: TcpConn,
    lanes: Vec<Lane>,
    /// The target's rkeys on its other devices, as last fetched with the descriptors.
    keys: std::sync::RwLock<Arc<KeyTable>>,
    next: std::sync::atomic::AtomicUsize,
}

impl Link for RdmaLink {
    fn peer(&self) -> &str {
        &self.peer
    }
    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>> {
        Box::pin(async move {
            let regions = codec::decode_regions(
                &self
                    .control
                    .control(&self.peer, codec::OP_GET_REGIONS, Vec::new())
                    .await?,
            )?;
            if self.lanes.iter().any(|l| l.remote_device != 0) {
                let ids: Vec<u64> = regions.iter().map(|d| d.id).collect();
                let ids = serde_json::to_vec(&ids)
                    .map_err(|e| TransportError::Protocol(e.to_string()))?;
                let keys = self
                    .control
                    .control(&self.peer, codec::OP_RDMA_KEYS, ids)
                    .await?;
                let keys: KeyTable = serde_json::from_slice(&keys)
                    .map_err(|e| TransportError::Protocol(e.to_string()))?;
                *self.keys.write().expect("rdma keys poisoned") = Arc::new(keys);
            }
            Ok(regions)
        })
    }
    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>> {
        Box::pin(async move {
            self.control
                .control(&self.peer, codec::OP_NOTIFY, bytes)
                .await
                .map(|_| ())
        })
    }
    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()> {
        if !self.is_alive() {
            return Err(TransportError::peer_gone(&*self.peer, "connection lost"));
        }
        // Stripe the pieces over the lanes; a lane to another target device uses that
        // device's rkey of the chunk.
        let n = self.lanes.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let keys = self.keys.read().expect("rdma keys poisoned").clone();
        let mut jobs: Vec<Vec<PlannedOp>> = vec![Vec::new(); n];
        for (i, mut op) in pieces.into_iter().enumerate() {
            let lane = (first + i) % n;
            let dev = self.lanes[lane].remote_device;
            if dev != 0 {
                let chunk = op.remote_chunk.offset;
                let rkey = keys.get(&op.remote_region).and_then(|chunks| {
                    chunks
                        .iter()
                        .find(|(offset, _)| *offset == chunk)
                        .and_then(|(_, k)| k.get(dev).copied())
                });
                match rkey {
                    Some(k) => op.remote_chunk.rkey = k,
                    None => {
                        return Err(TransportError::LayoutMismatch(format!(
                            "no rkey of region {} on the target's device {dev}: refresh_regions",
                            op.remote_region
                        )))
                    }
                }
            }
            jobs[lane].push(op);
        }
        for (lane, ops) in self.lanes.iter().zip(jobs) {
            if ops.is_empty() {
                continue;
            }
            match lane.tx.try_send((ops, batch.clone())) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    return Err(TransportError::Busy("rdma queue full".into()))
                }
                Err(TrySendError::Disconnected(_)) => {
                    return Err(TransportError::peer_gone(
                        &*self.peer,
                        "rdma thread stopped",
                    ))
                }
            }
        }
        Ok(())
    }
    fn is_alive(&self) -> bool {
        self.lanes.iter().all(|l| l.alive.load(Ordering::Acquire)) && self.control.is_alive()
    }
    fn close(&self) {
        self.lanes
            .iter()
            .for_each(|l| l.alive.store(false, Ordering::Release));
        self.control.close();
    }
}
