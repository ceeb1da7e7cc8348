//! The `rdma` backend over raw ibverbs (feature `rdma`): reliable-connected queue pairs and
//! one-sided RDMA WRITE / RDMA READ straight between registered regions.
//!
//! - The engine opens the first device (port 1), allocates one protection domain, and registers
//!   each region as memory regions of at most `max_registration_bytes` (default 1 GiB; NICs
//!   limit one registration) — the chunks, with their address and rkey, are what the region
//!   descriptor carries. Dropping the registration deregisters every chunk.
//! - A TCP control connection (the `tcp` backend's protocol) carries the greeting,
//!   `GetRegisteredMemory`, notifications, and the queue-pair endpoint exchange; the target
//!   keeps its queue pair while that connection lives.
//! - Each session owns a queue pair and a completion queue, driven by one dedicated thread
//!   (`pdserve-rdma-<peer>`) that posts pieces from a bounded queue (at most `SEND_DEPTH` in
//!   flight) and polls the completion queue, completing pieces by work-request id.
//!
//! This machine has no RDMA device: the backend is compiled here (`cargo check --features
//! rdma`) but its tests run only where `ibv_devices` lists a device.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;
use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};

use crate::backend::proto;
use crate::backend::tcp::{listen, TcpConn};
use crate::engine::{
    Backend, BackendKind, BatchState, BoxFut, EngineCore, Link, OpKind, PieceCompletion, PlannedOp,
};
use crate::error::{Result, TransportError};
use crate::memory::BackendRegistration;

const PORT: u8 = 1;
const CQ_DEPTH: i32 = 1024;
const SEND_DEPTH: u32 = 512;
const DEFAULT_MAX_REGISTRATION: u64 = 1 << 30;

/// Whether `ibv_devices` would list a device.
pub(crate) fn device_available() -> bool {
    ibverbs::devices().map(|d| !d.is_empty()).unwrap_or(false)
}

fn os_err(what: &str) -> TransportError {
    TransportError::Io(Arc::new(std::io::Error::other(format!(
        "{what}: {}",
        std::io::Error::last_os_error()
    ))))
}

/// An open device and protection domain.
struct Verbs {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    lid: u16,
    gid: Option<[u8; 16]>,
}

// SAFETY: verbs objects are thread-safe per the libibverbs documentation.
unsafe impl Send for Verbs {}
// SAFETY: as above.
unsafe impl Sync for Verbs {}

