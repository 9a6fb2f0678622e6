//! Admission with the prompt's block hashes computed earlier (`add_sequence_hashed`, a
//! shorthand for `add_sequence_with` and `AdmitOptions::prompt_hashes`): a scheduler that
//! hashed a request at arrival to order its queue (docs/scheduling.md, Cost) hands the hashes
//! over, and the admission hashes only the blocks past them.

use super::config::{AdmitOptions, Prompt};
use super::KvCacheManager;
use crate::error::Result;
use crate::prefix::hash::BlockHash;
use crate::{SeqId, TokenId};

impl KvCacheManager {
    /// [`Self::add_sequence`] with `prompt_hashes`, the chained hashes of the prompt's first
    /// full blocks exactly as [`Self::prefix_block_hashes`]`(token_ids, extra_key)` returns
    /// them (a prefix of that list, or all of it), used instead of hashing those blocks again:
    /// [`Self::add_sequence_with`] with [`AdmitOptions::prompt_hashes`], which the per-chunk
    /// admission takes too. Everything else is `add_sequence`'s: the same hit, the same index
    /// entries, the same events. Hits are still verified by token ids, so hashes that are not
    /// the prompt's cost hits and index entries under the wrong names, never a wrong hit. More
    /// hashes than the prompt has full blocks is `InvalidArgument`, changing nothing. Without
    /// prefix caching the hashes are not needed and are ignored.
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
        let options = AdmitOptions {
            extra_key,
            prompt_hashes: Some(prompt_hashes),
            ..AdmitOptions::default()
        };
        self.add_sequence_with(seq_id, Prompt::Tokens(token_ids), &options)
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

    /// What one manager of a per-chunk model run did at one step.
    type Step = (crate::Result<usize>, Vec<KvEvent>);

    /// One step of that run on one manager, with the hashes it is given.
    type Op<'a> =
        dyn Fn(&mut KvCacheManager, Option<&[crate::BlockHash]>) -> crate::Result<usize> + 'a;

