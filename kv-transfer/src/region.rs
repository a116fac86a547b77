//! KV memory that a transport allocated and peers can write into.
//!
//! [`Region`] is the owning view the engine's KV cache holds (it implements
//! [`KvRegion`]); [`RegionHandle`] is a cheap clone the worker keeps for transfers and for the
//! descriptor. Both keep the memory alive: it is released (heap free or `ucp_mem_unmap`) when the
//! last of them is dropped, so memory a `KvCache` holds stays valid however long it lives.
//!
//! # Aliasing
//! Peers write into the region while the engine holds `&[u8]`/`&mut [u8]` views of it, which the
//! compiler cannot see (like DMA). The contract that makes this sound in practice: a peer writes
//! only blocks the owner allocated to it for an in-flight transfer, and the engine reads (or
//! writes) a block only after it knows the block is complete and before it hands it out again;
//! so the engine and the transport never touch the same bytes at the same time. Transports copy
//! with raw pointers, never through the engine's references.

use crate::RegionDescriptor;
use cleave_types::kv::KvRegion;
use serde::{Deserialize, Serialize};
use std::ptr::NonNull;
use std::sync::Arc;

/// A region's id at its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u64);

impl std::fmt::Display for RegionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

type Release = Box<dyn FnOnce(NonNull<u8>, usize) + Send + Sync>;

/// The memory itself; shared by [`Region`], its handles and the transport's registry.
pub(crate) struct RegionMem {
    ptr: NonNull<u8>,
    len: usize,
    descriptor: RegionDescriptor,
    release: Option<Release>,
}

// SAFETY: the memory is a plain byte buffer owned by this value; all access goes through raw
// pointers under the aliasing contract in the module docs, so sharing across threads is fine.
unsafe impl Send for RegionMem {}
// SAFETY: as above; `&RegionMem` gives no safe mutable access.
unsafe impl Sync for RegionMem {}

impl RegionMem {
    /// Wraps memory of `len` bytes at `ptr`, initialized, valid until `release` runs.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be initialized, writable memory that nothing else frees before
    /// `release` is called with it.
    pub(crate) unsafe fn new(
        ptr: NonNull<u8>,
        len: usize,
        descriptor: RegionDescriptor,
        release: Release,
    ) -> Self {
        RegionMem {
            ptr,
            len,
            descriptor,
            release: Some(release),
        }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for RegionMem {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release(self.ptr, self.len);
        }
    }
}

/// A transport-allocated KV region, as the engine holds it.
pub struct Region {
    mem: Arc<RegionMem>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.mem.descriptor.id)
            .field("len", &self.mem.len)
            .finish()
    }
}

impl Region {
    pub(crate) fn new(mem: Arc<RegionMem>) -> Self {
        Region { mem }
    }

    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// The whole region (see the module docs on aliasing).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `mem` keeps `len` initialized bytes alive for as long as `self`; concurrent
        // remote writes touch only bytes the engine is not reading (module docs).
        unsafe { std::slice::from_raw_parts(self.mem.ptr(), self.mem.len) }
    }

    /// The whole region, writable (see the module docs on aliasing).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only engine-side view, and
        // transports never create references to the bytes a local engine is using.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr(), self.mem.len) }
    }

    /// How peers reach this region.
    pub fn descriptor(&self) -> RegionDescriptor {
        self.mem.descriptor.clone()
    }

    /// A handle for transfers that outlives handing the region to the engine.
    pub fn handle(&self) -> RegionHandle {
        RegionHandle {
            mem: Arc::clone(&self.mem),
        }
    }
}

impl KvRegion for Region {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// A shared handle on a [`Region`]: what `write`/`read` take as the local side and what keeps
/// the memory alive while a transfer that uses it is in flight.
#[derive(Clone)]
pub struct RegionHandle {
    mem: Arc<RegionMem>,
}

impl std::fmt::Debug for RegionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionHandle")
            .field("id", &self.mem.descriptor.id)
            .field("len", &self.mem.len)
            .finish()
    }
}

impl RegionHandle {
    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// How peers reach this region.
    pub fn descriptor(&self) -> RegionDescriptor {
        self.mem.descriptor.clone()
    }

    /// Copies `dst.len()` bytes at `offset` out of the region (for tests and checks; the engine
    /// reads through its [`Region`]). Panics when out of bounds.
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset
            .checked_add(dst.len())
            .is_some_and(|end| end <= self.mem.len));
        // SAFETY: bounds checked above; memory alive through `mem`; aliasing per module docs.
        unsafe {
            std::ptr::copy_nonoverlapping(self.mem.ptr().add(offset), dst.as_mut_ptr(), dst.len())
        }
    }

    /// Copies `src` into the region at `offset` (for tests and benches). Panics when out of
    /// bounds.
    pub fn copy_in(&self, offset: usize, src: &[u8]) {
        assert!(offset
            .checked_add(src.len())
            .is_some_and(|end| end <= self.mem.len));
        // SAFETY: bounds checked above; memory alive through `mem`; aliasing per module docs.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.mem.ptr().add(offset), src.len())
        }
    }

    pub(crate) fn mem(&self) -> &Arc<RegionMem> {
        &self.mem
    }
}

/// Page-aligned, zeroed heap memory for regions of transports without registered memory.
pub(crate) fn alloc_heap(bytes: usize) -> Option<(NonNull<u8>, Release)> {
    let layout = std::alloc::Layout::from_size_align(bytes.max(1), 4096).ok()?;
    // SAFETY: the layout has a non-zero size.
    let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
    let release: Release = Box::new(move |ptr, _| {
        // SAFETY: allocated above with this same layout, released exactly once.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) }
    });
    Some((ptr, release))
}
