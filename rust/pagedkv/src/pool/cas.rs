//! The pool's compare-exchange retry loop, shared by the free stack, the free count and the
//! per-block refcount words.

use crate::sync::{spin_hint, AtomicU64, AtomicUsize, Backoff, Ordering};

/// What one pass of [`cas_retry`] does with the value it read.
pub(super) enum Cas<V, R> {
    /// Compare-exchange the value read for `V`; on success the loop returns `R`.
    Swap(V, R),
    /// Return `R` without writing.
    Stop(R),
    /// Reread after a spin hint, without a CAS (a snapshot that cannot be right yet).
    Spin,
}

/// An atomic word [`cas_retry`] runs on (the std or loom types of `crate::sync`).
pub(super) trait CasWord {
    type Value: Copy;
    fn load(&self, order: Ordering) -> Self::Value;
    fn compare_exchange_weak(
        &self,
        current: Self::Value,
        new: Self::Value,
        success: Ordering,
        failure: Ordering,
    ) -> std::result::Result<Self::Value, Self::Value>;
}

macro_rules! cas_word {
    ($atomic:ty, $value:ty) => {
        impl CasWord for $atomic {
            type Value = $value;
            #[inline(always)]
            fn load(&self, order: Ordering) -> $value {
                <$atomic>::load(self, order)
            }
            #[inline(always)]
            fn compare_exchange_weak(
                &self,
                current: $value,
                new: $value,
                success: Ordering,
                failure: Ordering,
            ) -> std::result::Result<$value, $value> {
                <$atomic>::compare_exchange_weak(self, current, new, success, failure)
            }
        }
    };
}
cas_word!(AtomicU64, u64);
cas_word!(AtomicUsize, usize);

/// The pool's compare-exchange retry loop: reads `word` with `load` ordering, asks `step` what
/// to do with the value, and on a failed CAS (`success` ordering on success, `load` on failure)
/// waits a growing backoff and reads again, until a CAS succeeds or `step` stops. The reread
/// after the wait matters: the value a failed CAS saw is older than the spin.
#[inline(always)]
pub(super) fn cas_retry<W: CasWord, R>(
    word: &W,
    load: Ordering,
    success: Ordering,
    mut step: impl FnMut(W::Value) -> Cas<W::Value, R>,
) -> R {
    let mut cur = word.load(load);
    let mut backoff = Backoff::new();
    loop {
        match step(cur) {
            Cas::Stop(result) => return result,
            Cas::Spin => {
                spin_hint();
                cur = word.load(load);
            }
            Cas::Swap(new, result) => match word.compare_exchange_weak(cur, new, success, load) {
                Ok(_) => return result,
                Err(_) => {
                    backoff.snooze();
                    cur = word.load(load);
                }
            },
        }
    }
}
