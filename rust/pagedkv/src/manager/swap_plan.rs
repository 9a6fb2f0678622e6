//! The tier-neutral bookkeeping of a group swap, shared by the plain and the hybrid manager:
//! which distinct blocks move, how many table entries reference each, and the old-id to new-id
//! map. Both managers swap a fork group the same way (a block shared inside the group moves
//! once and stays shared); only how they walk their tables differs, so the walk stays with
//! them and feeds these functions.

use rustc_hash::FxHashMap;

use crate::error::{invalid, Result};
use crate::host::HostTier;
use crate::BlockId;

/// Distinct blocks of `entries` in first-seen order, with how many entries reference each.
/// First-seen order fixes the order of the returned copy pairs (the API documents it).
pub(super) fn distinct_blocks(entries: impl Iterator<Item = BlockId>) -> (Vec<BlockId>, Vec<u32>) {
    let mut position: FxHashMap<BlockId, usize> = FxHashMap::default();
    let (mut blocks, mut refs): (Vec<BlockId>, Vec<u32>) = (Vec::new(), Vec::new());
    for b in entries {
        let i = *position.entry(b).or_insert_with(|| {
            blocks.push(b);
            refs.push(0);
            blocks.len() - 1
        });
        refs[i] += 1;
    }
    (blocks, refs)
}

/// One host block for each of `blocks`, holding `refs[i]` references. A group larger than the
/// whole tier is an invalid request (it can never fit), not [`crate::Error::OutOfBlocks`]
/// (which says "retry once blocks are freed"). All or nothing.
pub(super) fn allocate_host(
    host: &mut HostTier,
    blocks: &[BlockId],
    refs: &[u32],
) -> Result<Vec<BlockId>> {
    if blocks.len() > host.num_blocks() {
        return invalid(format!(
            "the group holds {} distinct blocks, more than the host tier's {}",
            blocks.len(),
            host.num_blocks()
        ));
    }
    host.allocate(refs)
}

/// The map `from[i] -> to[i]` the commit step rewrites the tables with.
pub(super) fn id_map(from: &[BlockId], to: &[BlockId]) -> FxHashMap<BlockId, BlockId> {
    from.iter().copied().zip(to.iter().copied()).collect()
}
