//! A global allocator for test binaries that catches writes into freed memory: large blocks are
//! filled with a poison byte when freed and kept back from reuse for a while; a block whose
//! poison changed was written after it was freed (by a transport still holding a pointer into a
//! buffer that was already dropped). Such a write corrupts the heap and crashes the process at
//! some later, unrelated allocation, or, under UCX's crash handler, hangs it; this turns it into
//! a test failure at the call that did it.
//!
//! A test binary opts in (tests/integration.rs does) with
//! `#[global_allocator] static ALLOC: common::quarantine::Quarantine = common::quarantine::Quarantine;`
//! and [`writes_after_free`] is checked after every multi-rank run (zero when not installed).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Blocks at least this large are quarantined (smaller ones cannot hold a transport's message).
const MIN: usize = 4096;
/// Most blocks held back at once.
const SLOTS: usize = 1024;
/// Most bytes held back at once.
const MAX_BYTES: usize = 256 << 20;
const POISON: u8 = 0xA5;

/// The allocator: the system allocator, with quarantine for large frees.
pub struct Quarantine;

#[derive(Clone, Copy)]
struct Block {
    ptr: usize,
    size: usize,
    align: usize,
}

struct Fifo {
    blocks: [Block; SLOTS],
    head: usize,
    len: usize,
    bytes: usize,
}

struct Shared {
    lock: AtomicBool,
    fifo: UnsafeCell<Fifo>,
}

// SAFETY: `fifo` is only touched while `lock` is held.
unsafe impl Sync for Shared {}

static SHARED: Shared = Shared {
    lock: AtomicBool::new(false),
    fifo: UnsafeCell::new(Fifo {
        blocks: [Block {
            ptr: 0,
            size: 0,
            align: 1,
        }; SLOTS],
        head: 0,
        len: 0,
        bytes: 0,
    }),
};

/// Blocks found written after they were freed (when released from quarantine).
static FOUND: AtomicUsize = AtomicUsize::new(0);

fn with_fifo<T>(f: impl FnOnce(&mut Fifo) -> T) -> T {
    while SHARED
        .lock
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
    // SAFETY: the lock is held; nothing in `f` allocates through this allocator.
    let r = f(unsafe { &mut *SHARED.fifo.get() });
    SHARED.lock.store(false, Ordering::Release);
    r
}

/// Whether the block still holds nothing but poison.
fn intact(b: &Block) -> bool {
    // SAFETY: a quarantined block: still allocated from the system allocator, owned by us.
    let bytes = unsafe { std::slice::from_raw_parts(b.ptr as *const u8, b.size) };
    bytes.iter().all(|&x| x == POISON)
}

/// Checks and releases the oldest block.
fn evict(q: &mut Fifo) {
    let b = q.blocks[q.head];
    q.head = (q.head + 1) % SLOTS;
    q.len -= 1;
    q.bytes -= b.size;
    if !intact(&b) {
        FOUND.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: allocated by `System` with this size and alignment, released once.
    unsafe {
        System.dealloc(
            b.ptr as *mut u8,
            Layout::from_size_align_unchecked(b.size, b.align),
        )
    };
}

// SAFETY: every request is served by `System`; quarantined blocks are released to it later
// with their original layout.
unsafe impl GlobalAlloc for Quarantine {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() < MIN {
            // SAFETY: forwarded as is.
            return unsafe { System.dealloc(ptr, layout) };
        }
        // SAFETY: the caller gives the block up: we own its bytes now.
        unsafe { std::ptr::write_bytes(ptr, POISON, layout.size()) };
        with_fifo(|q| {
            while q.len == SLOTS || (q.len > 0 && q.bytes + layout.size() > MAX_BYTES) {
                evict(q);
            }
            let at = (q.head + q.len) % SLOTS;
            q.blocks[at] = Block {
                ptr: ptr as usize,
                size: layout.size(),
                align: layout.align(),
            };
            q.len += 1;
            q.bytes += layout.size();
        });
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < MIN {
            // SAFETY: forwarded as is.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Large blocks move, so the old one goes through quarantine too.
        // SAFETY: `layout` with `new_size` is valid per the realloc contract.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: as `alloc`.
        let new = unsafe { System.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are live and at least `min` bytes long; they do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

/// How many freed blocks were written to after they were freed, so far in this process
/// (checks the blocks still in quarantine too). Always 0 when the allocator is not installed.
// The library reads it only in its UCX tests, which a build without UCX leaves out.
#[cfg_attr(not(have_ucx), allow(dead_code))]
pub fn writes_after_free() -> usize {
    let held = with_fifo(|q| {
        (0..q.len)
            .filter(|i| !intact(&q.blocks[(q.head + i) % SLOTS]))
            .count()
    });
    FOUND.load(Ordering::Relaxed) + held
}
