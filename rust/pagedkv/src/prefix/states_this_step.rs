//! The state blocks cached in the current scheduler step (vLLM's
//! `MambaManager.cached_blocks_this_step`): a hit ending at a state block that some request
//! cached in the same step is refused for that step, since the pass that writes the state has
//! not run when another request of the step would read it (docs/design.md, KV groups, "State
//! groups"). Keyed by the group key of the block's hash, as vLLM keys it by hash, so a copy
//! of the content on another block is refused alike.

use rustc_hash::FxHashSet;

use super::hash::BlockHash;

/// The group keys of the state blocks entered since the step started. Off (nothing recorded,
/// nothing refused) until the first [`StatesThisStep::start_step`]: a caller without steps
/// never accumulates keys.
#[derive(Debug, Default)]
pub(crate) struct StatesThisStep {
    keys: Option<FxHashSet<BlockHash>>,
}

impl StatesThisStep {
    /// A new step starts: forget the keys of the last one (and record from now on).
    pub(crate) fn start_step(&mut self) {
        self.keys.get_or_insert_with(FxHashSet::default).clear();
    }

    /// Records that a state block was cached under group key `key` in this step.
    #[inline]
    pub(crate) fn note(&mut self, key: BlockHash) {
        if let Some(keys) = self.keys.as_mut() {
            keys.insert(key);
        }
    }

    /// Whether a state block was cached under group key `key` in this step.
    #[inline]
    pub(crate) fn contains(&self, key: BlockHash) -> bool {
        self.keys.as_ref().is_some_and(|k| k.contains(&key))
    }
}
