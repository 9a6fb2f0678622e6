//! The interface shared by the contiguous placement allocators (first-fit and buddy).

/// A run of adjacent token slots `[start, start + len)` in the contiguous pool.
///
/// ```
/// use pagedkv_sim::Extent;
/// let e = Extent { start: 8, len: 4 };
/// assert_eq!(e.end(), 12);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// First slot.
    pub start: usize,
    /// Number of slots (for the buddy allocator: the power of two actually set aside).
    pub len: usize,
}

impl Extent {
    /// One past the last slot.
    pub fn end(&self) -> usize {
        self.start + self.len
    }
}

/// An address-space allocator handing out runs of adjacent slots from `[0, num_slots)`.
///
/// ```
/// use pagedkv_sim::{BuddyAllocator, ExtentAllocator, FirstFitAllocator};
/// let mut allocators: Vec<Box<dyn ExtentAllocator>> =
///     vec![Box::new(FirstFitAllocator::new(16)), Box::new(BuddyAllocator::new(16))];
/// for a in allocators.iter_mut() {
///     let e = a.allocate(5).unwrap();
///     assert_eq!(e.len, a.extent_len_for(5)); // 5 for first-fit, 8 for buddy
///     assert_eq!(a.free_slots(), 16 - e.len);
/// }
/// ```
pub trait ExtentAllocator {
    /// Size of the managed slot range.
    fn num_slots(&self) -> usize;
    /// How many slots a request for `num_slots` slots actually occupies (rounding, if any).
    fn extent_len_for(&self, num_slots: usize) -> usize;
    /// Places a run of at least `num_slots` slots, or `None` (nothing changes) when no free run
    /// can hold it. Zero-length requests are refused.
    fn allocate(&mut self, num_slots: usize) -> Option<Extent>;
    /// Frees the run that starts at `start`; returns its length, or `None` (nothing changes)
    /// when no allocated run starts there.
    fn release(&mut self, start: usize) -> Option<usize>;
    /// Free slots in total.
    fn free_slots(&self) -> usize;
    /// Length of the longest run an allocation could get right now.
    fn largest_free_extent(&self) -> usize;
    /// Free slots lying in free runs too short to place an extent of `extent_len` slots.
    fn free_slots_in_extents_shorter_than(&self, extent_len: usize) -> usize;
    /// Whether `count` extents of `extent_len` slots (already rounded) could be placed now.
    fn can_place(&self, extent_len: usize, count: usize) -> bool;
    /// The free runs in address order (for the visualizer).
    fn free_extents(&self) -> Vec<Extent>;
    /// Checks the allocator's structure; the message says what is wrong.
    fn check_invariants(&self) -> Result<(), String>;
}

/// The rule behind both allocators' `can_place`: `count` extents of `extent_len` slots fit when
/// the free runs hold `count` of them in total (zero extents always fit, zero-length ones
/// never). `extent_counts` yields how many each run (or group of runs) holds; it is read only
/// until enough are found.
pub(super) fn runs_hold_extents(
    extent_len: usize,
    count: usize,
    extent_counts: impl IntoIterator<Item = usize>,
) -> bool {
    if count == 0 {
        return true;
    }
    if extent_len == 0 {
        return false;
    }
    let mut placed = 0usize;
    for extents in extent_counts {
        placed += extents;
        if placed >= count {
            return true;
        }
    }
    false
}
