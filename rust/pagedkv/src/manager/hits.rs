//! The plain path's prefix hit over every group (docs/design.md, KV groups, "Hit rule"): the
//! coordinator's fixed point ([`super::policy::hybrid_hit`]) over each group's cached blocks,
//! a block being cached when the device index or the offload tier holds it. Read-only.

use super::keys::PromptHashes;
use super::policy::hybrid_hit;
use super::state::KvCacheManager;
use super::state_diverged::diverged_hit;
use crate::prefix::hash::{group_key, BlockHash};
use crate::BlockId;

/// Where one group's hit block at one position comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// A device block the index holds (in use, or cached-evictable: revived).
    Device(BlockId),
    /// A host block of the offload tier: loaded into a fresh device block.
    Host(BlockId),
    /// A window group's position before the hit's window: released from the start.
    Released,
}

/// A hit found by [`KvCacheManager::find_group_hit`].
#[derive(Debug, Clone, Default)]
pub(super) struct GroupHit {
    /// Its length in blocks.
    pub(super) num_blocks: usize,
    /// Per group, the place of each of its `num_blocks` positions.
    pub(super) places: Vec<Vec<Place>>,
    /// A diverged hit's (state_diverged.rs), per group: a state group's own hit block below
    /// the hit, as its position and place (its `places` are all released); empty otherwise.
    pub(super) state_own: Vec<Option<(usize, Place)>>,
}

impl GroupHit {
    /// The hit blocks of every group that are on the device.
    pub(super) fn device_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.places.iter().flatten().filter_map(|p| match *p {
            Place::Device(b) => Some(b),
            _ => None,
        })
    }
}

impl KvCacheManager {
    /// The longest hit of at most `max_blocks` blocks of the prompt `hashes` describes that
    /// every group serves, and where each group's hit blocks are (read-only). No hit without
    /// prefix caching.
    pub(super) fn find_group_hit(
        &self,
        hashes: &mut PromptHashes<'_>,
        max_blocks: usize,
    ) -> GroupHit {
        self.find_group_hit_on(hashes, max_blocks, true, false)
    }

    /// [`Self::find_group_hit`], on the device alone unless `with_host` (pins hold device
    /// blocks only); with `diverged`, the full-attention groups' own run instead, the state
    /// groups' positions released and their own hits noted (state_diverged.rs).
    pub(super) fn find_group_hit_on(
        &self,
        hashes: &mut PromptHashes<'_>,
        max_blocks: usize,
        with_host: bool,
        diverged: bool,
    ) -> GroupHit {
        let ng = self.num_groups();
        let Some(prefix) = self.prefix.as_ref() else {
            return GroupHit {
                num_blocks: 0,
                places: vec![Vec::new(); ng],
                state_own: Vec::new(),
            };
        };
        let max_blocks = max_blocks.min(hashes.num_hashable());
        // memo[g][i]: None = not looked up yet; Some(None) = not cached.
        let mut memo: Vec<Vec<Option<Option<Place>>>> = vec![vec![None; max_blocks]; ng];
        let mut lookup = |g: usize, i: usize, hashes: &mut PromptHashes<'_>| -> Option<Place> {
            if let Some(found) = memo[g][i] {
                return found;
            }
            let parent = hashes.parent(i);
            let (tokens, key) = (hashes.tokens(i), hashes.key(i));
            let mut found = None;
            // Group 0's blocks may be chained (the single-group admission's runs): reached
            // through the previous hit block's child hint, as that admission's walk does.
            if g == 0 {
                let prev = i
                    .checked_sub(1)
                    .and_then(|p| memo[0][p])
                    .flatten()
                    .and_then(|p| match p {
                        Place::Device(b) => Some(b),
                        _ => None,
                    });
                if let (Some(p), Some(ph)) = (prev, parent) {
                    if let Some((c, h)) = prefix.lookup_child(p, ph, tokens, key) {
                        if prefix.group_of(c) == 0 && accept(hashes, i, h) {
                            found = Some(Place::Device(c));
                        }
                    }
                }
            }
            if found.is_none() {
                // A group's blocks are indexed under its keys, their parents' included.
                let k = group_key(g as u32, hashes.get(i));
                let parent = parent.map(|p| group_key(g as u32, p));
                found = prefix
                    .lookup_in_group(g as u32, k, parent, tokens, key)
                    .map(Place::Device);
                if found.is_none() && with_host {
                    found = self
                        .offload
                        .as_ref()
                        .and_then(|t| t.lookup_in_group(k, g as u32, parent, tokens, key))
                        .map(Place::Host);
                }
            }
            memo[g][i] = Some(found);
            found
        };
        let bs = self.block_size;
        let specs = &self.config.kv_groups;
        let (num_blocks, own) = match diverged {
            false => {
                let cached = |g, i| lookup(g, i, hashes).is_some();
                (hybrid_hit(specs, max_blocks, bs, cached), Vec::new())
            }
            true => diverged_hit(specs, max_blocks, bs, |g, i| lookup(g, i, hashes).is_some()),
        };
        let state_own = own
            .iter()
            .enumerate()
            .map(|(g, &j)| match j {
                0 => None,
                j => lookup(g, j - 1, hashes).map(|p| (j - 1, p)),
            })
            .collect();
        let places = (0..ng)
            .map(|g| {
                let skip = match diverged && specs[g].is_state() {
                    true => num_blocks,
                    false => specs[g].skipped_blocks(num_blocks * bs, bs),
                };
                (0..num_blocks)
                    .map(|i| match i < skip {
                        true => Place::Released,
                        false => lookup(g, i, hashes).expect("the coordinator checked it"),
                    })
                    .collect()
            })
            .collect();
        GroupHit {
            num_blocks,
            places,
            state_own,
        }
    }
}

/// Whether hash `h`, found for block `i` without hashing (a child hint), is the block's: the
/// caller's hash when the caller hashes, else recorded as the block's hash when it is the next
/// one to compute, else compared.
fn accept(hashes: &mut PromptHashes<'_>, i: usize, h: BlockHash) -> bool {
    if hashes.caller_hashes() {
        return hashes.get(i) == h;
    }
    hashes.learn(i, h)
}
