//! The state group kind (`KvGroupSpec::MambaState`, docs/design.md, KV groups, "State
//! groups") on a full-attention + state config, step by step against the rule
//! tests/vllm/test_vllm_mamba.py checks on vLLM's align-mode tables: per allocation one block
//! at the chunk's last position (the interior null from the start), released once the
//! processed watermark passes its block by a token; a hit of `k` blocks starts the table as
//! `k - 1` nulls and the state block; a hit on a state cached in the same step is refused
//! until `new_step`; lookahead, rollbacks and truncation are refused, changing nothing.
//! `check_invariants()` after every step.

use pagedkv::{
    AdmitOptions, Error, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt, SlotOptions,
    NULL_BLOCK,
};

const BS: usize = 4;

fn manager(num_blocks: usize) -> KvCacheManager {
    KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: BS,
        enable_prefix_caching: true,
        kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
        ..Default::default()
    })
    .unwrap()
}

fn per_chunk(num_scheduled: usize) -> AdmitOptions<'static> {
    AdmitOptions {
        reserve_prompt: false,
        num_scheduled,
        ..Default::default()
    }
}

/// The live positions of a state table after each `(computed, new)` step (the rule the vLLM
/// differential checks on vLLM's tables): release below `(computed - 1) / BS`, then, when the
/// table does not reach the step's end, nulls up to its last position and one block there.
fn rule(trace: &[(usize, usize)], hit_blocks: usize) -> Vec<usize> {
    let mut table: Vec<bool> = (0..hit_blocks).map(|i| i + 1 == hit_blocks).collect();
    for &(computed, new) in trace {
        let skip = (computed.saturating_sub(1) / BS).min(table.len());
        table[..skip].fill(false);
        let required = (computed + new).div_ceil(BS);
        if required > table.len() {
            table.resize(required - 1, false);
            table.push(true);
        }
    }
    (0..table.len()).filter(|&i| table[i]).collect()
}

fn live(kv: &KvCacheManager, id: u64, group: usize) -> Vec<usize> {
    let table = kv.block_table_group(id, group).unwrap();
    (0..table.len())
        .filter(|&i| table[i] != NULL_BLOCK)
        .collect()
}

/// A tiny splitmix-driven generator (the crate's own).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        (pagedkv::splitmix64::next(&mut self.0) % n as u64) as usize
    }
}

/// Runs sequence `id` from admission: block-aligned prefill chunks (the last one ends the
/// prompt), then `decode` single-token steps, checking both tables, the blocks in use and the
/// invariants after each step. Returns the chunk ends and the hit.
fn run(
    kv: &mut KvCacheManager,
    id: u64,
    prompt: &[u32],
    decode: usize,
    rng: &mut Rng,
) -> (Vec<usize>, usize) {
    let n = prompt.len();
    let mut trace: Vec<(usize, usize)> = Vec::new();
    let mut ends = Vec::new();
    let mut hit = 0;
    let mut c = 0;
    while c < n + decode {
        let step = if c == 0 || c < n {
            let from = if trace.is_empty() {
                kv.match_prefix(prompt, None).unwrap()
            } else {
                c
            };
            (((1 + rng.below(3)) * BS).min(n - from), from)
        } else {
            (1, c)
        };
        let (new, from) = step;
        if trace.is_empty() {
            hit = kv
                .add_sequence_with(id, Prompt::Tokens(prompt), &per_chunk(new))
                .unwrap();
            assert_eq!(hit, from);
            c = hit;
        } else {
            assert!(kv.allocate_slots(id, new, 0).unwrap());
        }
        trace.push((c, new));
        c += new;
        if c <= n {
            ends.push(c);
        }
        kv.check_invariants().unwrap();
        assert_eq!(
            live(kv, id, 1),
            *rule(&trace, hit / BS).as_slice(),
            "{trace:?}"
        );
        let fa = kv.block_table_group(id, 0).unwrap().len();
        assert_eq!(fa, c.div_ceil(BS));
        assert_eq!(
            live(kv, id, 0).len(),
            fa,
            "full attention keeps every block"
        );
        let in_use = kv.num_blocks() - kv.num_available_blocks();
        assert_eq!(in_use, fa + live(kv, id, 1).len(), "{trace:?}");
    }
    (ends, hit)
}