impl Verbs {
    fn open() -> Result<Arc<Self>> {
        let mut n = 0i32;
        // SAFETY: plain libibverbs calls; the list is freed after opening.
        unsafe {
            let list = ffi::ibv_get_device_list(&mut n);
            if list.is_null() || n == 0 {
                if !list.is_null() {
                    ffi::ibv_free_device_list(list);
                }
                return Err(TransportError::Unsupported(
                    "no RDMA device (ibv_devices lists none)".into(),
                ));
            }
            let ctx = ffi::ibv_open_device(*list);
            ffi::ibv_free_device_list(list);
            if ctx.is_null() {
                return Err(os_err("ibv_open_device"));
            }
            let mut port: ffi::ibv_port_attr = std::mem::zeroed();
            if ffi::ibv_query_port(ctx, PORT, &mut port as *mut ffi::ibv_port_attr as *mut _) != 0 {
                ffi::ibv_close_device(ctx);
                return Err(os_err("ibv_query_port"));
            }
            let mut gid: ffi::ibv_gid = std::mem::zeroed();
            let gid = if ffi::ibv_query_gid(ctx, PORT, 0, &mut gid) == 0
                && port.link_layer == ffi::IBV_LINK_LAYER_ETHERNET as u8
            {
                Some(gid.raw)
            } else {
                None
            };
            let pd = ffi::ibv_alloc_pd(ctx);
            if pd.is_null() {
                ffi::ibv_close_device(ctx);
                return Err(os_err("ibv_alloc_pd"));
            }
            Ok(Arc::new(Self {
                ctx,
                pd,
                lid: port.lid,
                gid,
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

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Endpoint {
    qpn: u32,
    lid: u16,
    gid: Option<[u8; 16]>,
}

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
                CQ_DEPTH,
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
            attr.cap.max_send_wr = SEND_DEPTH;
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

    fn endpoint(&self) -> Endpoint {
        // SAFETY: live QP.
        Endpoint {
            qpn: unsafe { (*self.qp).qp_num },
            lid: self.verbs.lid,
            gid: self.verbs.gid,
        }
    }

    /// INIT → RTR → RTS against the remote endpoint (RC, remote read and write allowed).
    fn connect(&self, remote: &Endpoint) -> Result<()> {
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY: attribute structs are fully initialised (zeroed, then set) before the calls.
        unsafe {
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
            a.port_num = PORT;
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
            a.path_mtu = ffi::IBV_MTU_1024;
            a.dest_qp_num = remote.qpn;
            a.rq_psn = 0;
            a.max_dest_rd_atomic = 16;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = remote.lid;
            a.ah_attr.port_num = PORT;
            if let Some(gid) = remote.gid {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = gid;
                a.ah_attr.grh.hop_limit = 0xff;
                a.ah_attr.grh.sgid_index = 0;
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

    /// Posts one signaled RDMA WRITE or READ of a piece.
    fn post(&self, wr_id: u64, op: &PlannedOp) -> Result<()> {
        let mrs = op
            .local
            .backend
            .as_ref()
            .and_then(|b| b.0.downcast_ref::<MrSet>())
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
    verbs: Arc<Verbs>,
    addr: SocketAddr,
    max_reg: u64,
}

impl RdmaBackend {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Result<Self> {
        let verbs = Verbs::open()?;
        let v = verbs.clone();
        let hook: proto::RdmaAcceptHook = Arc::new(move |payload: &[u8]| {
            let remote: Endpoint = serde_json::from_slice(payload)
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            let qp = Qp::new(v.clone())?;
            qp.connect(&remote)?;
            let answer = serde_json::to_vec(&qp.endpoint())
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            Ok((answer, Box::new(qp) as Box<dyn std::any::Any + Send>))
        });
        let addr = listen(core, BackendKind::Rdma, Some(hook))?;
        Ok(Self {
            verbs,
            addr,
            max_reg: core
                .config
                .max_registration_bytes
                .unwrap_or(DEFAULT_MAX_REGISTRATION),
        })
    }
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
        let mut set = MrSet {
            mrs: Vec::new(),
            _verbs: self.verbs.clone(),
        };
        let mut chunks = Vec::new();
        let access = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0 as i32;
        let mut offset = 0u64;
        while offset < len {
            let n = self.max_reg.min(len - offset);
            let addr = mem.as_ptr().wrapping_add(offset as usize);
            // SAFETY: `addr..addr+n` lies inside the memory, which outlives the MR (the entry
            // holds both; the MR set drops first).
            let mr = unsafe { ffi::ibv_reg_mr(self.verbs.pd, addr.cast(), n as usize, access) };
            if mr.is_null() {
                return Err(os_err("ibv_reg_mr")); // `set` deregisters what was registered
            }
            set.mrs.push((offset, n, mr));
            // SAFETY: live MR.
            chunks.push(RegionChunk {
                offset,
                len: n,
                addr: addr as u64,
                rkey: unsafe { (*mr).rkey },
            });
            offset += n;
        }
        Ok((chunks, None, Some(Box::new(set))))
    }
    fn connect(&self, core: Arc<EngineCore>, addr: String) -> BoxFut<Result<Arc<dyn Link>>> {
        let verbs = self.verbs.clone();
        Box::pin(async move {
            let peer: Arc<str> = Arc::from(addr.as_str());
            let control = TcpConn::open(&core, &addr, peer.clone()).await?;
            let qp = Qp::new(verbs)?;
            let mine = serde_json::to_vec(&qp.endpoint())
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            let theirs = control.control(&peer, proto::OP_RDMA_CONNECT, mine).await?;
            let remote: Endpoint = serde_json::from_slice(&theirs)
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            qp.connect(&remote)?;
            Ok(
                Arc::new(RdmaLink::start(peer, control, qp, core.config.queue_depth)?)
                    as Arc<dyn Link>,
            )
        })
    }
}

type Job = (Vec<PlannedOp>, Arc<BatchState>);

struct RdmaLink {
    peer: Arc<str>,
    control: TcpConn,
    tx: SyncSender<Job>,
    alive: Arc<AtomicBool>,
}

impl RdmaLink {
    fn start(peer: Arc<str>, control: TcpConn, qp: Qp, depth: usize) -> Result<Self> {
        let (tx, rx) = sync_channel::<Job>(depth);
        let alive = Arc::new(AtomicBool::new(true));
        let (alive2, peer2) = (alive.clone(), peer.clone());
        std::thread::Builder::new().name(format!("pdserve-rdma-{peer}")).spawn(move || {
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
                while in_flight.len() < SEND_DEPTH as usize {
                    let Some((op, done)) = pending.pop_front() else { break };
                    if done.is_cancelled() {
                        done.complete(Err(TransportError::Cancelled));
                        continue;
                    }
                    let id = next_id;
                    next_id += 1;
                    match qp.post(id, &op) {
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
            peer,
            control,
            tx,
            alive,
        })
    }
}

impl Link for RdmaLink {
    fn peer(&self) -> &str {
        &self.peer
    }
    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>> {
        Box::pin(async move {
            proto::decode_regions(
                &self
                    .control
                    .control(&self.peer, proto::OP_GET_REGIONS, Vec::new())
                    .await?,
            )
        })
    }
    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>> {
        Box::pin(async move {
            self.control
                .control(&self.peer, proto::OP_NOTIFY, bytes)
                .await
                .map(|_| ())
        })
    }
    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()> {
        if !self.is_alive() {
            return Err(TransportError::peer_gone(&*self.peer, "connection lost"));
        }
        match self.tx.try_send((pieces, batch)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(TransportError::Busy("rdma queue full".into())),
            Err(TrySendError::Disconnected(_)) => Err(TransportError::peer_gone(
                &*self.peer,
                "rdma thread stopped",
            )),
        }
    }
    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && self.control.is_alive()
    }
    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        self.control.close();
    }
}
