//! The seam between the engine and its backends: what a backend implements ([`Backend`],
//! [`Link`]) and what the engine gives it ([`EngineCore`]). Backends depend on this module,
//! never on the [`TransferEngine`](crate::TransferEngine) facade that drives them.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};
use tokio::sync::mpsc;

use crate::auth::{AuthTable, ClientAuth};
use crate::batch::BatchState;
use crate::config::TransferConfig;
use crate::error::{Result, TransportError};
use crate::memcpy::MemcpyExecutor;
use crate::memory::{BackendRegistration, Registry};
use crate::plan::PlannedOp;

pub(crate) type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// A notification from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending engine's name.
    pub from: String,
    /// The payload.
    pub bytes: Vec<u8>,
}

/// One open connection to a peer, as a backend implements it.
pub(crate) trait Link: Send + Sync {
    fn peer(&self) -> &str;
    /// The node name the peer proved (`quic`: from its certificate).
    fn peer_node(&self) -> Option<&str> {
        None
    }
    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>>;
    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>>;
    /// Starts the pieces; each is completed through `batch` later, possibly on another thread.
    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()>;
    fn is_alive(&self) -> bool;
    fn close(&self);
}

/// What a backend does for an engine.
pub(crate) trait Backend: Send + Sync {
    fn address(&self) -> String;
    fn allocator(&self) -> Arc<dyn HostMemoryAllocator>;
    /// Registers memory with the medium: chunks, shm handle, backend state.
    fn register(
        &self,
        mem: &Arc<dyn HostMemory>,
    ) -> Result<(
        Vec<RegionChunk>,
        Option<ShmHandle>,
        Option<BackendRegistration>,
    )>;
    /// Opens a link; with `auth`, every connection of it proves the session key.
    fn connect(
        &self,
        core: Arc<EngineCore>,
        addr: String,
        auth: Option<ClientAuth>,
    ) -> BoxFut<Result<Arc<dyn Link>>>;
}

/// What the engine's executors and servers share. Never owns the runtime.
#[derive(Debug)]
pub(crate) struct EngineCore {
    pub(crate) name: String,
    pub(crate) config: TransferConfig,
    pub(crate) registry: Arc<Registry>,
    pub(crate) notify_tx: mpsc::Sender<Notification>,
    pub(crate) alive: AtomicBool,
    pub(crate) memcpy: MemcpyExecutor,
    /// The grants this engine handed out as a target.
    pub(crate) auth: Arc<AuthTable>,
}

impl EngineCore {
    /// Delivers a notification to this engine's receiver. The acquire fence pairs with the
    /// sender's release: bytes the sender wrote before notifying are visible to whoever reads
    /// the notification.
    ///
    /// # Errors
    /// [`TransportError::Busy`] when the queue of `queue_depth` notifications is full: the
    /// owner does not take them (fast enough). Waiting for room instead would hold the
    /// sender's connection forever on an engine whose owner never takes them.
    pub(crate) fn deliver(&self, from: String, bytes: Vec<u8>) -> Result<()> {
        fence(Ordering::Acquire);
        match self.notify_tx.try_send(Notification { from, bytes }) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(TransportError::Busy(format!(
                "the notification queue of engine {} is full",
                self.name
            ))),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                tracing::debug!(engine = %self.name, "notification dropped: receiver closed");
                Ok(())
            }
        }
    }
}
