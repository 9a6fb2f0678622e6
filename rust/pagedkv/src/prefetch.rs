//! Loading a batch of cold cache lines in parallel, before the steps that need them.
//!
//! Why: prefix admission that misses the cache evicts one cached block per new block and
//! re-indexes it, and each of those steps first touches a random slot of the index's hash
//! table and the block's cold record. One at a time, every such load waited out a full memory
//! latency (perf on all-miss admission: most of its wall time stalled on the first slot load of
//! `BlockIndex::insert`/`remove`; benches/results/2026-12-02-prefix-admission.md, "Follow-up:
//! index"). Loading the whole batch's lines first, in a loop whose
//! loads do not depend on each other, lets the CPU keep many misses in flight at once. The
//! crate forbids `unsafe`, so this is done with plain loads (folded into one value that
//! `black_box` keeps alive) rather than a prefetch intrinsic.

/// Loads one word from each of `words` (independent loads, so their misses overlap).
#[inline(always)]
pub(crate) fn touch_all<I: Iterator<Item = u64>>(words: I) {
    let folded = words.fold(0u64, |acc, w| acc ^ w);
    std::hint::black_box(folded);
}
