//! The `local` backend: both engines live in one process and a transfer is a memcpy on the
//! initiator's memcpy thread. Engines find each other through a process-wide table of
//! addresses (`local:N`); an engine that was dropped is a gone peer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use pdserve_runtime::memory::{AnonAllocator, HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};

use crate::batch::BatchState;
use crate::error::{Result, Side, TransportError};
use crate::memcpy::{run_batch, KeepAlive, RemotePointers};
use crate::memory::{plain_chunks, BackendRegistration};
use crate::plan::PlannedOp;
use crate::seam::{Backend, BoxFut, EngineCore, Link};

fn engines() -> &'static Mutex<HashMap<String, Weak<EngineCore>>> {
    static ENGINES: OnceLock<Mutex<HashMap<String, Weak<EngineCore>>>> = OnceLock::new();
    ENGINES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Forgets a dropped engine's address (no-op for addresses of other backends).
pub(crate) fn unregister_engine(address: &str) {
    if address.starts_with("local:") {
        engines()
            .lock()
            .expect("local engines poisoned")
            .remove(address);
    }
}

pub(crate) struct LocalBackend {
    address: String,
    max_reg: Option<u64>,
}

impl LocalBackend {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let address = format!("local:{}", NEXT.fetch_add(1, Ordering::Relaxed));
        engines()
            .lock()
            .expect("local engines poisoned")
            .insert(address.clone(), Arc::downgrade(core));
        Self {
            address,
            max_reg: core.config.max_registration_bytes,
        }
    }
}

impl Backend for LocalBackend {
    fn address(&self) -> String {
        self.address.clone()
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
        Ok((plain_chunks(mem.len() as u64, self.max_reg), None, None))
    }
    fn connect(
        &self,
        core: Arc<EngineCore>,
        addr: String,
        auth: Option<crate::auth::ClientAuth>,
    ) -> BoxFut<Result<Arc<dyn Link>>> {
        Box::pin(async move {
            if auth.is_some() {
                return Err(TransportError::Unsupported(
                    "local engines share one process: there is no connection to authenticate"
                        .into(),
                ));
            }
            let peer = engines()
                .lock()
                .expect("local engines poisoned")
                .get(&addr)
                .and_then(Weak::upgrade)
                .ok_or_else(|| {
                    TransportError::peer_gone(&addr, "no local engine at this address")
                })?;
            if peer.config.backend != crate::config::BackendKind::Local {
                return Err(TransportError::Config(format!(
                    "{addr} is not a local engine"
                )));
            }
            Ok(Arc::new(LocalLink {
                addr,
                peer: Arc::downgrade(&peer),
                me: core,
                closed: AtomicBool::new(false),
            }) as Arc<dyn Link>)
        })
    }
}

struct LocalLink {
    addr: String,
    peer: Weak<EngineCore>,
    me: Arc<EngineCore>,
    closed: AtomicBool,
}

impl LocalLink {
    fn peer_core(&self) -> Result<Arc<EngineCore>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::peer_gone(&self.addr, "session closed"));
        }
        self.peer
            .upgrade()
            .filter(|p| p.alive.load(Ordering::Acquire))
            .ok_or_else(|| TransportError::peer_gone(&self.addr, "peer engine shut down"))
    }
}

struct LocalRemote(Arc<EngineCore>, String, Arc<LocalLink>);

impl RemotePointers for LocalRemote {
    fn remote_ptr(&self, region: u64, offset: u64, len: u64) -> Result<(*mut u8, KeepAlive)> {
        let entry = self.0.registry.get(Side::Remote, region)?;
        entry.check(Side::Remote, offset, len)?;
        let ptr = entry.ptr_at(offset);
        Ok((ptr, Some(entry)))
    }
    fn peer_alive(&self) -> Result<()> {
        self.2
            .peer_core()
            .map(|_| ())
            .map_err(|_| TransportError::peer_gone(&self.1, "peer engine shut down"))
    }
}

impl Link for LocalLink {
    fn peer(&self) -> &str {
        &self.addr
    }
    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>> {
        Box::pin(async move { Ok(self.peer_core()?.registry.descriptors()) })
    }
    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>> {
        Box::pin(async move {
            let peer = self.peer_core()?;
            peer.deliver(self.me.name.clone(), bytes)
        })
    }
    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()> {
        let peer = self.peer_core()?;
        let remote = Arc::new(LocalRemote(peer, self.addr.clone(), self.clone()));
        run_batch(&self.me.memcpy, pieces, batch, remote)
    }
    fn is_alive(&self) -> bool {
        self.peer_core().is_ok()
    }
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}
