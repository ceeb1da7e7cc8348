//! The `shm` backend: two processes on one host, under one uid. Regions are memfds
//! ([`ShmMemory`]) that the peer's process passes over a Unix socket ([`super::fd_pass`]) and
//! the initiator maps, so a transfer is one memcpy, done by the initiator's memcpy thread
//! straight into (or out of) the peer's memory. A TCP connection on loopback carries the
//! greeting, `GetRegisteredMemory` and notifications, and tells when the peer dies.
//!
//! Visibility: the copier issues a release fence after each piece and the batch's completion
//! counter is released/acquired; notifications are sent after a release fence and delivered
//! after an acquire fence, so a reader that learns of a write (by notification or by polling a
//! flag it reads with acquire) sees all of its bytes.
//!
//! [`ShmMemory`]: crate::memory::ShmMemory

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};

use super::codec;
use super::tcp::{listen, TcpConn};
use crate::auth::ClientAuth;
use crate::batch::BatchState;
use crate::config::BackendKind;
use crate::error::{Result, Side, TransportError};
use crate::memcpy::{run_batch, KeepAlive, RemotePointers};
use crate::memory::{
    check_range, plain_chunks, shm_handle_of, BackendRegistration, RemoteShmMapping, ShmAllocator,
};
use crate::plan::PlannedOp;
use crate::seam::{Backend, BoxFut, EngineCore, Link};

pub(crate) struct ShmBackend {
    addr: SocketAddr,
    max_reg: Option<u64>,
}

impl ShmBackend {
    pub(crate) fn new(core: &Arc<EngineCore>) -> Result<Self> {
        Ok(Self {
            addr: listen(core, BackendKind::Shm, None)?,
            max_reg: core.config.max_registration_bytes,
        })
    }
}

impl Backend for ShmBackend {
    fn address(&self) -> String {
        self.addr.to_string()
    }
    fn allocator(&self) -> Arc<dyn HostMemoryAllocator> {
        Arc::new(ShmAllocator)
    }
    fn register(
        &self,
        mem: &Arc<dyn HostMemory>,
    ) -> Result<(
        Vec<RegionChunk>,
        Option<ShmHandle>,
        Option<BackendRegistration>,
    )> {
        let handle = shm_handle_of(&**mem).ok_or_else(|| {
            TransportError::NotShareable(
                "the shm backend registers only memory from its allocator (ShmAllocator / ShmMemory)".into(),
            )
        })?;
        Ok((
            plain_chunks(mem.len() as u64, self.max_reg),
            Some(handle),
            None,
        ))
    }
    fn connect(
        &self,
        core: Arc<EngineCore>,
        addr: String,
        auth: Option<ClientAuth>,
    ) -> BoxFut<Result<Arc<dyn Link>>> {
        Box::pin(async move {
            let peer: Arc<str> = Arc::from(addr.as_str());
            let control = TcpConn::open(&core, &addr, peer.clone(), auth.as_ref()).await?;
            let grants = control
                .grants
                .as_ref()
                .map(|g| crate::auth::Scope::new(crate::auth::SESSION_SCOPE, g));
            Ok(Arc::new(ShmLink {
                peer,
                control,
                grants,
                me: core,
                maps: RwLock::new(HashMap::new()),
            }) as Arc<dyn Link>)
        })
    }
}

#[derive(Clone)]
struct MappedRegion {
    len: u64,
    /// The region's key at the peer's descriptor server.
    key: u64,
    map: Arc<RemoteShmMapping>,
}

struct ShmLink {
    peer: Arc<str>,
    control: TcpConn,
    /// The session scope's grants the target reported: the initiator's engine checks every
    /// piece against them, since it copies into the target's memory itself.
    grants: Option<crate::auth::Scope>,
    me: Arc<EngineCore>,
    maps: RwLock<HashMap<u64, MappedRegion>>,
}

struct ShmRemote {
    maps: HashMap<u64, (u64, Arc<RemoteShmMapping>)>,
    link: Arc<ShmLink>,
}

