//! The paged KV cache in device memory, with the host byte layout, a host mirror the transfer
//! engine can register, and CUDA IPC export/import.
//!
//! # Layout
//! One device region per layer, `[K|V][block][kv_head][slot_in_block][head_dim]`: exactly
//! [`KvLayout`] (see `layout.rs`), so `KvLayout::span` names the same bytes on the device, in
//! the host mirror and in a CPU peer's cache.
//!
//! # Moving device KV through the transfer engine
//! The engine registers host memory only. A rank that must serve or receive KV gets a
//! [`HostMirror`]: one host region per layer, allocated through the engine's
//! `HostMemoryAllocator` (so the engine registers it, shm/tcp/quic/rdma alike) and pinned with
//! `cuMemHostRegister` so copies to and from it are DMA:
//! - sending (prefill): after the forward pass wrote a layer's K/V, the touched blocks are
//!   copied device → mirror on the rank's stream and an event is recorded behind the copies.
//!   The layer is reported ready only once that event completed (the *device-side fence*): a
//!   peer never reads mirror bytes the GPU has not finished writing.
//! - receiving (decode): the transfer lands bytes in the mirror; [`DeviceKvCache::upload_blocks`]
//!   copies those blocks mirror → device on the same stream, ahead of any later forward pass, so
//!   the kernels of the next step see them without a host wait.
//!
//! # Two processes on one GPU
//! Regions are plain `cuMemAlloc` allocations (not stream-ordered pool memory), so
//! [`DeviceKvCache::ipc_handles`] can export them; a peer process opens them with
//! [`PeerDeviceKv::open`] and [`DeviceKvCache::copy_from_peer`] copies blocks device to device.

use super::context::{rt, GpuContext};
use super::layout::{block_runs, pair_runs, run_spans};
use crate::device::DeviceError;
use crate::kv::{KvLayout, KvSpan};
use cudarc::driver::{result as cu, sys};
use pdserve_runtime::memory::HostMemory;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// One layer's device allocation (`cuMemAlloc`, freed on drop).
#[derive(Debug)]
struct DeviceRegion {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

/// A CUDA IPC handle of one region, as another process on the same GPU opens it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcRegionHandle {
    /// The 64 bytes of `CUipcMemHandle`.
    pub handle: Vec<u8>,
    /// Length of the region in bytes.
    pub bytes: u64,
}

/// How a rank's KV mirror is used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MirrorMode {
    /// No host mirror (colocated serving: KV never leaves the GPU).
    #[default]
    Off,
    /// Written blocks are copied to the mirror after every layer (prefill: serve KV).
    WriteThrough,
    /// The mirror receives KV from peers; [`DeviceKvCache::upload_blocks`] moves it in (decode).
    Receive,
}

/// One host region per layer, registered by the transfer engine (through its allocator) and
/// pinned for DMA.
#[derive(Debug)]
pub struct HostMirror {
    regions: Vec<Arc<dyn HostMemory>>,
    pinned: Vec<bool>,
    mode: MirrorMode,
}

impl HostMirror {
    /// The regions, one per layer (what the transfer engine registered).
    pub fn regions(&self) -> &[Arc<dyn HostMemory>] {
        &self.regions
    }

    /// How many regions could be pinned (the rest copy through the driver's pageable path).
    pub fn pinned_count(&self) -> usize {
        self.pinned.iter().filter(|&&p| p).count()
    }

    /// The mode.
    pub fn mode(&self) -> MirrorMode {
        self.mode
    }
}

impl Drop for HostMirror {
    fn drop(&mut self) {
        for (r, &p) in self.regions.iter().zip(&self.pinned) {
            if p {
                // SAFETY: the region was registered in `DeviceKvCache::new` and is still mapped
                // (we hold an Arc of it).
                unsafe { sys::cuMemHostUnregister(r.as_ptr() as *mut _) };
            }
        }
    }
}

/// One rank's KV cache in device memory.
pub struct DeviceKvCache {
    gpu: Arc<GpuContext>,
    layout: KvLayout,
    regions: Vec<DeviceRegion>,
    mirror: Option<HostMirror>,
}

impl std::fmt::Debug for DeviceKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvCache")
            .field("layout", &self.layout)
            .field("mirror", &self.mirror.as_ref().map(|m| m.mode))
            .finish()
    }
}

