//! The event-replay model: what a KV-aware router knows, an index rebuilt only from the
//! manager's KV events (vLLM's semantics: a `BlockStored` adds each of its hashes, a
//! `BlockRemoved` takes each away, `AllBlocksCleared` empties it), per tier. With one indexed
//! copy per content every hash is stored at most once, and the prefix hit the events predict
//! (the longest run of stored hashes from a prompt's first block, continued in the host tier
//! where the device run stops) is exactly what `match_prefix` returns: never shorter (a lost
//! hit), never longer. With several KV groups the events carry each block's group and the
//! hashes are kept per (group, hash); the hit is then the groups' rule over "stored in the
//! group, on either tier".

use std::collections::HashMap;

use pagedkv::{BlockHash, KvEvent, Tier};

/// The (group, hash) pairs the events say are stored, per tier (device, host).
#[derive(Debug, Default)]
pub struct Replay {
    stored: [HashMap<(Option<u32>, BlockHash), u32>; 2],
}

fn slot(medium: Tier) -> usize {
    match medium {
        Tier::Device => 0,
        Tier::Host => 1,
        other => panic!("a tier the replay does not know: {other:?}"),
    }
}

impl Replay {
    /// Applies drained events in order; a hash stored twice or removed while not stored is a
    /// broken event stream.
    pub fn apply(&mut self, events: Vec<KvEvent>) {
        for event in events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    group_idx,
                    ..
                } => {
                    for h in block_hashes {
                        let n = self.stored[slot(medium)].entry((group_idx, h)).or_insert(0);
                        *n += 1;
                        assert_eq!(*n, 1, "hash {h:#x} stored twice ({medium:?})");
                    }
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                } => {
                    for h in block_hashes {
                        assert!(
                            self.stored[slot(medium)].remove(&(group_idx, h)).is_some(),
                            "hash {h:#x} removed but not stored ({medium:?})"
                        );
                    }
                }
                KvEvent::AllBlocksCleared => {
                    for tier in &mut self.stored {
                        tier.clear();
                    }
                }
            }
        }
    }

    /// Blocks of `hashes` (a prompt's chained block hashes) the events say a hit serves, of
    /// at most `max_blocks`: the device run from the first block, then the host run after it.
    pub fn predict(&self, hashes: &[BlockHash], max_blocks: usize) -> usize {
        let hashes = &hashes[..max_blocks.min(hashes.len())];
        let device = hashes
            .iter()
            .take_while(|&&h| self.stored[0].contains_key(&(None, h)))
            .count();
        let host = hashes[device..]
            .iter()
            .take_while(|&&h| self.stored[1].contains_key(&(None, h)))
            .count();
        device + host
    }

    /// Whether the events say the block with hash `h` of the group whose events carry
    /// `group_idx` is stored (either tier). Only tests/model.rs asks; tests/offload.rs shares
    /// this module without it.
    #[allow(dead_code)]
    pub fn stored_in_group(&self, group_idx: Option<u32>, h: BlockHash) -> bool {
        self.stored.iter().any(|t| t.contains_key(&(group_idx, h)))
    }
}
