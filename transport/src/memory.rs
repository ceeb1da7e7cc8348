//! Registered memory: shared-memory regions a peer process can map, the registry of regions an
//! engine exposes, and the descriptors peers exchange.
//!
//! A [`RegisteredRegion`] is the caller's handle on one registration; dropping it deregisters
//! the region (and releases any backend registration, such as RDMA memory regions). Operations
//! that are in flight keep the memory itself alive until they finish, because the registry
//! hands out `Arc`s of its entries.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use pdserve_runtime::memory::{HostMemory, HostMemoryAllocator, PAGE_SIZE};
use pdserve_runtime::wire::{RegionChunk, RegionDescriptor, ShmHandle};

use crate::error::{Result, Side, TransportError};

/// An engine-local region id.
pub type RegionId = u64;

/// Shared memory backed by a memfd: the `shm` backend's memory. A peer process on the same
/// host receives the memfd itself from this process's descriptor server
/// ([`crate::backend::fd_pass`]) and maps it.
#[derive(Debug)]
pub struct ShmMemory {
    ptr: *mut u8,
    len: usize,
    key: u64,
    socket: &'static str,
}

// SAFETY: the mapping is plain shared memory; the pointer is only an address.
unsafe impl Send for ShmMemory {}
// SAFETY: as above; concurrent access to the bytes is coordinated by users (see HostMemory).
unsafe impl Sync for ShmMemory {}

/// One live region of [`ShmMemory`] in this process.
struct Shareable {
    fd: Arc<OwnedFd>,
    len: usize,
    ptr: usize,
}

/// Live shared memory of this process: by key, and the key of each start address.
#[derive(Default)]
struct ShareableMap {
    by_key: HashMap<u64, Shareable>,
    key_of: HashMap<usize, u64>,
    next_key: u64,
}

fn shareable_registry() -> &'static Mutex<ShareableMap> {
    static REG: OnceLock<Mutex<ShareableMap>> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(ShareableMap::default()))
}

/// The memfd and length of this process's live region `key` (what the descriptor server
/// passes to a peer).
fn shareable_fd(key: u64) -> Option<(Arc<OwnedFd>, usize)> {
    let reg = shareable_registry()
        .lock()
        .expect("shareable registry poisoned");
    reg.by_key.get(&key).map(|s| (s.fd.clone(), s.len))
}

impl ShmMemory {
    /// Creates a zeroed shared-memory region of at least `len` bytes (rounded up to a page),
    /// starting this process's descriptor server on first use.
    ///
    /// # Errors
    /// The OS error of `memfd_create`, `ftruncate`, `mmap` or of starting the server.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let socket = crate::backend::fd_pass::serve(shareable_fd)?;
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
        let ptr = map_shared(fd.as_raw_fd(), len)?;
        let mut reg = shareable_registry()
            .lock()
            .expect("shareable registry poisoned");
        let key = reg.next_key;
        reg.next_key += 1;
        reg.key_of.insert(ptr as usize, key);
        reg.by_key.insert(
            key,
            Shareable {
                fd: Arc::new(fd),
                len,
                ptr: ptr as usize,
            },
        );
        Ok(Self {
            ptr,
            len,
            key,
            socket,
        })
    }

    /// The handle a peer on this host uses to ask for this memory (its ticket is issued with
    /// each answer that carries it).
    pub fn handle(&self) -> ShmHandle {
        ShmHandle {
            socket: self.socket.to_owned(),
            key: self.key,
            ticket: [0; 16],
        }
    }
}