#[test]
fn tables_follow_the_align_rule_and_hits_end_at_state_blocks() {
    for seed in 0..40u64 {
        let mut rng = Rng(seed);
        let mut kv = manager(96);
        let len = (2 + rng.below(8)) * BS + rng.below(BS);
        let prompt: Vec<u32> = (0..len).map(|_| 1 + rng.below(1000) as u32).collect();
        let (ends, hit) = run(&mut kv, 1, &prompt, 9, &mut rng);
        assert_eq!(hit, 0);
        kv.free(1).unwrap();
        kv.check_invariants().unwrap();
        // A longer prompt: its hit is the deepest block-aligned chunk end of the first (its
        // state block is cached there; the full-attention chain covers every full block).
        let mut longer = prompt.clone();
        longer.extend((0..(1 + rng.below(3)) * BS + 1).map(|_| 1 + rng.below(1000) as u32));
        let bound = (longer.len() - 1) / BS;
        let expected = ends
            .iter()
            .filter(|&&e| e % BS == 0 && e / BS <= bound)
            .max()
            .copied()
            .unwrap_or(0);
        assert_eq!(
            kv.match_prefix(&longer, None).unwrap(),
            expected,
            "seed {seed}"
        );
        let (_, hit) = run(&mut kv, 2, &longer, 5, &mut rng);
        assert_eq!(hit, expected);
        kv.free(2).unwrap();
        kv.check_invariants().unwrap();
        assert_eq!(kv.num_available_blocks(), 96);
    }
}

#[test]
fn a_state_cached_this_step_is_refused_until_the_next() {
    let prompt: Vec<u32> = (1..=9).collect(); // the state at 8 is cached by the first chunk
    let mut kv = manager(32);
    kv.new_step();
    kv.add_sequence_with(1, Prompt::Tokens(&prompt[..8]), &per_chunk(8))
        .unwrap();
    let before = kv.num_available_blocks();
    match kv.add_sequence_with(2, Prompt::Tokens(&prompt), &per_chunk(9)) {
        Err(Error::OutOfBlocks { .. }) => {}
        other => panic!("a hit on this step's state: {other:?}"),
    }
    assert!(!kv.contains(2));
    assert_eq!(kv.num_available_blocks(), before);
    kv.check_invariants().unwrap();
    // A hit that does not end at this step's state is not refused: bound at 4 tokens, no
    // state block cached there, so no hit at all.
    assert_eq!(
        kv.add_sequence_with(3, Prompt::Tokens(&prompt[..5]), &per_chunk(5))
            .unwrap(),
        0
    );
    kv.new_step();
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &per_chunk(9))
            .unwrap(),
        8
    );
    let table = kv.block_table_group(2, 1).unwrap();
    assert_eq!(table[0], NULL_BLOCK); // k - 1 nulls, then the hit's state block
    assert_eq!(table[1], kv.block_table_group(1, 1).unwrap()[1]);
    kv.check_invariants().unwrap();
    // Without any step (never called new_step), nothing is refused.
    let mut kv = manager(32);
    kv.add_sequence_with(1, Prompt::Tokens(&prompt[..8]), &per_chunk(8))
        .unwrap();
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &per_chunk(9))
            .unwrap(),
        8
    );
}

#[test]
fn group_hits_are_each_groups_own_and_the_admission_takes_the_fixed_point() {
    let prompt: Vec<u32> = (1..=17).collect();
    let mut kv = manager(32);
    // Chunks ending at 8 and 16: state blocks at positions 1 and 3.
    kv.add_sequence_with(1, Prompt::Tokens(&prompt[..16]), &per_chunk(8))
        .unwrap();
    assert!(kv.allocate_slots(1, 8, 0).unwrap());
    let hashes = kv.prefix_block_hashes(&prompt, None);
    assert_eq!(kv.group_hits(&hashes, 16), vec![16, 16]);
    assert_eq!(kv.group_hits(&hashes, 15), vec![12, 8]);
    // Full attention loses block 2: its chain stops at 8, the state group still holds 16.
    let fa2 = kv.block_table_group(1, 0).unwrap()[2];
    kv.evict_blocks(&[fa2]).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.group_hits(&hashes, 16), vec![8, 16]);
    // The admission reconciles: the state block at or below the chain's 8 tokens.
    assert_eq!(kv.match_prefix(&prompt, None).unwrap(), 8);
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &per_chunk(1))
            .unwrap(),
        8
    );
    kv.check_invariants().unwrap();
    assert_eq!(kv.group_hits(&[], 100), vec![0, 0]);
}