impl RemotePointers for ShmRemote {
    fn remote_ptr(&self, region: u64, offset: u64, len: u64) -> Result<(*mut u8, KeepAlive)> {
        let (rlen, map) = self
            .maps
            .get(&region)
            .ok_or(TransportError::UnknownRegion {
                side: Side::Remote,
                id: region,
            })?;
        check_range(Side::Remote, region, offset, len, *rlen)?;
        Ok((
            map.as_ptr().wrapping_add(offset as usize),
            Some(map.clone()),
        ))
    }
    fn peer_alive(&self) -> Result<()> {
        if self.link.control.is_alive() {
            Ok(())
        } else {
            Err(TransportError::peer_gone(
                &*self.link.peer,
                "control connection lost",
            ))
        }
    }
}

impl Link for ShmLink {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn fetch_regions(self: Arc<Self>) -> BoxFut<Result<Vec<RegionDescriptor>>> {
        Box::pin(async move {
            let bytes = self
                .control
                .control(&self.peer, codec::OP_GET_REGIONS, Vec::new())
                .await?;
            let regions = codec::decode_regions(&bytes)?;
            crate::memory::validate_descriptors(&regions)?;
            let mut maps = HashMap::new();
            let mut wanted = Vec::new();
            {
                let old = self.maps.read().expect("shm maps poisoned");
                for d in &regions {
                    let handle = d.shm.as_ref().ok_or_else(|| {
                        TransportError::LayoutMismatch(format!(
                            "peer region {} is not shared memory",
                            d.id
                        ))
                    })?;
                    match old.get(&d.id) {
                        Some(m) if m.len == d.len && m.key == handle.key => {
                            maps.insert(d.id, m.clone());
                        }
                        _ => wanted.push((d.id, handle.clone(), d.len)),
                    }
                }
            }
            if !wanted.is_empty() {
                // The memfds come over a Unix socket from the peer's process itself.
                let ends = self.control.ends;
                let received = tokio::task::spawn_blocking(move || {
                    let asks: Vec<_> = wanted.iter().map(|(_, h, len)| (h, *len)).collect();
                    RemoteShmMapping::receive(&asks, ends).map(|m| (wanted, m))
                })
                .await
                .map_err(|e| TransportError::Protocol(format!("shm mapping task failed: {e}")))??;
                for ((id, handle, len), map) in received.0.into_iter().zip(received.1) {
                    let map = Arc::new(map);
                    maps.insert(
                        id,
                        MappedRegion {
                            len,
                            key: handle.key,
                            map,
                        },
                    );
                }
            }
            *self.maps.write().expect("shm maps poisoned") = maps;
            Ok(regions)
        })
    }

    fn notify(self: Arc<Self>, bytes: Vec<u8>) -> BoxFut<Result<()>> {
        Box::pin(async move {
            self.control
                .control(&self.peer, codec::OP_NOTIFY, bytes)
                .await?;
            Ok(())
        })
    }

    fn execute(self: Arc<Self>, pieces: Vec<PlannedOp>, batch: Arc<BatchState>) -> Result<()> {
        if !self.control.is_alive() {
            return Err(TransportError::peer_gone(
                &*self.peer,
                "control connection lost",
            ));
        }
        if let Some(grants) = &self.grants {
            for op in &pieces {
                if op.fence != crate::auth::SESSION_SCOPE {
                    return Err(TransportError::Unsupported(
                        "fenced scopes need a target that lands the bytes itself (tcp, quic); \
                         shm copies from the initiator"
                            .into(),
                    ));
                }
                grants.check(op.kind, op.remote_region, op.remote_offset, op.len)?;
            }
        } else if pieces
            .iter()
            .any(|op| op.fence != crate::auth::SESSION_SCOPE)
        {
            return Err(TransportError::Fenced {
                fence: pieces[0].fence,
            });
        }
        let maps = self
            .maps
            .read()
            .expect("shm maps poisoned")
            .iter()
            .map(|(id, m)| (*id, (m.len, m.map.clone())))
            .collect();
        let remote = Arc::new(ShmRemote {
            maps,
            link: self.clone(),
        });
        run_batch(&self.me.memcpy, pieces, batch, remote)
    }

    fn is_alive(&self) -> bool {
        self.control.is_alive()
    }

    fn close(&self) {
        self.control.close();
    }
}
