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