#[test]
fn lookahead_rollback_and_truncate_are_refused_changing_nothing() {
    let prompt: Vec<u32> = (1..=10).collect();
    let mut kv = manager(32);
    let look = AdmitOptions {
        num_lookahead_tokens: 2,
        ..per_chunk(10)
    };
    assert!(matches!(
        kv.add_sequence_with(1, Prompt::Tokens(&prompt), &look),
        Err(Error::InvalidArgument(_))
    ));
    assert!(!kv.contains(1));
    kv.add_sequence_with(1, Prompt::Tokens(&prompt), &per_chunk(10))
        .unwrap();
    let tables = |kv: &KvCacheManager| {
        (0..2)
            .map(|g| kv.block_table_group(1, g).unwrap().to_vec())
            .collect::<Vec<_>>()
    };
    let before = (tables(&kv), kv.num_available_blocks());
    let refused = [
        SlotOptions {
            num_lookahead_tokens: 1,
            ..Default::default()
        },
        SlotOptions {
            num_computed_tokens: Some(9),
            ..Default::default()
        },
    ];
    for o in &refused {
        assert!(matches!(
            kv.allocate_slots_with(1, 1, o),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!((tables(&kv), kv.num_available_blocks()), before);
    }
    assert!(matches!(kv.truncate(1, 8), Err(Error::InvalidArgument(_))));
    assert_eq!((tables(&kv), kv.num_available_blocks()), before);
    kv.truncate(1, 10).unwrap(); // to its own length: nothing to roll back
    kv.check_invariants().unwrap();
}

#[test]
fn the_reserve_contract_and_appends_take_one_state_block_per_call() {
    let mut kv = manager(32);
    kv.add_sequence(1, &(1..=10).collect::<Vec<u32>>(), None)
        .unwrap();
    assert_eq!(live(&kv, 1, 1), vec![2]);
    kv.append_tokens(1, &[11, 12, 13, 14, 15, 16, 17]).unwrap(); // 17 tokens: positions 3, 4
    assert_eq!(live(&kv, 1, 1), vec![2, 4]); // 2 stays until the watermark passes it by a token
    kv.append_tokens(1, &[18]).unwrap();
    assert_eq!(live(&kv, 1, 1), vec![4]);
    assert_eq!(live(&kv, 1, 0).len(), 5);
    kv.check_invariants().unwrap();
    // A prompt the pool could never hold block for block is refused as full attention's is.
    let mut small = manager(4);
    assert!(matches!(
        small.add_sequence_len(1, 5 * BS),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn the_same_step_refusal_holds_with_the_callers_hashes() {
    // vLLM's integration names blocks by its own hashes: the step's states are keyed by those.
    let prompt: Vec<u32> = (1..=9).collect();
    let names: Vec<u128> = vec![11, 22];
    let named = |n: usize| AdmitOptions {
        block_hashes: Some(&names),
        ..per_chunk(n)
    };
    let mut kv = manager(32);
    kv.new_step();
    kv.add_sequence_with(1, Prompt::Tokens(&prompt[..8]), &named(8))
        .unwrap();
    assert_eq!(kv.group_hits(&names, 8), vec![8, 8]);
    assert!(matches!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &named(1)),
        Err(Error::OutOfBlocks { .. })
    ));
    kv.new_step();
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &named(1))
            .unwrap(),
        8
    );
    kv.check_invariants().unwrap();
}

/// vLLM's prefill check-points (`PrefillCheckpoint`, a Mamba layer's
/// `num_prefill_checkpoint_blocks`): a chunk that starts on a block boundary and spans one a
/// block past it also takes the state block of its last boundary, counted in the refusal; the
/// next allocation releases it (it stays cached, so a later prompt hits there); a chunk not
/// on a boundary, too short, or off the alignment takes none; an alignment of 0 is refused,
/// changing nothing.
#[test]
fn prefill_checkpoints_take_the_last_boundarys_state() {
    use pagedkv::PrefillCheckpoint;
    let every = Some(PrefillCheckpoint {
        prefill_end: 0,
        alignment: 1,
    });
    let state = |kv: &KvCacheManager, id: u64| kv.block_table_group(id, 1).unwrap().to_vec();
    // 10 tokens in one chunk from 0: the last boundary below 10 is 8, a block past 0 and more:
    // positions [null, block (state at 8), block (state at 10)].
    let mut kv = manager(16);
    let o = AdmitOptions {
        prefill_checkpoint: every,
        ..per_chunk(10)
    };
    let prompt: Vec<u32> = (1..=10).collect();
    kv.add_sequence_with(1, Prompt::Tokens(&prompt), &o)
        .unwrap();
    let t = state(&kv, 1);
    assert_eq!(t.len(), 3);
    assert!(
        t[0] == NULL_BLOCK && t[1] != NULL_BLOCK && t[2] != NULL_BLOCK,
        "{t:?}"
    );
    kv.check_invariants().unwrap();
    // The next chunk (a decode token) releases the check-point: state at 10 only.
    let slots = SlotOptions {
        prefill_checkpoint: every,
        ..Default::default()
    };
    assert!(kv.allocate_slots_with(1, 1, &slots).unwrap());
    let t = state(&kv, 1);
    assert!(
        t[..2].iter().all(|&b| b == NULL_BLOCK) && t[2] != NULL_BLOCK,
        "{t:?}"
    );
    kv.check_invariants().unwrap();
    // A prompt sharing the first 8 tokens hits the released, cached check-point.
    let other: Vec<u32> = (1..=8).chain(50..54).collect();
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&other), &o).unwrap(),
        8
    );
    kv.check_invariants().unwrap();

    // No check-point: a chunk of one block (its last boundary below 8 is 4, its start), a
    // chunk off a boundary, an alignment the distance misses.
    for (start, new, alignment) in [(4, 4, 1), (2, 10, 1), (0, 10, 3)] {
        let mut kv = manager(16);
        let prompt: Vec<u32> = (1..=20).collect();
        kv.add_sequence_with(1, Prompt::Tokens(&prompt), &per_chunk(start))
            .unwrap();
        let before = kv.num_available_blocks();
        let o = SlotOptions {
            prefill_checkpoint: Some(PrefillCheckpoint {
                prefill_end: 0,
                alignment,
            }),
            ..Default::default()
        };
        assert!(kv.allocate_slots_with(1, new, &o).unwrap());
        let taken = before - kv.num_available_blocks();
        let positions = (start + new).div_ceil(BS) - start.div_ceil(BS);
        // full attention's new positions and the state group's one block
        assert_eq!(
            taken,
            positions + 1,
            "{start} + {new}, alignment {alignment}"
        );
        kv.check_invariants().unwrap();
    }

    // Counted in the refusal: 3 blocks hold 8 tokens' 2 positions and one state block, not
    // the check-point (the state at 4) too.
    let mut kv = manager(3);
    let prompt: Vec<u32> = (1..=8).collect();
    let o = AdmitOptions {
        prefill_checkpoint: every,
        ..per_chunk(8)
    };
    assert!(matches!(
        kv.add_sequence_with(1, Prompt::Tokens(&prompt), &o),
        Err(Error::OutOfBlocks { .. })
    ));
    assert_eq!(kv.num_available_blocks(), 3);
    kv.check_invariants().unwrap();
    // An alignment of 0: refused, nothing changed.
    let bad = AdmitOptions {
        prefill_checkpoint: Some(PrefillCheckpoint {
            prefill_end: 0,
            alignment: 0,
        }),
        ..per_chunk(8)
    };
    assert!(matches!(
        kv.add_sequence_with(1, Prompt::Tokens(&prompt), &bad),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(kv.num_available_blocks(), 3);
    // Without the check-point it fits.
    kv.add_sequence_with(1, Prompt::Tokens(&prompt), &per_chunk(8))
        .unwrap();
    assert_eq!(kv.num_available_blocks(), 0);
    kv.check_invariants().unwrap();
}
