//! Registered memory: shared-memory regions a peer process can map, the registry of regions an
//! engine exposes, and the descriptors peers exchange.
//!
//! A [`RegisteredRegion`] is the caller's handle on one registration; dropping it deregisters
//! the region (and releases any backend registration, such as RDMA memory regions). Operations
//! that are in flight keep the memory itself alive until they finish, because the registry
//! hands out `Arc`s of its entries.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator, PAGE_SIZE};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};

use crate::error::{Result, Side, TransportError};

/// An engine-local region id.
pub type RegionId = u64;

/// Shared memory backed by a memfd: the `shm` backend's memory, mappable by a peer process on
/// the same host through `/proc/PID/fd/FD`.
#[derive(Debug)]
pub struct ShmMemory {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    inode: u64,
}

// SAFETY: the mapping is plain shared memory; the pointer is only an address.
unsafe impl Send for ShmMemory {}
// SAFETY: as above; concurrent access to the bytes is coordinated by users (see HostMemory).
unsafe impl Sync for ShmMemory {}

/// Live shared memory of this process, by start address: (memfd, inode, length).
type ShareableMap = Mutex<HashMap<usize, (i32, u64, usize)>>;

fn shareable_registry() -> &'static ShareableMap {
    static REG: OnceLock<ShareableMap> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

