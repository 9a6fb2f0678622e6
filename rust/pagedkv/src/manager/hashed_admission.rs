//! Admission with the prompt's block hashes computed earlier (`add_sequence_hashed`): a
//! scheduler that hashed a request at arrival to order its queue (docs/scheduling.md, Cost)
//! hands the hashes over, and the admission hashes only the blocks past them.

use super::KvCacheManager;
use crate::error::{invalid, Result};
use crate::prefix::hash::BlockHash;
use crate::{SeqId, TokenId};

impl KvCacheManager {
    /// [`Self::add_sequence`] with `prompt_hashes`, the chained hashes of the prompt's first
    /// full blocks exactly as [`Self::prefix_block_hashes`]`(token_ids, extra_key)` returns
    /// them (a prefix of that list, or all of it), used instead of hashing those blocks again.
    /// Everything else is `add_sequence`'s: the same hit, the same index entries, the same
    /// events. Hits are still verified by token ids, so hashes that are not the prompt's cost
    /// hits and index entries under the wrong names, never a wrong hit. More hashes than the
    /// prompt has full blocks is `InvalidArgument`, changing nothing. Without prefix caching,
    /// or on a manager whose admission takes the general path (hybrid groups, a sliding
    /// window, an offload tier), the hashes are not needed and are ignored.
    ///
    /// ```
    /// use pagedkv::{KvCacheManager, ManagerConfig};
    /// let mut kv = KvCacheManager::new(ManagerConfig {
    ///     num_blocks: 8, block_size: 2, enable_prefix_caching: true, ..Default::default()
    /// })?;
    /// let prompt = [1, 2, 3, 4, 5];
    /// let hashes = kv.prefix_block_hashes(&prompt, None);   // computed at arrival
    /// kv.add_sequence_hashed(1, &prompt, None, &hashes)?;
    /// assert_eq!(kv.add_sequence_hashed(2, &prompt, None, &hashes)?, 4);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn add_sequence_hashed(
        &mut self,
        seq_id: SeqId,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
        prompt_hashes: &[BlockHash],
    ) -> Result<usize> {
        let num_full = token_ids.len() / self.block_size;
        if prompt_hashes.len() > num_full {
            return invalid(format!(
                "prompt_hashes has {} entries for a prompt of {num_full} full blocks",
                prompt_hashes.len()
            ));
        }
        if self.tuned && self.prefix.is_some() {
            self.admit_cached::<true>(seq_id, token_ids, extra_key, usize::MAX, prompt_hashes)
        } else {
            self.add_sequence(seq_id, token_ids, extra_key)
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{KvCacheManager, KvEvent, ManagerConfig};

    fn manager() -> KvCacheManager {
        KvCacheManager::new(ManagerConfig {
            num_blocks: 12,
            block_size: 2,
            enable_prefix_caching: true,
            enable_kv_events: true,
            ..Default::default()
        })
        .unwrap()
    }

    /// Randomized prompts over a small alphabet (many shared prefixes, evictions in a small
    /// pool): a manager admitting with the hashes given (all of them, or a prefix) and one
    /// admitting plainly return the same hits, hold the same tables and record the same
    /// events, and both keep their invariants after every step.
    #[test]
    fn hashed_admission_is_plain_admission() {
        let mut rng = 0x44u64;
        let mut below = |n: u64| (crate::splitmix64::next(&mut rng) % n) as u32;
        let (mut plain, mut hashed) = (manager(), manager());
        let mut live: Vec<u64> = Vec::new();
        for id in 0..400u64 {
            if live.len() > 2 || (below(3) == 0 && !live.is_empty()) {
                let gone = live.remove(below(live.len() as u64) as usize);
                plain.free(gone).unwrap();
                hashed.free(gone).unwrap();
            }
            let len = 1 + below(9) as usize;
            let prompt: Vec<u32> = (0..len).map(|_| below(2)).collect();
            let hashes = hashed.prefix_block_hashes(&prompt, None);
            let given = &hashes[..hashes.len() - below(hashes.len() as u64 + 1) as usize];
            let a = plain.add_sequence(id, &prompt, None);
            let b = hashed.add_sequence_hashed(id, &prompt, None, given);
            assert_eq!(a, b);
            if a.is_ok() {
                live.push(id);
                assert_eq!(
                    plain.block_table(id).unwrap(),
                    hashed.block_table(id).unwrap()
                );
            }
            plain.check_invariants().unwrap();
            hashed.check_invariants().unwrap();
            let (ea, eb): (Vec<KvEvent>, Vec<KvEvent>) =
                (plain.take_events(), hashed.take_events());
            assert_eq!(ea, eb);
        }
    }

    #[test]
    fn too_many_hashes_change_nothing() {
        let mut kv = manager();
        let hashes = kv.prefix_block_hashes(&[1, 2, 3, 4], None);
        let err = kv.add_sequence_hashed(1, &[1, 2, 3], None, &hashes);
        assert!(matches!(err, Err(crate::Error::InvalidArgument(_))));
        assert!(kv.block_table(1).is_err());
        kv.check_invariants().unwrap();
    }

    /// The hashes given are the ones entered: a wrong one names the block in the index (and
    /// its event), and the same prompt admitted plainly then misses it (its own hash differs),
    /// never hits wrong content.
    #[test]
    fn given_hashes_name_the_blocks() {
        let mut kv = manager();
        kv.add_sequence_hashed(1, &[1, 2, 3], None, &[0xABCD])
            .unwrap();
        match &kv.take_events()[..] {
            [KvEvent::BlockStored { block_hashes, .. }] => assert_eq!(block_hashes, &[0xABCD]),
            other => panic!("{other:?}"),
        }
        assert_eq!(kv.match_prefix(&[1, 2, 3], None).unwrap(), 0);
        kv.check_invariants().unwrap();
    }
}
