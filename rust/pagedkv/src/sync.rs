//! Atomics shim: `std` atomics normally, `loom`'s model-checked ones under `--cfg loom`.
//!
//! Only the lock-free [`crate::BlockPool`] uses atomics; routing them through here lets the loom
//! tests explore every interleaving of its exact code.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize};

pub(crate) use std::sync::atomic::Ordering;

/// Tells the CPU (or loom's scheduler) that this thread is spinning on another's progress.
#[inline]
pub(crate) fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Bounded exponential backoff after a failed CAS: 1, 2, 4, ... up to 64 spin hints. Under
/// contention it lets the thread that won the cache line finish a few more operations before
/// this one requests the line again, instead of both bouncing it on every retry.
pub(crate) struct Backoff {
    #[cfg(not(loom))]
    step: u32,
}

impl Backoff {
    #[cfg(not(loom))]
    const MAX_STEP: u32 = 6;

    #[inline]
    pub(crate) fn new() -> Backoff {
        Backoff {
            #[cfg(not(loom))]
            step: 0,
        }
    }

    /// Waits a little longer each call. Under loom it does nothing: the retry is what matters
    /// there, and a yield per retry would only enlarge the explored state space.
    #[inline]
    pub(crate) fn snooze(&mut self) {
        #[cfg(not(loom))]
        {
            for _ in 0..(1u32 << self.step) {
                std::hint::spin_loop();
            }
            if self.step < Self::MAX_STEP {
                self.step += 1;
            }
        }
    }
}

/// Keeps a hot atomic on its own cache line (128 bytes: adjacent-line prefetchers pull lines
/// in pairs), so CASes on it do not invalidate the line holding the pool's read-only fields or
/// another hot atomic.
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}