    /// Per-chunk and whole-prompt admissions (`AdmitOptions::prompt_hashes`, all of the
    /// hashes or a prefix) on the tuned manager and on one that takes the general path (two
    /// groups, one a sliding window), with chunks computed later (`allocate_slots`,
    /// `advance_computed`), rollbacks and frees: each step does on the hashed manager exactly
    /// what it does on the plain one (results, tables, computed watermarks, events, and
    /// `match_prefix_with` the hit of `match_prefix`), and both keep their invariants after
    /// every step.
    #[test]
    fn per_chunk_admission_with_prompt_hashes_is_plain_admission() {
        use crate::{AdmitOptions, KvGroupSpec, Prompt};
        for groups in [
            vec![KvGroupSpec::FullAttention],
            vec![
                KvGroupSpec::FullAttention,
                KvGroupSpec::SlidingWindow { window: 3 },
            ],
        ] {
            let make = || {
                KvCacheManager::new(ManagerConfig {
                    num_blocks: 24,
                    block_size: 2,
                    enable_prefix_caching: true,
                    enable_kv_events: true,
                    kv_groups: groups.clone(),
                    ..Default::default()
                })
                .unwrap()
            };
            let mut rng = 0x4444u64;
            let mut below = |n: u64| (crate::splitmix64::next(&mut rng) % n.max(1)) as usize;
            let (mut plain, mut hashed) = (make(), make());
            let mut live: Vec<u64> = Vec::new();
            let mut given_total = 0;
            for id in 0..600u64 {
                let step = |kv: &mut KvCacheManager,
                            given: Option<&[crate::BlockHash]>,
                            op: &Op|
                 -> Step {
                    let r = op(kv, given);
                    (r, kv.take_events())
                };
                let op = if live.len() > 4 { 4 } else { below(5) };
                let (a, b): (Step, Step) = match op {
                    0 | 1 => {
                        let len = 1 + below(11);
                        let prompt: Vec<u32> = (0..len).map(|_| below(2) as u32).collect();
                        let hashes = hashed.prefix_block_hashes(&prompt, None);
                        let keep = hashes.len() - below(hashes.len() as u64 + 1);
                        let (scheduled, reserve) = (below(len as u64 + 2), below(3) > 0);
                        let given = AdmitOptions {
                            prompt_hashes: Some(&hashes[..keep]),
                            ..AdmitOptions::default()
                        };
                        assert_eq!(
                            plain.match_prefix(&prompt, None),
                            hashed.match_prefix_with(&prompt, &given)
                        );
                        let admit =
                            |kv: &mut KvCacheManager, given: Option<&[crate::BlockHash]>| {
                                let options = AdmitOptions {
                                    num_scheduled: scheduled,
                                    reserve_prompt: reserve,
                                    prompt_hashes: given,
                                    ..AdmitOptions::default()
                                };
                                kv.add_sequence_with(id, Prompt::Tokens(&prompt), &options)
                            };
                        let a = step(&mut plain, None, &admit);
                        let b = step(&mut hashed, Some(&hashes[..keep]), &admit);
                        if a.0.is_ok() {
                            live.push(id);
                            given_total += keep;
                        }
                        (a, b)
                    }
                    2 if !live.is_empty() => {
                        // The next chunk of a sequence still prefilling (or a decode token).
                        let s = live[below(live.len() as u64)];
                        let left =
                            plain.num_tokens(s).unwrap() - plain.num_computed_tokens(s).unwrap();
                        let n = 1 + below(left.max(1) as u64);
                        let chunk = |kv: &mut KvCacheManager, _: Option<&[crate::BlockHash]>| {
                            if left == 0 {
                                return kv.append_tokens(s, &[1]).map(|()| 0);
                            }
                            kv.allocate_slots(s, n, 0).map(usize::from)
                        };
                        (
                            step(&mut plain, None, &chunk),
                            step(&mut hashed, None, &chunk),
                        )
                    }
                    3 if !live.is_empty() => {
                        let s = live[below(live.len() as u64)];
                        let keep = below(plain.num_tokens(s).unwrap() as u64 + 1).max(1);
                        let cut = |kv: &mut KvCacheManager, _: Option<&[crate::BlockHash]>| {
                            kv.truncate(s, keep).map(|()| keep)
                        };
                        (step(&mut plain, None, &cut), step(&mut hashed, None, &cut))
                    }
                    _ if !live.is_empty() => {
                        let s = live.swap_remove(below(live.len() as u64));
                        let free = |kv: &mut KvCacheManager, _: Option<&[crate::BlockHash]>| {
                            kv.free(s).map(|()| 0)
                        };
                        (
                            step(&mut plain, None, &free),
                            step(&mut hashed, None, &free),
                        )
                    }
                    _ => continue,
                };
                assert_eq!(a, b, "step {id}");
                for &s in &live {
                    assert_eq!(
                        plain.block_table(s).unwrap(),
                        hashed.block_table(s).unwrap()
                    );
                    assert_eq!(
                        plain.num_computed_tokens(s).unwrap(),
                        hashed.num_computed_tokens(s).unwrap()
                    );
                }
                plain.check_invariants().unwrap();
                hashed.check_invariants().unwrap();
            }
            assert!(given_total > 150, "the run should hand over hashes");
        }
    }

    /// Hashes that come with the caller's own names or keys, without token ids, or more than
    /// the prompt's full blocks are refused on every admission path, changing nothing.
    #[test]
    fn prompt_hashes_are_validated() {
        use crate::{AdmitOptions, Prompt};
        let mut kv = manager();
        let h = kv.prefix_block_hashes(&[1, 2, 3, 4, 5], None);
        let cases = [
            (Prompt::Tokens(&[1, 2, 3]), Some(&h[..]), None),
            (Prompt::Len(5), Some(&h[..1]), None),
            (Prompt::Tokens(&[1, 2, 3, 4, 5]), Some(&h[..]), Some(&h[..])),
        ];
        for (prompt, given, theirs) in cases {
            for reserve_prompt in [true, false] {
                let options = AdmitOptions {
                    prompt_hashes: given,
                    block_hashes: theirs,
                    reserve_prompt,
                    ..AdmitOptions::default()
                };
                let err = kv.add_sequence_with(1, prompt, &options);
                assert!(
                    matches!(err, Err(crate::Error::InvalidArgument(_))),
                    "{err:?}"
                );
                assert!(kv.block_table(1).is_err());
                kv.check_invariants().unwrap();
            }
        }
    }