impl Drop for ShmMemory {
    fn drop(&mut self) {
        {
            let mut reg = shareable_registry()
                .lock()
                .expect("shareable registry poisoned");
            reg.by_key.remove(&self.key);
            reg.key_of.remove(&(self.ptr as usize));
        }
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
    let socket = crate::backend::fd_pass::serve(shareable_fd).ok()?;
    let reg = shareable_registry()
        .lock()
        .expect("shareable registry poisoned");
    let key = *reg.key_of.get(&(mem.as_ptr() as usize))?;
    let s = reg.by_key.get(&key)?;
    (s.len == mem.len() && s.ptr == mem.as_ptr() as usize).then(|| ShmHandle {
        socket: socket.to_owned(),
        key,
        ticket: [0; 16],
    })
}

/// Issues one ticket for the shared-memory regions among `regions` (an answer to a peer's
/// `GET_REGIONS`) and writes it into their handles.
///
/// # Errors
/// The OS random source failed.
pub(crate) fn stamp_shm_tickets(regions: &mut [RegionDescriptor]) -> Result<()> {
    let keys: std::collections::HashSet<u64> = regions
        .iter()
        .filter_map(|d| d.shm.as_ref().map(|h| h.key))
        .collect();
    if keys.is_empty() {
        return Ok(());
    }
    let ticket = crate::backend::fd_pass::issue_ticket(keys)?;
    for h in regions.iter_mut().filter_map(|d| d.shm.as_mut()) {
        h.ticket = ticket;
    }
    Ok(())
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
    /// Receives the peer's regions `(handle, len)` from its descriptor server and maps them.
    /// The server must run as our uid in the process at the other end of the control
    /// connection `ends` (local, peer), and each descriptor it passes must be a pdserve memfd
    /// of at least the described size: a peer that points us at memory that is not its own
    /// gets nothing mapped, and the refusal tells nothing about what it named.
    ///
    /// Blocking (a Unix socket round trip per region): call it off the async threads.
    pub(crate) fn receive(
        regions: &[(&ShmHandle, u64)],
        ends: (std::net::SocketAddr, std::net::SocketAddr),
    ) -> Result<Vec<Self>> {
        let Some((first, _)) = regions.first() else {
            return Ok(Vec::new());
        };
        if regions
            .iter()
            .any(|(h, _)| h.socket != first.socket || h.ticket != first.ticket)
        {
            return Err(TransportError::LayoutMismatch(
                "the peer's regions name more than one descriptor server".into(),
            ));
        }
        let keys: Vec<u64> = regions.iter().map(|(h, _)| h.key).collect();
        let fds = crate::backend::fd_pass::fetch(&first.socket, &first.ticket, &keys, |pid| {
            crate::backend::peer_proc::holds_peer_socket(pid, ends)
        })?;
        fds.into_iter()
            .zip(regions)
            .map(|(fd, &(h, len))| Self::map(fd, h.key, len))
            .collect()
    }

    fn map(fd: OwnedFd, key: u64, len: u64) -> Result<Self> {
        let opened = format!("/proc/self/fd/{}", fd.as_raw_fd());
        if !is_our_memfd(std::path::Path::new(&opened)) {
            return Err(TransportError::LayoutMismatch(format!(
                "the peer passed something other than a pdserve shared-memory region for key {key}"
            )));
        }
        // SAFETY: `st` is written by fstat before being read.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and out pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        if (st.st_size as u64) < len {
            return Err(TransportError::LayoutMismatch(format!(
                "the peer's region for key {key} is smaller than it describes"
            )));
        }
        let len = usize::try_from(len)
            .map_err(|_| TransportError::LayoutMismatch("region too large".into()))?;
        let ptr = map_shared(fd.as_raw_fd(), len.max(1))?;
        Ok(Self {
            ptr,
            len: len.max(1),
        })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// Whether the descriptor link `fd_path` (`/proc/self/fd/N`) is a memfd of [`ShmMemory`].
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
        if let Some(h) = &d.shm {
            crate::backend::fd_pass::check_socket_name(&h.socket)?;
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

    /// A loopback connection of this process with itself: (local, peer) of its client end.
    fn own_connection() -> (
        (std::net::SocketAddr, std::net::SocketAddr),
        [std::net::TcpStream; 2],
    ) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let ends = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        (ends, [client, server])
    }

    fn ticketed(mem: &dyn HostMemory) -> ShmHandle {
        let mut d = [RegionDescriptor {
            id: 1,
            len: mem.len() as u64,
            chunks: plain_chunks(mem.len() as u64, None),
            shm: shm_handle_of(mem),
        }];
        stamp_shm_tickets(&mut d).unwrap();
        d[0].shm.take().unwrap()
    }

    #[test]
    fn shm_memory_is_shareable_and_anon_is_not() {
        let shm = ShmAllocator.allocate(10_000).unwrap();
        assert_eq!(shm.len(), 12_288);
        let handle = ticketed(&*shm);
        assert!(handle
            .socket
            .starts_with(crate::backend::fd_pass::SOCKET_PREFIX));
        assert_ne!(handle.ticket, [0; 16]);
        let anon = AnonAllocator.allocate(4096).unwrap();
        assert!(shm_handle_of(&*anon).is_none());
        // A second mapping of the memfd the descriptor server passed sees the same bytes
        // (this process holds both ends of the connection, so it is the peer).
        let (ends, _conn) = own_connection();
        let map = RemoteShmMapping::receive(&[(&handle, shm.len() as u64)], ends)
            .unwrap()
            .pop()
            .unwrap();
        // SAFETY: both spans are valid for 12288 bytes.
        unsafe {
            *shm.as_ptr().add(100) = 42;
            assert_eq!(*map.as_ptr().add(100), 42);
        }
        let key = handle.key;
        drop(shm);
        assert!(shareable_fd(key).is_none());
        // A region dropped since is not passed any more, ticket or not.
        let e = RemoteShmMapping::receive(&[(&handle, 4096)], ends).unwrap_err();
        assert!(e.to_string().contains("no longer shares"), "{e}");
    }

    /// A peer cannot point us at memory that is not its own: a descriptor server of another
    /// process, a region its ticket does not cover, a forged ticket or a size the region
    /// does not have are all refused, and nothing is mapped.
    #[test]
    fn regions_are_received_only_from_the_peer_and_only_as_ticketed() {
        let shm = ShmAllocator.allocate(4096).unwrap();
        let other = ShmAllocator.allocate(4096).unwrap();
        let handle = ticketed(&*shm);
        let (ends, _conn) = own_connection();
        // The server named is not held by the process at the other end of this connection
        // (a connection whose far end nobody holds).
        let stranger = (ends.0, "127.0.0.1:1".parse().unwrap());
        let e = RemoteShmMapping::receive(&[(&handle, 4096)], stranger).unwrap_err();
        assert!(
            e.to_string().contains("not the process at the other end"),
            "{e}"
        );
        // A forged ticket, and a real ticket for a region it was not issued for.
        let forged = ShmHandle {
            ticket: [0xAB; 16],
            ..handle.clone()
        };
        let e = RemoteShmMapping::receive(&[(&forged, 4096)], ends).unwrap_err();
        assert!(e.to_string().contains("refused our ticket"), "{e}");
        let uncovered = ShmHandle {
            key: shm_handle_of(&*other).unwrap().key,
            ..handle.clone()
        };
        let e = RemoteShmMapping::receive(&[(&uncovered, 4096)], ends).unwrap_err();
        assert!(e.to_string().contains("no longer shares"), "{e}");
        // A name that is not one of ours is refused before anything is asked.
        let e =
            crate::backend::fd_pass::fetch("elsewhere", &handle.ticket, &[handle.key], |_| true)
                .unwrap_err();
        assert!(e.to_string().contains("descriptor server"), "{e}");
        // The region, described larger than it is.
        assert!(RemoteShmMapping::receive(&[(&handle, 1 << 30)], ends).is_err());
        RemoteShmMapping::receive(&[(&handle, 4096)], ends).unwrap();
    }

    /// A process of another uid that learned a valid ticket gets nothing: the descriptor
    /// server closes its connection unanswered. (Needs root to change uid; skipped otherwise.)
    #[test]
    fn another_uid_gets_no_descriptor_even_with_a_ticket() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: changing uid needs root");
            return;
        }
        let shm = ShmAllocator.allocate(4096).unwrap();
        let handle = ticketed(&*shm);
        let name = handle.socket.as_bytes().to_vec();
        let mut request = handle.ticket.to_vec();
        request.extend(handle.key.to_le_bytes());
        // The child only calls async-signal-safe functions: setuid, socket, connect, write,
        // recvmsg, _exit. Exit codes: 0 nothing received, 1 an answer or descriptor arrived,
        // 3 could not become another user, 4 could not connect.
        // SAFETY: see above; the parent waits for the child.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: raw calls on buffers that live in this stack frame.
            unsafe {
                if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    libc::_exit(3);
                }
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let mut addr: libc::sockaddr_un = std::mem::zeroed();
                addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
                for (i, b) in name.iter().enumerate() {
                    addr.sun_path[i + 1] = *b as libc::c_char;
                }
                let len =
                    (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
                if libc::connect(s, (&addr as *const libc::sockaddr_un).cast(), len) != 0 {
                    libc::_exit(4);
                }
                libc::write(s, request.as_ptr().cast(), request.len());
                let mut byte = [0u8; 1];
                let mut iov = libc::iovec {
                    iov_base: byte.as_mut_ptr().cast(),
                    iov_len: 1,
                };
                let mut cbuf = [0u64; 8];
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = &mut iov;
                msg.msg_iovlen = 1;
                msg.msg_control = cbuf.as_mut_ptr().cast();
                msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
                let n = libc::recvmsg(s, &mut msg, 0);
                // Closed (0) or reset (-1, the request unread): nothing was passed.
                let passed = n > 0 || (n == 0 && msg.msg_controllen > 0);
                libc::_exit(i32::from(passed));
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "child did not exit: {status}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "another uid got an answer");
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