impl ShmMemory {
    /// Creates a zeroed shared-memory region of at least `len` bytes (rounded up to a page).
    ///
    /// # Errors
    /// The OS error of `memfd_create`, `ftruncate`, `fstat` or `mmap`.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let len = len.max(1).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        // SAFETY: the name is a valid C string; flags are valid.
        let raw = unsafe { libc::memfd_create(c"pdserve-region".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let inode = fd_inode(fd.as_raw_fd())?;
        let ptr = map_shared(fd.as_raw_fd(), len)?;
        shareable_registry()
            .lock()
            .expect("shareable registry poisoned")
            .insert(ptr as usize, (fd.as_raw_fd(), inode, len));
        Ok(Self {
            fd,
            ptr,
            len,
            inode,
        })
    }

    /// The handle a peer on this host uses to map this memory.
    pub fn handle(&self) -> ShmHandle {
        ShmHandle {
            pid: std::process::id(),
            fd: self.fd.as_raw_fd(),
            inode: self.inode,
        }
    }
}

impl Drop for ShmMemory {
    fn drop(&mut self) {
        shareable_registry()
            .lock()
            .expect("shareable registry poisoned")
            .remove(&(self.ptr as usize));
        // SAFETY: `ptr`/`len` are the mapping created in `new`, unmapped exactly once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// SAFETY: a MAP_SHARED mapping of `len` bytes, page-aligned, fixed until drop.
unsafe impl HostMemory for ShmMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Hands out [`ShmMemory`]: the allocator to use for a KV cache served over `shm`.
#[derive(Debug, Default, Clone, Copy)]
pub struct ShmAllocator;

impl HostMemoryAllocator for ShmAllocator {
    fn allocate(&self, len: usize) -> std::io::Result<Arc<dyn HostMemory>> {
        Ok(Arc::new(ShmMemory::new(len)?))
    }
}

/// The shared-memory handle of `mem` if it was allocated by [`ShmAllocator`] (or is
/// [`ShmMemory`]) and is still alive; `None` for memory no peer can map.
pub fn shm_handle_of(mem: &dyn HostMemory) -> Option<ShmHandle> {
    let reg = shareable_registry()
        .lock()
        .expect("shareable registry poisoned");
    let &(fd, inode, len) = reg.get(&(mem.as_ptr() as usize))?;
    (len == mem.len()).then(|| ShmHandle {
        pid: std::process::id(),
        fd,
        inode,
    })
}

fn fd_inode(fd: i32) -> std::io::Result<u64> {
    // SAFETY: `st` is written by fstat before being read.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.st_ino as u64)
}

fn map_shared(fd: i32, len: usize) -> std::io::Result<*mut u8> {
    // SAFETY: mapping a file descriptor we hold, with a fresh address chosen by the kernel.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ptr.cast())
}

/// A peer's shared-memory region mapped into this process.
#[derive(Debug)]
pub(crate) struct RemoteShmMapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: see ShmMemory.
unsafe impl Send for RemoteShmMapping {}
// SAFETY: see ShmMemory.
unsafe impl Sync for RemoteShmMapping {}

/// The name every region of [`ShmMemory`] carries (`/memfd:NAME (deleted)` in `/proc`).
const MEMFD_NAME: &str = "pdserve-region";

impl RemoteShmMapping {
    /// Maps the peer region described by `handle`: only a pdserve memfd held by the process
    /// at the other end of the control connection `ends` (local, peer), of the size the
    /// descriptor says. A handle naming any other process or file — a peer pointing us at
    /// memory that is not its own — is refused, and the refusal tells nothing about the file.
    pub(crate) fn open(
        handle: &ShmHandle,
        len: u64,
        ends: (std::net::SocketAddr, std::net::SocketAddr),
    ) -> Result<Self> {
        let refuse = |why: &str| {
            TransportError::LayoutMismatch(format!(
                "the peer's region descriptor (pid {}, fd {}) {why}",
                handle.pid, handle.fd
            ))
        };
        if !crate::backend::peer_proc::holds_peer_socket(handle.pid, ends) {
            return Err(refuse(
                "names a process that does not hold the other end of our connection",
            ));
        }
        let path = format!("/proc/{}/fd/{}", handle.pid, handle.fd);
        if !is_our_memfd(std::path::Path::new(&path)) {
            return Err(refuse("is not a pdserve shared-memory region"));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(&path)
            .map_err(|_| refuse("cannot be opened"))?;
        // What was opened, not what the name said a moment before.
        let opened = format!("/proc/self/fd/{}", file.as_raw_fd());
        if !is_our_memfd(std::path::Path::new(&opened))
            || fd_inode(file.as_raw_fd())? != handle.inode
            || file.metadata()?.len() < len
        {
            return Err(refuse("does not match the region it describes"));
        }
        let len = usize::try_from(len)
            .map_err(|_| TransportError::LayoutMismatch("region too large".into()))?;
        let ptr = map_shared(file.as_raw_fd(), len.max(1))?;
        Ok(Self {
            ptr,
            len: len.max(1),
        })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// Whether the descriptor link `fd_path` (`/proc/PID/fd/N`) is a memfd of [`ShmMemory`].
fn is_our_memfd(fd_path: &std::path::Path) -> bool {
    std::fs::read_link(fd_path).is_ok_and(|t| {
        t.to_str()
            .and_then(|t| t.strip_prefix("/memfd:"))
            .is_some_and(|name| name == MEMFD_NAME || name == format!("{MEMFD_NAME} (deleted)"))
    })
}

impl Drop for RemoteShmMapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Backend state attached to a registration (RDMA memory regions); dropped on deregistration.
pub(crate) type BackendRegistration = Box<dyn std::any::Any + Send + Sync>;

/// One registered region as the engine sees it.
#[derive(Debug)]
pub(crate) struct RegionEntry {
    pub(crate) id: RegionId,
    pub(crate) mem: Arc<dyn HostMemory>,
    pub(crate) descriptor: RegionDescriptor,
    #[allow(dead_code)] // held for its Drop (RDMA deregistration)
    pub(crate) backend: Option<BackendRegistrationHolder>,
}

/// Holds backend registration state; a newtype so `RegionEntry` can derive `Debug`.
pub(crate) struct BackendRegistrationHolder(#[allow(dead_code)] pub(crate) BackendRegistration);

impl std::fmt::Debug for BackendRegistrationHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BackendRegistration")
    }
}

impl RegionEntry {
    pub(crate) fn len(&self) -> u64 {
        self.mem.len() as u64
    }

    /// Checks that `offset..offset+len` lies inside the region.
    pub(crate) fn check(&self, side: Side, offset: u64, len: u64) -> Result<()> {
        check_range(side, self.id, offset, len, self.len())
    }

    /// Raw pointer to byte `offset`. The caller has checked the range.
    pub(crate) fn ptr_at(&self, offset: u64) -> *mut u8 {
        // SAFETY (of later use): callers check `offset` against the length first.
        self.mem.as_ptr().wrapping_add(offset as usize)
    }
}

pub(crate) fn check_range(
    side: Side,
    id: u64,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransportError::OutOfBounds {
            side,
            id,
            offset,
            len,
            region_len,
        }),
    }
}

/// The regions one engine exposes.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    regions: RwLock<HashMap<RegionId, Arc<RegionEntry>>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Registry {
    pub(crate) fn new() -> Self {
        Self {
            regions: RwLock::new(HashMap::new()),
            next_id: std::sync::atomic::AtomicU64::new(1),
        }
    }

    pub(crate) fn next_id(&self) -> RegionId {
        self.next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn insert(&self, entry: Arc<RegionEntry>) {
        self.regions
            .write()
            .expect("registry poisoned")
            .insert(entry.id, entry);
    }

    pub(crate) fn remove(&self, id: RegionId) {
        self.regions.write().expect("registry poisoned").remove(&id);
    }

    pub(crate) fn get(&self, side: Side, id: RegionId) -> Result<Arc<RegionEntry>> {
        self.regions
            .read()
            .expect("registry poisoned")
            .get(&id)
            .cloned()
            .ok_or(TransportError::UnknownRegion { side, id })
    }

    pub(crate) fn descriptors(&self) -> Vec<RegionDescriptor> {
        let mut all: Vec<_> = self
            .regions
            .read()
            .expect("registry poisoned")
            .values()
            .map(|e| e.descriptor.clone())
            .collect();
        all.sort_by_key(|d| d.id);
        all
    }
}

/// Splits `len` bytes into registration chunks of at most `max` bytes.
pub(crate) fn plain_chunks(len: u64, max: Option<u64>) -> Vec<RegionChunk> {
    let max = max.unwrap_or(len).max(1);
    let mut chunks = Vec::new();
    let mut offset = 0;
    while offset < len {
        let n = max.min(len - offset);
        chunks.push(RegionChunk {
            offset,
            len: n,
            addr: 0,
            rkey: 0,
        });
        offset += n;
    }
    chunks
}

/// Checks that a peer's descriptors are self-consistent: unique ids, chunks covering `0..len`
/// in order.
///
/// # Errors
/// [`TransportError::LayoutMismatch`] naming the first inconsistency.
pub fn validate_descriptors(regions: &[RegionDescriptor]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for d in regions {
        if !seen.insert(d.id) {
            return Err(TransportError::LayoutMismatch(format!(
                "region {} listed twice",
                d.id
            )));
        }
        if d.len == 0 {
            return Err(TransportError::LayoutMismatch(format!(
                "region {} is empty",
                d.id
            )));
        }
        let mut expect = 0u64;
        for c in &d.chunks {
            if c.offset != expect || c.len == 0 {
                return Err(TransportError::LayoutMismatch(format!(
                    "region {}: chunk at {} does not continue at {expect}",
                    d.id, c.offset
                )));
            }
            expect = c.offset.checked_add(c.len).ok_or_else(|| {
                TransportError::LayoutMismatch(format!("region {}: chunk length overflows", d.id))
            })?;
        }
        if expect != d.len {
            return Err(TransportError::LayoutMismatch(format!(
                "region {}: chunks cover {expect} of {} bytes",
                d.id, d.len
            )));
        }
    }
    Ok(())
}

/// The caller's handle on one registration. Dropping it deregisters the region: later
/// operations naming its id fail with [`TransportError::UnknownRegion`].
#[derive(Debug)]
pub struct RegisteredRegion {
    pub(crate) entry: Arc<RegionEntry>,
    pub(crate) registry: Weak<Registry>,
}

impl RegisteredRegion {
    /// The region id to name in transfer operations.
    pub fn id(&self) -> RegionId {
        self.entry.id
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.entry.len()
    }

    /// Whether the region is empty (never, for a registered region).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The descriptor a peer needs to reach this region.
    pub fn descriptor(&self) -> &RegionDescriptor {
        &self.entry.descriptor
    }

    /// The registered memory.
    pub fn memory(&self) -> &Arc<dyn HostMemory> {
        &self.entry.mem
    }

    /// Copies `data` into the region at `offset` (a convenience for tests and tools; the KV
    /// cache writes through its own pointers).
    ///
    /// # Errors
    /// [`TransportError::OutOfBounds`] when the range does not fit.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.entry.check(Side::Local, offset, data.len() as u64)?;
        // SAFETY: range checked; the memory lives while `entry` does.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.entry.ptr_at(offset), data.len())
        };
        Ok(())
    }