    /// The hashes given at a per-chunk admission name the blocks its later chunks compute,
    /// on the tuned path and the general one (the hashes are read, not computed again): a
    /// wrong one shows in the later chunk's `BlockStored`.
    #[test]
    fn given_hashes_name_the_blocks_of_later_chunks() {
        use crate::{AdmitOptions, KvGroupSpec, Prompt};
        for (groups, reserve_prompt) in [
            (vec![KvGroupSpec::FullAttention], true),
            (vec![KvGroupSpec::FullAttention], false),
            (vec![KvGroupSpec::FullAttention; 2], false),
        ] {
            let mut kv = KvCacheManager::new(ManagerConfig {
                num_blocks: 12,
                block_size: 2,
                enable_prefix_caching: true,
                enable_kv_events: true,
                kv_groups: groups,
                ..Default::default()
            })
            .unwrap();
            let options = AdmitOptions {
                num_scheduled: 2,
                reserve_prompt,
                prompt_hashes: Some(&[0xA, 0xB]),
                ..AdmitOptions::default()
            };
            kv.add_sequence_with(1, Prompt::Tokens(&[1, 2, 3, 4, 5]), &options)
                .unwrap();
            kv.take_events();
            if reserve_prompt {
                kv.advance_computed(&[1], 2).unwrap();
            } else {
                assert!(kv.allocate_slots(1, 2, 0).unwrap());
            }
            let stored: Vec<_> = kv
                .take_events()
                .into_iter()
                .filter_map(|e| match e {
                    KvEvent::BlockStored {
                        block_hashes,
                        group_idx: None | Some(0),
                        ..
                    } => Some(block_hashes),
                    _ => None,
                })
                .collect();
            assert_eq!(stored, vec![vec![0xB]], "{reserve_prompt}");
            kv.check_invariants().unwrap();
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

    /// A caller may name different contents alike (a wrong or hostile hash): the index keeps
    /// one block per name, refusing the second content its name (that block stays private,
    /// never a wrong hit). Names repeated within one prompt and a given name equal to one an
    /// earlier admission entered as a chained block (`prefix/index.rs`, off the hash map), on
    /// the tuned path, per chunk, with two groups, as the caller's `block_hashes` and through
    /// `provide_token_ids`; `check_invariants` after every call.
    #[test]
    fn one_name_given_to_different_contents_is_indexed_once() {
        use crate::{AdmitOptions, KvGroupSpec, Prompt};
        for groups in [
            vec![KvGroupSpec::FullAttention],
            vec![KvGroupSpec::FullAttention; 2],
        ] {
            for reserve_prompt in [true, false] {
                let mut kv = KvCacheManager::new(ManagerConfig {
                    num_blocks: 200,
                    block_size: 2,
                    enable_prefix_caching: true,
                    kv_groups: groups.clone(),
                    ..Default::default()
                })
                .unwrap();
                // An honest miss: its blocks after the first are chained.
                let honest: Vec<u32> = (10..20).collect();
                kv.add_sequence(1, &honest, None).unwrap();
                let names = kv.prefix_block_hashes(&honest, None);
                let zeros = [0u32; 11];
                let cases: [&[crate::BlockHash]; 3] = [
                    &[3, 3, 3],
                    &[names[2], names[3]],
                    &[7, names[1], 7, names[4]],
                ];
                for (k, given) in cases.iter().enumerate() {
                    let seq = 10 + k as u64;
                    let own = AdmitOptions {
                        prompt_hashes: Some(given),
                        reserve_prompt,
                        num_scheduled: zeros.len(),
                        ..AdmitOptions::default()
                    };
                    kv.add_sequence_with(seq, Prompt::Tokens(&zeros), &own)
                        .unwrap();
                    kv.check_invariants().unwrap();
                    let theirs = AdmitOptions {
                        block_hashes: Some(given),
                        reserve_prompt,
                        num_scheduled: zeros.len(),
                        ..AdmitOptions::default()
                    };
                    let other: Vec<u32> = (0..11).map(|t| t + 100 * (k as u32 + 1)).collect();
                    kv.add_sequence_with(seq + 100, Prompt::Tokens(&other), &theirs)
                        .unwrap();
                    kv.check_invariants().unwrap();
                    // Ids and names given later, for a sequence admitted by length.
                    let later = AdmitOptions {
                        num_scheduled: 8,
                        reserve_prompt,
                        ..AdmitOptions::default()
                    };
                    kv.add_sequence_with(seq + 200, Prompt::Len(8), &later)
                        .unwrap();
                    let ids: Vec<u32> = (0..8).map(|t| t + 1000 * (k as u32 + 1)).collect();
                    let result = kv.provide_token_ids(seq + 200, &ids, None, None, Some(given));
                    kv.check_invariants().unwrap();
                    if result.is_ok() {
                        assert!(kv.num_tokens(seq + 200).is_ok());
                    }
                }
                // The honest prompt still hits all but its last block, through the names it
                // was entered under.
                assert_eq!(kv.match_prefix(&honest, None).unwrap(), 8);
            }
        }
    }
}
