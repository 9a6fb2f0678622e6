//! The free stack's head word: a 32-bit ABA tag next to a 32-bit block index in one `u64`
//! (the module documentation of `pool` says why).

pub(super) const NIL: u32 = u32::MAX;

#[inline]
pub(super) fn pack(tag: u32, index: u32) -> u64 {
    ((tag as u64) << 32) | index as u64
}

#[inline]
pub(super) fn head_index(word: u64) -> u32 {
    word as u32
}

#[inline]
pub(super) fn head_tag(word: u64) -> u32 {
    (word >> 32) as u32
}
