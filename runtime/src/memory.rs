//! Host memory that the KV cache lives in and the transfer engine moves bytes in and out of.
//!
//! The `gpu` crate allocates its KV regions through a [`HostMemoryAllocator`]; the `transport`
//! crate supplies allocators whose memory a peer can reach (shared memory for `shm`, plain
//! anonymous memory for `tcp`/`quic`/`local`) and registers what they return. Neither crate
//! knows the other: this trait is where they meet.

use std::sync::Arc;

/// The page size every region is aligned to.
pub const PAGE_SIZE: usize = 4096;

/// A page-aligned span of host memory that stays at a fixed address for its whole lifetime
/// and is freed when the last owner drops it.
///
/// # Safety
/// Implementors promise that `as_ptr()..as_ptr()+len()` is valid, writable, page-aligned
/// memory for as long as the value lives, and that the address never changes. Concurrent
/// access to the bytes is coordinated by the users (block ownership in the scheduler, fences in
/// the transport), not by this trait.
pub unsafe trait HostMemory: Send + Sync + std::fmt::Debug + 'static {
    /// Start of the span.
    fn as_ptr(&self) -> *mut u8;
    /// Length of the span in bytes.
    fn len(&self) -> usize;
    /// Whether the span is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Something that hands out [`HostMemory`] regions of a requested length.
pub trait HostMemoryAllocator: Send + Sync {
    /// Allocates a zeroed, page-aligned region of at least `len` bytes.
    ///
    /// # Errors
    /// Returns the OS error when the memory cannot be mapped.
    fn allocate(&self, len: usize) -> std::io::Result<Arc<dyn HostMemory>>;
}

/// Private anonymous memory (`mmap(MAP_ANONYMOUS)`), reachable only from this process.
#[derive(Debug)]
pub struct AnonMemory {
    map: memmap2::MmapMut,
}

impl AnonMemory {
    /// Maps `len` bytes (rounded up to a page) of zeroed anonymous memory.
    ///
    /// # Errors
    /// Returns the OS error when the mapping fails.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let len = len.max(1).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let map = memmap2::MmapOptions::new().len(len).map_anon()?;
        Ok(Self { map })
    }
}

// SAFETY: an anonymous mapping is page-aligned, lives until `map` is dropped and never moves.
unsafe impl HostMemory for AnonMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// Allocates [`AnonMemory`]: the default for a KV cache that no other process reads directly.
#[derive(Debug, Default, Clone, Copy)]
pub struct AnonAllocator;

impl HostMemoryAllocator for AnonAllocator {
    fn allocate(&self, len: usize) -> std::io::Result<Arc<dyn HostMemory>> {
        Ok(Arc::new(AnonMemory::new(len)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anon_memory_is_page_aligned_zeroed_and_rounded_up() {
        let mem = AnonAllocator.allocate(10_000).unwrap();
        assert_eq!(mem.as_ptr() as usize % PAGE_SIZE, 0);
        assert_eq!(mem.len(), 12_288);
        // SAFETY: the span is valid for `len` bytes while `mem` lives.
        let bytes = unsafe { std::slice::from_raw_parts(mem.as_ptr(), mem.len()) };
        assert!(bytes.iter().all(|&b| b == 0));
    }
}