    /// Copies `len` bytes at `offset` out of the region.
    ///
    /// # Errors
    /// [`TransportError::OutOfBounds`] when the range does not fit.
    pub fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.entry.check(Side::Local, offset, len as u64)?;
        let mut out = vec![0u8; len];
        // SAFETY: range checked; the memory lives while `entry` does.
        unsafe { std::ptr::copy_nonoverlapping(self.entry.ptr_at(offset), out.as_mut_ptr(), len) };
        Ok(out)
    }
}

impl Drop for RegisteredRegion {
    fn drop(&mut self) {
        if let Some(registry) = self.registry.upgrade() {
            registry.remove(self.entry.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_runtime::memory::AnonAllocator;

    #[test]
    fn shm_memory_is_shareable_and_anon_is_not() {
        let shm = ShmAllocator.allocate(10_000).unwrap();
        assert_eq!(shm.len(), 12_288);
        let handle = shm_handle_of(&*shm).expect("shm memory is shareable");
        assert_eq!(handle.pid, std::process::id());
        let anon = AnonAllocator.allocate(4096).unwrap();
        assert!(shm_handle_of(&*anon).is_none());
        // A second mapping of the same memfd sees the same bytes (this process holds both
        // ends of the connection, so it is the peer).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let _server = listener.accept().unwrap();
        let ends = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let map = RemoteShmMapping::open(&handle, shm.len() as u64, ends).unwrap();
        // SAFETY: both spans are valid for 12288 bytes.
        unsafe {
            *shm.as_ptr().add(100) = 42;
            assert_eq!(*map.as_ptr().add(100), 42);
        }
        let ptr = shm.as_ptr() as usize;
        drop(shm);
        assert!(!shareable_registry().lock().unwrap().contains_key(&ptr));
    }

    /// A peer cannot point us at memory that is not its own: a handle naming another
    /// process, or a file that is not a pdserve region, is refused without a word about it.
    #[test]
    fn a_handle_is_mapped_only_for_the_peer_and_only_as_a_region() {
        let shm = ShmAllocator.allocate(4096).unwrap();
        let handle = shm_handle_of(&*shm).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let _server = listener.accept().unwrap();
        let ends = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        // Another process (PID 1) as the owner: it does not hold our connection's other end.
        let foreign = ShmHandle { pid: 1, ..handle };
        let e = RemoteShmMapping::open(&foreign, 4096, ends).unwrap_err();
        assert!(e.to_string().contains("does not hold the other end"), "{e}");
        // A file of the peer that is not a region (a plain file, open read-write here).
        let file = tempfile::tempfile().unwrap();
        let not_region = ShmHandle {
            fd: file.as_raw_fd(),
            inode: fd_inode(file.as_raw_fd()).unwrap(),
            ..handle
        };
        let e = RemoteShmMapping::open(&not_region, 1, ends).unwrap_err();
        assert!(
            e.to_string().contains("not a pdserve shared-memory region"),
            "{e}"
        );
        assert!(
            !e.to_string().contains(&not_region.inode.to_string()),
            "{e}"
        );
        // The region itself, with the wrong inode or a size it does not have.
        let wrong = ShmHandle {
            inode: handle.inode + 1,
            ..handle
        };
        let e = RemoteShmMapping::open(&wrong, 4096, ends).unwrap_err();
        assert!(!e.to_string().contains(&handle.inode.to_string()), "{e}");
        assert!(RemoteShmMapping::open(&handle, 1 << 30, ends).is_err());
        RemoteShmMapping::open(&handle, 4096, ends).unwrap();
    }

    #[test]
    fn descriptor_validation_catches_gaps_and_duplicates() {
        let good = RegionDescriptor {
            id: 1,
            len: 10,
            chunks: plain_chunks(10, Some(4)),
            shm: None,
        };
        assert_eq!(good.chunks.len(), 3);
        validate_descriptors(std::slice::from_ref(&good)).unwrap();
        assert!(validate_descriptors(&[good.clone(), good.clone()]).is_err());
        let mut gap = good.clone();
        gap.chunks.remove(1);
        assert!(matches!(
            validate_descriptors(&[gap]),
            Err(TransportError::LayoutMismatch(_))
        ));
        let mut short = good;
        short.len = 11;
        assert!(validate_descriptors(&[short]).is_err());
    }
}
