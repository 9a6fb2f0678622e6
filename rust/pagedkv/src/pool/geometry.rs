//! The pool's size limits and the geometry check every tier shares.

use crate::error::{invalid, Result};

/// The largest `num_blocks` a pool accepts (2^24 blocks; metadata is 8 bytes per block).
pub const MAX_NUM_BLOCKS: usize = 1 << 24;
/// The largest number of token slots (`num_blocks * block_size`) a pool accepts, so every slot
/// index and every sequence length fits an `i32` (the dtype of `seq_lens` and block tables).
pub const MAX_NUM_SLOTS: usize = i32::MAX as usize;

/// Validates a tier's geometry (shared by the device pool and the host tier).
pub(crate) fn validate_geometry(num_blocks: usize, block_size: usize, what: &str) -> Result<()> {
    if num_blocks == 0 || num_blocks > MAX_NUM_BLOCKS {
        return invalid(format!(
            "{what} must be in 1..={MAX_NUM_BLOCKS}, got {num_blocks}"
        ));
    }
    if block_size == 0 {
        return invalid("block_size must be at least 1");
    }
    match num_blocks.checked_mul(block_size) {
        Some(slots) if slots <= MAX_NUM_SLOTS => Ok(()),
        _ => invalid(format!(
            "{what} * block_size = {num_blocks} * {block_size} exceeds the {MAX_NUM_SLOTS} token slots a pool may have"
        )),
    }
}