impl DeviceKvCache {
    /// Allocates (and zeroes) one device region per layer. With a mirror, `hosts` are its
    /// regions, one per layer of at least [`KvLayout::region_bytes`] (allocated by the caller
    /// through the transfer engine's allocator, so the engine knows them); they are pinned here.
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] when device memory runs out; [`DeviceError::Unsupported`]
    /// for an empty layout or mirror regions that do not fit it.
    pub fn new(
        gpu: Arc<GpuContext>,
        layout: KvLayout,
        mirror: Option<(MirrorMode, Vec<Arc<dyn HostMemory>>)>,
    ) -> Result<Self, DeviceError> {
        if layout.num_blocks == 0 || layout.block_size == 0 {
            return Err(DeviceError::Unsupported(
                "a KV cache needs at least one block".into(),
            ));
        }
        if layout.dtype == crate::kv::KvDtype::Bf16 {
            return Err(DeviceError::Unsupported(
                "the CUDA backend keeps its KV cache in f32 or f16, not bf16".into(),
            ));
        }
        gpu.context().bind_to_thread().map_err(rt("bind context"))?;
        let mut regions = Vec::with_capacity(layout.num_layers);
        for _ in 0..layout.num_layers {
            let bytes = layout.region_bytes();
            // SAFETY: plain allocation; freed in Drop (the region is pushed at once).
            let ptr = unsafe { cu::malloc_sync(bytes) }.map_err(rt("alloc KV region"))?;
            regions.push(DeviceRegion { ptr, bytes });
            // SAFETY: `ptr` is a live allocation of `bytes` bytes.
            unsafe { cu::memset_d8_sync(ptr, 0, bytes) }.map_err(rt("zero KV region"))?;
        }
        let mut this = Self {
            gpu,
            layout,
            regions,
            mirror: None,
        };
        if let Some((mode, hosts)) = mirror.filter(|(m, _)| *m != MirrorMode::Off) {
            if hosts.len() != layout.num_layers
                || hosts.iter().any(|h| h.len() < layout.region_bytes())
            {
                return Err(DeviceError::Unsupported(
                    "KV host mirror regions do not fit the layout".into(),
                ));
            }
            let mut pinned = Vec::new();
            for mem in &hosts {
                // SAFETY: the region is mapped for `len` bytes while `mem` lives; it is
                // unregistered in HostMirror's Drop, which holds `mem`.
                let rc = unsafe {
                    sys::cuMemHostRegister_v2(
                        mem.as_ptr() as *mut _,
                        mem.len(),
                        sys::CU_MEMHOSTREGISTER_PORTABLE,
                    )
                };
                if rc != sys::CUresult::CUDA_SUCCESS {
                    tracing::warn!(?rc, "KV mirror not pinned: copies take the slow path");
                }
                pinned.push(rc == sys::CUresult::CUDA_SUCCESS);
            }
            this.mirror = Some(HostMirror {
                regions: hosts,
                pinned,
                mode,
            });
        }
        Ok(this)
    }

    /// The layout (the CPU backend's).
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The host mirror, if any.
    pub fn mirror(&self) -> Option<&HostMirror> {
        self.mirror.as_ref()
    }

    /// Device address of layer `layer`'s region (a kernel argument).
    pub fn region_ptr(&self, layer: usize) -> u64 {
        self.regions[layer].ptr
    }

    fn mirror_or_err(&self) -> Result<&HostMirror, DeviceError> {
        self.mirror.as_ref().ok_or_else(|| {
            DeviceError::Unsupported("this rank's KV cache has no host mirror".into())
        })
    }

    /// Enqueues device → mirror copies of `blocks` of `layer` (K and V, all heads) on the
    /// rank's stream. Completion is observed through an event recorded afterwards.
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] without a mirror; [`DeviceError::Runtime`].
    pub fn copy_to_mirror(&self, layer: usize, blocks: &[u32]) -> Result<(), DeviceError> {
        let mirror = self.mirror_or_err()?;
        let stream = self.gpu.stream().cu_stream();
        for run in block_runs(blocks) {
            for span in run_spans(&self.layout, layer, &run) {
                let host = &mirror.regions[layer];
                assert!(span.offset + span.len <= host.len());
                // SAFETY: both ranges lie inside their regions (asserted; the device region
                // has the same length); the host region outlives the copy because the mirror
                // is only dropped with the cache, after the stream is synchronized.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        host.as_ptr().add(span.offset) as *mut _,
                        self.regions[layer].ptr + span.offset as u64,
                        span.len,
                        stream,
                    )
                }
                .result()
                .map_err(rt("copy KV to host mirror"))?;
            }
        }
        Ok(())
    }

    /// Enqueues mirror → device copies of `blocks` for every layer (after a transfer landed
    /// them in the mirror). Kernels queued later on the rank's stream see the blocks.
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] without a mirror; [`DeviceError::Runtime`].
    pub fn upload_blocks(&self, blocks: &[u32]) -> Result<(), DeviceError> {
        let mirror = self.mirror_or_err()?;
        if let Some(&b) = blocks
            .iter()
            .find(|&&b| b as usize >= self.layout.num_blocks)
        {
            return Err(DeviceError::Unsupported(format!(
                "block id {b} out of range"
            )));
        }
        let stream = self.gpu.stream().cu_stream();
        let runs = block_runs(blocks);
        for layer in 0..self.layout.num_layers {
            for run in &runs {
                for span in run_spans(&self.layout, layer, run) {
                    let host = &mirror.regions[layer];
                    // SAFETY: as in copy_to_mirror, the other direction.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            self.regions[layer].ptr + span.offset as u64,
                            host.as_ptr().add(span.offset) as *const _,
                            span.len,
                            stream,
                        )
                    }
                    .result()
                    .map_err(rt("copy KV from host mirror"))?;
                }
            }
        }
        Ok(())
    }

    /// Reads a span of device KV to the host (waits for the stream first).
    ///
    /// # Errors
    /// [`DeviceError::Runtime`]; [`DeviceError::Unsupported`] for a span out of range.
    pub fn read_span(&self, span: KvSpan) -> Result<Vec<u8>, DeviceError> {
        let region = self
            .regions
            .get(span.region)
            .filter(|r| span.offset + span.len <= r.bytes)
            .ok_or_else(|| DeviceError::Unsupported(format!("span {span:?} out of range")))?;
        self.gpu.synchronize()?;
        let mut out = vec![0u8; span.len];
        // SAFETY: in range (checked); synchronous copy into a buffer of `len` bytes.
        unsafe { cu::memcpy_dtoh_sync(&mut out, region.ptr + span.offset as u64) }
            .map_err(rt("read KV span"))?;
        Ok(out)
    }

    /// Writes bytes into a span of device KV (synchronous; tests and tools).
    ///
    /// # Errors
    /// As [`DeviceKvCache::read_span`].
    pub fn write_span(&self, span: KvSpan, bytes: &[u8]) -> Result<(), DeviceError> {
        let region = self
            .regions
            .get(span.region)
            .filter(|r| span.offset + span.len <= r.bytes && bytes.len() == span.len)
            .ok_or_else(|| DeviceError::Unsupported(format!("span {span:?} out of range")))?;
        self.gpu.synchronize()?;
        // SAFETY: in range (checked).
        unsafe { cu::memcpy_htod_sync(region.ptr + span.offset as u64, bytes) }
            .map_err(rt("write KV span"))
    }

    /// CUDA IPC handles of every region, for a process on the same GPU.
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] when the driver refuses (IPC unsupported on this system).
    pub fn ipc_handles(&self) -> Result<Vec<IpcRegionHandle>, DeviceError> {
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(rt("bind context"))?;
        self.regions
            .iter()
            .map(|r| {
                let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
                // SAFETY: `r.ptr` is the base of a cuMemAlloc allocation; `h` is written.
                unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), r.ptr) }
                    .result()
                    .map_err(rt("export IPC handle"))?;
                // SAFETY: initialized by the successful call above.
                let h = unsafe { h.assume_init() };
                Ok(IpcRegionHandle {
                    handle: h.reserved.iter().map(|&b| b as u8).collect(),
                    bytes: r.bytes as u64,
                })
            })
            .collect()
    }

    /// Copies blocks from a peer process's cache on the same GPU: `pairs` are
    /// `(peer block, own block)`, all layers, K and V, on the rank's stream.
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] for a peer of another layout or block ids out of range;
    /// [`DeviceError::Runtime`].
    pub fn copy_from_peer(
        &self,
        peer: &PeerDeviceKv,
        pairs: &[(u32, u32)],
    ) -> Result<(), DeviceError> {
        let (a, b) = (&peer.layout, &self.layout);
        if (
            a.num_layers,
            a.block_size,
            a.num_kv_heads,
            a.head_dim,
            a.dtype,
        ) != (
            b.num_layers,
            b.block_size,
            b.num_kv_heads,
            b.head_dim,
            b.dtype,
        ) {
            return Err(DeviceError::Unsupported(format!(
                "peer KV layout {a:?} does not match {b:?}"
            )));
        }
        if let Some(p) = pairs
            .iter()
            .find(|(s, d)| *s as usize >= a.num_blocks || *d as usize >= b.num_blocks)
        {
            return Err(DeviceError::Unsupported(format!(
                "block pair {p:?} out of range"
            )));
        }
        let stream = self.gpu.stream().cu_stream();
        for layer in 0..b.num_layers {
            for (s, d, n) in pair_runs(pairs) {
                let src = run_spans(a, layer, &(s..s + n));
                let dst = run_spans(b, layer, &(d..d + n));
                for (s, d) in src.iter().zip(&dst) {
                    // SAFETY: both spans are inside their regions (ids checked above, layouts
                    // equal but for the block count, which each side's span accounts for).
                    unsafe {
                        sys::cuMemcpyDtoDAsync_v2(
                            self.regions[layer].ptr + d.offset as u64,
                            peer.ptrs[layer] + s.offset as u64,
                            s.len,
                            stream,
                        )
                    }
                    .result()
                    .map_err(rt("copy KV from peer"))?;
                }
            }
        }
        Ok(())
    }
}

