//! Argument checks and their errors, shared by the manager's operations: distinct batch ids,
//! a table that fits the pool, a sequence that is not still prefilling. A leaf: it names only
//! the crate's error, pool and id types.

use rustc_hash::FxHashSet;

use crate::error::{invalid, Error, Result};
use crate::pool::BlockPool;
use crate::SeqId;

/// InvalidArgument when an id appears twice in `seq_ids` (the batch calls: a
/// repeated id would apply one sequence's operation twice).
pub(super) fn check_distinct(seq_ids: &[SeqId]) -> Result<()> {
    if seq_ids.len() > 1 {
        let mut seen = FxHashSet::default();
        seen.reserve(seq_ids.len());
        for &id in seq_ids {
            if !seen.insert(id) {
                return invalid(format!("sequence id {id} appears twice in the batch"));
            }
        }
    }
    Ok(())
}

/// The error of growing or forking a sequence of which `num_computed` of `num_tokens` tokens
/// are computed (growth and fork refuse with it).
#[cold]
#[inline(never)]
pub(super) fn prefilling_error(seq_id: SeqId, num_computed: usize, num_tokens: usize) -> Error {
    Error::InvalidArgument(format!(
        "sequence {seq_id} is still prefilling ({num_computed} of {num_tokens} tokens computed): \
         advance_computed to its length first"
    ))
}

/// Blocks needed for `num_tokens`, or InvalidArgument when no table that long can fit `pool`.
#[inline]
pub(super) fn blocks_fitting(num_tokens: usize, pool: &BlockPool) -> Result<usize> {
    let block_size = pool.block_size();
    let n = num_tokens.div_ceil(block_size);
    if n > pool.num_blocks() {
        return Err(cannot_fit(num_tokens, n, pool.num_blocks(), block_size));
    }
    Ok(n)
}

/// The error of a request for `num_tokens` tokens (`needed` blocks) that no pool of `usable`
/// blocks can ever hold.
#[cold]
#[inline(never)]
pub(super) fn cannot_fit(
    num_tokens: usize,
    needed: usize,
    usable: usize,
    block_size: usize,
) -> Error {
    Error::InvalidArgument(format!(
        "{num_tokens} tokens need {needed} blocks, more than the pool's {usable} blocks of {block_size} tokens",
    ))
}
