//! The `dtq` binary's allocator (mimalloc), counted: what a bench's
//! in-process worker allocates (allocations and bytes per task, the queue
//! bench) and holds (live bytes, by allocation size, the inflight bench).
//!
//! Counting is off until [`Counting::start`] and costs one relaxed load per
//! allocation while off, so a bench's timed parts run as the binary does
//! and only a part it measures on purpose pays for the atomic counts.
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOCATOR: dtq_tests::alloc::Counting = dtq_tests::alloc::Counting;
//! ```

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, Ordering};

use mimalloc::MiMalloc;

static ON: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
static LIVE: AtomicIsize = AtomicIsize::new(0);

/// Live allocations are counted by size in steps of 16 bytes up to this;
/// larger ones in one bucket.
const COUNTED_SIZES: usize = 64 << 10;
const BUCKETS: usize = COUNTED_SIZES / 16 + 1;
static BY_SIZE: [AtomicIsize; BUCKETS] = [const { AtomicIsize::new(0) }; BUCKETS];

fn bucket(size: usize) -> usize {
    size.div_ceil(16).min(BUCKETS - 1)
}

/// mimalloc, with allocations counted while switched on.
pub struct Counting;

/// Allocations (reallocations included) and the bytes they asked for,
/// since [`Counting::start`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Allocated {
    /// Calls of `alloc`, `alloc_zeroed` and `realloc`.
    pub allocations: u64,
    /// Bytes they asked for (a reallocation counts its new size).
    pub bytes: u64,
}

impl Counting {
    /// Zero the counts and start counting. The live counts are exact only
    /// when counting started before anything was allocated (first thing in
    /// `main`): a free of an earlier allocation lowers them.
    pub fn start() {
        ALLOCATIONS.store(0, Ordering::Relaxed);
        BYTES.store(0, Ordering::Relaxed);
        LIVE.store(0, Ordering::Relaxed);
        for n in &BY_SIZE {
            n.store(0, Ordering::Relaxed);
        }
        ON.store(true, Ordering::Release);
    }

    /// Bytes allocated while counting and not freed.
    pub fn live() -> usize {
        LIVE.load(Ordering::Relaxed).max(0) as usize
    }

    /// Live allocations by size: (size, rounded up to 16 bytes; the last
    /// bucket holds every larger one, count), those with any.
    pub fn live_by_size() -> Vec<(usize, isize)> {
        BY_SIZE
            .iter()
            .enumerate()
            .map(|(i, n)| (i * 16, n.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Stop counting; the counts since [`Counting::start`].
    pub fn stop() -> Allocated {
        ON.store(false, Ordering::Release);
        Allocated {
            allocations: ALLOCATIONS.load(Ordering::Relaxed),
            bytes: BYTES.load(Ordering::Relaxed),
        }
    }

    fn count(size: usize) {
        if ON.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(size as u64, Ordering::Relaxed);
            LIVE.fetch_add(size as isize, Ordering::Relaxed);
            BY_SIZE[bucket(size)].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn uncount(size: usize) {
        if ON.load(Ordering::Relaxed) {
            LIVE.fetch_sub(size as isize, Ordering::Relaxed);
            BY_SIZE[bucket(size)].fetch_sub(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is passed on to mimalloc unchanged; counting touches
// only atomics and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        Self::uncount(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::uncount(layout.size());
        Self::count(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { MiMalloc.realloc(ptr, layout, new_size) }
    }
}