impl Drop for DeviceKvCache {
    fn drop(&mut self) {
        // Nothing queued may still read or write the regions.
        let _ = self.gpu.synchronize();
        for r in &self.regions {
            // SAFETY: allocated by cuMemAlloc in `new`, freed once.
            unsafe {
                let _ = cu::free_sync(r.ptr);
            }
        }
    }
}

/// A peer process's KV regions on the same GPU, opened from its IPC handles.
pub struct PeerDeviceKv {
    gpu: Arc<GpuContext>,
    layout: KvLayout,
    ptrs: Vec<sys::CUdeviceptr>,
}

impl std::fmt::Debug for PeerDeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerDeviceKv")
            .field("layout", &self.layout)
            .finish()
    }
}

impl PeerDeviceKv {
    /// Opens the peer's regions. `layout` is the peer's layout (from the handshake).
    ///
    /// # Errors
    /// [`DeviceError::Unsupported`] when the handles do not match the layout;
    /// [`DeviceError::Runtime`] when the driver cannot open them (another GPU, peer gone).
    pub fn open(
        gpu: Arc<GpuContext>,
        layout: KvLayout,
        handles: &[IpcRegionHandle],
    ) -> Result<Self, DeviceError> {
        if handles.len() != layout.num_layers
            || handles
                .iter()
                .any(|h| h.handle.len() != 64 || h.bytes as usize != layout.region_bytes())
        {
            return Err(DeviceError::Unsupported(
                "IPC handles do not match the peer's KV layout".into(),
            ));
        }
        gpu.context().bind_to_thread().map_err(rt("bind context"))?;
        let mut this = Self {
            gpu,
            layout,
            ptrs: Vec::new(),
        };
        for h in handles {
            let mut raw: sys::CUipcMemHandle = unsafe_zeroed_handle();
            for (d, s) in raw.reserved.iter_mut().zip(&h.handle) {
                *d = *s as _;
            }
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: `raw` holds a handle exported by cuIpcGetMemHandle; `ptr` is written.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    raw,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            }
            .result()
            .map_err(rt("open IPC handle"))?;
            this.ptrs.push(ptr);
        }
        Ok(this)
    }
}

fn unsafe_zeroed_handle() -> sys::CUipcMemHandle {
    // SAFETY: CUipcMemHandle is 64 plain bytes; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

impl Drop for PeerDeviceKv {
    fn drop(&mut self) {
        let _ = self.gpu.synchronize();
        for &p in &self.ptrs {
            // SAFETY: opened by cuIpcOpenMemHandle, closed once.
            unsafe { sys::cuIpcCloseMemHandle(p) };
        }
    }
}
