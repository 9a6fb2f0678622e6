//! No public API can panic: random calls of every public `KvCacheManager`, `BlockPool` and
//! `BlockTable` method with arbitrary arguments (any ids, counts up to `usize::MAX`, token
//! slices, block ids past the pool), each wrapped in `catch_unwind`. Every call must return
//! (`Ok` or `Err`), a failed call must change nothing observable, and `check_invariants()` must
//! pass on every manager and pool after every step.
//!
//! Two managers share one pool (one with prefix caching and a host tier), a third owns its pool,
//! and three more have several KV groups (full attention and sliding windows; one with the
//! offload tier, admission limits, the null block and the new-block log); raw `retain` /
//! `release` run on a separate pool that no manager uses (on a manager's pool they would, by
//! contract, break that manager's bookkeeping). The per-chunk calls (`add_sequence_with`,
//! `allocate_slots_with`, `provide_token_ids`) and the group views run on every manager.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pagedkv::{
    AdmitOptions, BlockPool, BlockTable, KvCacheManager, KvGroupSpec, ManagerConfig,
    PrefillCheckpoint, Prompt, SlotOptions, MAX_NUM_BLOCKS, MAX_NUM_SLOTS,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    AddSequence(u64, Vec<u32>, Option<Vec<u8>>),
    AddSequenceLen(u64, usize),
    AppendTokens(u64, Vec<u32>),
    AppendLen(u64, usize),
    CanAppend(u64, usize),
    AppendLenBatch(Vec<u64>, usize),
    AppendTokensBatch(Vec<u64>, Vec<u32>, usize),
    Fork(u64, u64),
    Free(u64),
    FreeBatch(Vec<u64>),
    SwapOut(Vec<u64>),
    SwapIn(Vec<u64>),
    IsSwappedOut(u64),
    HostRefcount(u32),
    HostBlockTable(u64),
    ResetPrefixCache,
    TakeEvents,
    CachedBlocks,
    BlockTable(u64),
    Table(u64),
    NumTokens(u64),
    BlocksNeededForPrompt(usize),
    BatchBlockTables(Vec<u64>),
    SlotMapping(Vec<u64>, usize),
    TakeCopyOps,
    Refcount(u32),
    Stats,
    PoolAllocate(usize),
    PoolRetain(u32),
    PoolRelease(u32),
    PoolRefcount(u32),
    TableMath(usize, usize),
    AddSequenceScheduled(u64, Vec<u32>, Option<Vec<u8>>, usize),
    AddSequenceLenScheduled(u64, usize, usize),
    AdvanceComputed(Vec<u64>, usize),
    NumComputedTokens(u64),
    MatchPrefix(Vec<u32>, Option<Vec<u8>>),
    Truncate(u64, usize),
    PinPrefix(Vec<u32>, Option<Vec<u8>>),
    UnpinPrefix(Vec<u32>, Option<Vec<u8>>),
    AddWith {
        seq: u64,
        tokens: Option<Vec<u32>>,
        len: usize,
        scheduled: usize,
        reserve: bool,
        /// `require_full_prompt` (per chunk only).
        full: bool,
        lookahead: usize,
        block_keys: Option<Vec<Option<Vec<u8>>>>,
        block_hashes: Option<Vec<u128>>,
        /// `num_external_computed_tokens` (per chunk only).
        external: usize,
        /// `diverged_hit` (full attention's own run as the hit; refused outside its configs).
        diverged: bool,
    },
    AllocateSlots {
        seq: u64,
        new: usize,
        lookahead: usize,
        in_flight: usize,
        computed: Option<usize>,
    },
    ProvideTokenIds(u64, Vec<u32>, Option<usize>, Option<Vec<u128>>),
    MatchPrefixWith(Vec<u32>, Option<Vec<u128>>),
    GroupViews(Vec<u64>, usize, usize),
    TakeNewBlockIds,
    StateHit(Option<Vec<u128>>, usize, usize),
    /// `group_hits(hashes, max_tokens)`, read-only.
    GroupHits(Option<Vec<u128>>, usize),
    /// `new_step()`: a scheduler step starts.
    NewStep,
    ReleaseSkipped(u64, usize),
}

fn extra_key() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop::option::of(prop::collection::vec(any::<u8>(), 0..3))
}

fn seq_id() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 0u64..5, 1 => Just(u64::MAX), 1 => any::<u64>()]
}

fn count() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..24,
        1 => Just(usize::MAX),
        1 => Just(usize::MAX / 2 + 1),
        1 => Just(u32::MAX as usize + 1),
        1 => any::<usize>(),
    ]
}

fn block_id() -> impl Strategy<Value = u32> {
    prop_oneof![6 => 0u32..40, 1 => Just(u32::MAX), 1 => any::<u32>()]
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        4 => prop::collection::vec(0u32..3, 0..24),
        1 => prop::collection::vec(any::<u32>(), 0..8),
    ]
}

fn seq_ids() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(seq_id(), 0..5)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (seq_id(), tokens(), prop::option::of(prop::collection::vec(any::<u8>(), 0..3)))
            .prop_map(|(s, t, k)| Op::AddSequence(s, t, k)),
        2 => (seq_id(), count()).prop_map(|(s, n)| Op::AddSequenceLen(s, n)),
        3 => (seq_id(), tokens()).prop_map(|(s, t)| Op::AppendTokens(s, t)),
        2 => (seq_id(), count()).prop_map(|(s, n)| Op::AppendLen(s, n)),
        1 => (seq_id(), count()).prop_map(|(s, n)| Op::CanAppend(s, n)),
        2 => (seq_ids(), count()).prop_map(|(s, n)| Op::AppendLenBatch(s, n)),
        2 => (seq_ids(), tokens(), count()).prop_map(|(s, t, n)| Op::AppendTokensBatch(s, t, n)),
        3 => (seq_id(), seq_id()).prop_map(|(p, c)| Op::Fork(p, c)),
        2 => seq_id().prop_map(Op::Free),
        1 => seq_ids().prop_map(Op::FreeBatch),
        2 => seq_ids().prop_map(Op::SwapOut),
        2 => seq_ids().prop_map(Op::SwapIn),
        1 => seq_id().prop_map(Op::IsSwappedOut),
        1 => block_id().prop_map(Op::HostRefcount),
        1 => seq_id().prop_map(Op::HostBlockTable),
        1 => Just(Op::ResetPrefixCache),
        1 => Just(Op::TakeEvents),
        1 => Just(Op::CachedBlocks),
        1 => seq_id().prop_map(Op::BlockTable),
        1 => seq_id().prop_map(Op::Table),
        1 => seq_id().prop_map(Op::NumTokens),
        1 => count().prop_map(Op::BlocksNeededForPrompt),
        1 => seq_ids().prop_map(Op::BatchBlockTables),
        1 => (seq_ids(), count()).prop_map(|(s, n)| Op::SlotMapping(s, n)),
        1 => Just(Op::TakeCopyOps),
        1 => block_id().prop_map(Op::Refcount),
        1 => Just(Op::Stats),
        1 => count().prop_map(Op::PoolAllocate),
        1 => block_id().prop_map(Op::PoolRetain),
        1 => block_id().prop_map(Op::PoolRelease),
        1 => block_id().prop_map(Op::PoolRefcount),
        1 => (count(), count()).prop_map(|(a, b)| Op::TableMath(a, b)),
        3 => (seq_id(), tokens(), extra_key(), count())
            .prop_map(|(s, t, k, n)| Op::AddSequenceScheduled(s, t, k, n)),
        1 => (seq_id(), count(), count()).prop_map(|(s, n, k)| Op::AddSequenceLenScheduled(s, n, k)),
        3 => (seq_ids(), count()).prop_map(|(s, n)| Op::AdvanceComputed(s, n)),
        1 => seq_id().prop_map(Op::NumComputedTokens),
        2 => (tokens(), extra_key()).prop_map(|(t, k)| Op::MatchPrefix(t, k)),
        3 => (seq_id(), count()).prop_map(|(s, n)| Op::Truncate(s, n)),
        2 => (tokens(), extra_key()).prop_map(|(t, k)| Op::PinPrefix(t, k)),
        2 => (tokens(), extra_key()).prop_map(|(t, k)| Op::UnpinPrefix(t, k)),
    ]
}

fn group() -> impl Strategy<Value = usize> {
    prop_oneof![6 => 0usize..3, 1 => Just(usize::MAX), 1 => any::<usize>()]
}

fn hashes() -> impl Strategy<Value = Option<Vec<u128>>> {
    prop::option::weighted(
        0.3,
        prop::collection::vec(prop_oneof![0u128..4, Just(u128::MAX)], 0..10),
    )
}

/// The per-chunk calls and the group views.
fn chunk_op() -> impl Strategy<Value = Op> {
    let block_keys = prop::option::weighted(
        0.2,
        prop::collection::vec(
            prop::option::of(prop::collection::vec(any::<u8>(), 0..2)),
            0..10,
        ),
    );
    prop_oneof![
        4 => (seq_id(), prop::option::weighted(0.8, tokens()), count(), count(), any::<bool>(), any::<bool>(), count(), block_keys, hashes(), prop_oneof![2 => Just(0usize), 1 => count()], any::<bool>())
            .prop_map(|(seq, tokens, len, scheduled, reserve, full, lookahead, block_keys, block_hashes, external, diverged)| {
                Op::AddWith { seq, tokens, len, scheduled, reserve, full, lookahead, block_keys, block_hashes, external, diverged }
            }),
        6 => (seq_id(), count(), count(), count(), prop::option::of(count()))
            .prop_map(|(seq, new, lookahead, in_flight, computed)| Op::AllocateSlots { seq, new, lookahead, in_flight, computed }),
        2 => (seq_id(), tokens(), prop::option::of(count()), hashes()).prop_map(|(s, t, c, h)| Op::ProvideTokenIds(s, t, c, h)),
        1 => (tokens(), hashes()).prop_map(|(t, h)| Op::MatchPrefixWith(t, h)),
        2 => (seq_ids(), count(), group()).prop_map(|(s, n, g)| Op::GroupViews(s, n, g)),
        1 => (seq_id(), count()).prop_map(|(s, n)| Op::ReleaseSkipped(s, n)),
        1 => Just(Op::TakeNewBlockIds),
        1 => (hashes(), count(), group()).prop_map(|(h, n, g)| Op::StateHit(h, n, g)),
        1 => (hashes(), count()).prop_map(|(h, n)| Op::GroupHits(h, n)),
        1 => Just(Op::NewStep),
    ]
}

/// Everything observable about a manager (used to check that a failed call changed nothing).
fn snapshot(kv: &KvCacheManager) -> String {
    let mut ids: Vec<u64> = kv.seq_ids().collect();
    ids.sort_unstable();
    let tables: Vec<_> = ids
        .iter()
        .map(|&id| {
            let groups: Vec<_> = (0..kv.kv_groups().len())
                .map(|g| {
                    (
                        kv.block_table_group(id, g).ok().map(<[u32]>::to_vec),
                        kv.host_block_table_group(id, g).ok().map(<[u32]>::to_vec),
                    )
                })
                .collect();
            (
                id,
                kv.table(id).ok().cloned(),
                kv.is_swapped_out(id).ok(),
                kv.num_computed_tokens(id).ok(),
                kv.num_tokens(id).ok(),
                kv.num_slots(id).ok(),
                groups,
            )
        })
        .collect();
    let refcounts: Vec<_> = (0..kv.num_blocks() as u32)
        .map(|b| kv.refcount(b).ok())
        .collect();
    let host: Vec<_> = (0..kv.num_host_blocks() as u32)
        .map(|b| kv.host_refcount(b).ok())
        .collect();
    format!(
        "{tables:?} {refcounts:?} {host:?} {} {} {:?} {:?}",
        kv.num_available_blocks(),
        kv.num_free_host_blocks(),
        kv.cached_blocks(),
        kv.stats()
    )
}

/// Runs one op on `kv`; returns whether it failed (and so must have changed nothing).
fn apply(kv: &mut KvCacheManager, op: &Op, side_pool: &BlockPool) -> bool {
    match op {
        Op::AddSequence(s, t, k) => kv.add_sequence(*s, t, k.as_deref()).is_err(),
        Op::AddSequenceLen(s, n) => kv.add_sequence_len(*s, *n).is_err(),
        Op::AppendTokens(s, t) => kv.append_tokens(*s, t).is_err(),
        Op::AppendLen(s, n) => kv.append_len(*s, *n).is_err(),
        Op::CanAppend(s, n) => kv.can_append(*s, *n).is_err(),
        Op::AppendLenBatch(s, n) => kv.append_len_batch(s, *n).is_err(),
        Op::AppendTokensBatch(s, t, n) => kv.append_tokens_batch(s, t, *n).is_err(),
        Op::Fork(p, c) => kv.fork(*p, *c).is_err(),
        Op::Free(s) => kv.free(*s).is_err(),
        Op::FreeBatch(s) => kv.free_batch(s).is_err(),
        Op::SwapOut(s) => kv.swap_out(s).is_err(),
        Op::SwapIn(s) => kv.swap_in(s).is_err(),
        Op::IsSwappedOut(s) => kv.is_swapped_out(*s).is_err(),
        Op::HostRefcount(b) => kv.host_refcount(*b).is_err(),
        Op::HostBlockTable(s) => kv.host_block_table(*s).is_err(),
        Op::ResetPrefixCache => {
            kv.reset_prefix_cache();
            false
        }
        Op::TakeEvents => {
            kv.take_events();
            false
        }
        Op::CachedBlocks => {
            kv.cached_blocks();
            false
        }
        Op::BlockTable(s) => kv.block_table(*s).is_err(),
        Op::Table(s) => kv.table(*s).is_err(),
        Op::NumTokens(s) => kv.num_tokens(*s).is_err(),
        Op::BlocksNeededForPrompt(n) => {
            kv.blocks_needed_for_prompt(*n);
            false
        }
        Op::BatchBlockTables(s) => kv.batch_block_tables(s).is_err(),
        Op::SlotMapping(s, n) => kv.slot_mapping(s, *n).is_err(),
        Op::TakeCopyOps => {
            kv.take_copy_ops();
            false
        }
        Op::Refcount(b) => kv.refcount(*b).is_err(),
        Op::Stats => {
            let _ = (
                kv.stats(),
                kv.usage(),
                kv.config().clone(),
                kv.pool().num_cached_blocks(),
            );
            false
        }
        Op::PoolAllocate(n) => {
            // On the manager's own pool: a caller may take blocks outside any manager; they are
            // handed straight back so the managers' accounting stays theirs.
            if let Ok(blocks) = kv.pool().allocate(*n) {
                for b in blocks {
                    let h = kv
                        .pool()
                        .handle(b)
                        .expect("a handle to a block just allocated");
                    kv.pool()
                        .release(h)
                        .expect("releasing a block just allocated");
                    // The handle is spent: a second release is refused, whoever got the block.
                    assert!(kv.pool().release(h).is_err());
                }
            }
            let mut out = vec![7];
            if side_pool.allocate_into(*n, &mut out).is_err() {
                assert_eq!(out, vec![7], "a failed allocate_into touched its output");
            }
            false
        }
        Op::PoolRetain(b) => {
            let _ = side_pool.handle(*b).and_then(|h| side_pool.retain(h));
            false
        }
        Op::PoolRelease(b) => {
            let _ = side_pool.handle(*b).and_then(|h| side_pool.release(h));
            false
        }
        Op::PoolRefcount(b) => {
            let _ = (kv.pool().refcount(*b), side_pool.refcount(*b));
            false
        }
        Op::AddSequenceScheduled(s, t, k, n) => {
            kv.add_sequence_scheduled(*s, t, k.as_deref(), *n).is_err()
        }
        Op::AddSequenceLenScheduled(s, n, k) => kv.add_sequence_len_scheduled(*s, *n, *k).is_err(),
        Op::AdvanceComputed(s, n) => kv.advance_computed(s, *n).is_err(),
        Op::NumComputedTokens(s) => kv.num_computed_tokens(*s).is_err(),
        Op::MatchPrefix(t, k) => {
            // A pure query: the state must not change even when it succeeds.
            let before = snapshot(kv);
            let _ = kv.match_prefix(t, k.as_deref());
            assert_eq!(before, snapshot(kv), "match_prefix changed the state");
            false
        }
        Op::Truncate(s, n) => kv.truncate(*s, *n).is_err(),
        Op::PinPrefix(t, k) => kv.pin_prefix(t, k.as_deref()).is_err(),
        Op::UnpinPrefix(t, k) => kv.unpin_prefix(t, k.as_deref()).is_err(),
        Op::AddWith {
            seq,
            tokens,
            len,
            scheduled,
            reserve,
            full,
            lookahead,
            block_keys,
            block_hashes,
            external,
            diverged,
        } => {
            let keys: Option<Vec<Option<&[u8]>>> = block_keys
                .as_ref()
                .map(|k| k.iter().map(Option::as_deref).collect());
            let options = AdmitOptions {
                extra_key: None,
                num_scheduled: *scheduled,
                reserve_prompt: *reserve,
                require_full_prompt: *full,
                num_lookahead_tokens: *lookahead,
                block_extra_keys: keys.as_deref(),
                block_hashes: block_hashes
                    .as_deref()
                    .filter(|_| *seq % 2 == 0 || keys.is_some()),
                // Arbitrary hashes as pagedkv's own when the seq id is odd: wrong names, never
                // a panic (every admission path validates and verifies hits by token ids).
                prompt_hashes: block_hashes
                    .as_deref()
                    .filter(|_| *seq % 2 == 1 && keys.is_none()),
                apply_watermark: true,
                reserved_blocks: 0,
                num_external_computed_tokens: *external,
                diverged_hit: *diverged,
                // Check-points on every third admission, alignments 0 (refused) to 3.
                prefill_checkpoint: (*seq % 3 == 0).then_some(PrefillCheckpoint {
                    prefill_end: *len % 97,
                    alignment: (*seq / 3 % 4) as usize,
                }),
            };
            let prompt = match tokens {
                Some(t) => Prompt::Tokens(t),
                None => Prompt::Len(*len),
            };
            kv.add_sequence_with(*seq, prompt, &options).is_err()
        }
        Op::AllocateSlots {
            seq,
            new,
            lookahead,
            in_flight,
            computed,
        } => {
            let options = SlotOptions {
                num_lookahead_tokens: *lookahead,
                num_in_flight_tokens: *in_flight,
                num_computed_tokens: *computed,
                prefill_checkpoint: (*seq % 3 == 1).then_some(PrefillCheckpoint {
                    prefill_end: *new,
                    alignment: (*seq / 3 % 4) as usize,
                }),
            };
            // `Ok(false)` may have released out-of-window blocks (as vLLM does): not a failure.
            kv.allocate_slots_with(*seq, *new, &options).is_err()
        }
        Op::ProvideTokenIds(s, t, c, h) => {
            kv.provide_token_ids(*s, t, *c, None, h.as_deref()).is_err()
        }
        Op::MatchPrefixWith(t, h) => {
            let before = snapshot(kv);
            let options = AdmitOptions {
                block_hashes: h.as_deref(),
                ..AdmitOptions::default()
            };
            let _ = kv.match_prefix_with(t, &options);
            assert_eq!(before, snapshot(kv), "match_prefix_with changed the state");
            false
        }
        Op::GroupViews(s, n, g) => {
            let _ = (
                kv.batch_block_tables_group(s, *g),
                kv.slot_mapping_group(s, *n, *g),
                kv.csr_page_table_group(s, *g),
                kv.csr_page_table(s),
            );
            false
        }
        Op::TakeNewBlockIds => {
            kv.take_new_block_ids();
            false
        }
        Op::StateHit(h, n, g) => {
            // A state group's look-up: read-only, whatever its arguments.
            let before = snapshot(kv);
            let _ = kv.longest_cached_block(h.as_deref().unwrap_or(&[]), *n, *g);
            assert_eq!(
                before,
                snapshot(kv),
                "longest_cached_block changed the state"
            );
            false
        }
        Op::GroupHits(h, n) => {
            let before = snapshot(kv);
            let hits = kv.group_hits(h.as_deref().unwrap_or(&[]), *n);
            assert_eq!(hits.len(), kv.kv_groups().len());
            assert!(hits.iter().all(|&t| t <= *n));
            assert_eq!(before, snapshot(kv), "group_hits changed the state");
            false
        }
        Op::NewStep => {
            kv.new_step();
            false
        }
        Op::ReleaseSkipped(s, n) => kv.release_skipped_blocks(*s, *n).is_err(),
        Op::TableMath(n, bs) => {
            let _ = BlockTable::blocks_for_tokens(*n, *bs);
            if let Ok(table) = kv.table(0) {
                let _ = (
                    table.free_slots(*bs),
                    table.num_full_blocks(*bs),
                    table.num_blocks(),
                );
            }
            false
        }
    }
}

fn managers() -> (Vec<KvCacheManager>, BlockPool) {
    let shared = Arc::new(BlockPool::new(14, 2).unwrap());
    let cached = ManagerConfig {
        enable_prefix_caching: true,
        num_host_blocks: 6,
        max_events: 8,
        enable_kv_events: true,
        ..Default::default()
    };
    let window = |window| KvGroupSpec::SlidingWindow { window };
    let cached_state = cached.clone();
    let kvs = vec![
        KvCacheManager::with_pool(Arc::clone(&shared), cached.clone()).unwrap(),
        KvCacheManager::with_pool(shared, ManagerConfig::default()).unwrap(),
        KvCacheManager::new(ManagerConfig {
            num_blocks: 10,
            block_size: 3,
            ..cached.clone()
        })
        .unwrap(),
        KvCacheManager::new(ManagerConfig {
            num_blocks: 16,
            block_size: 2,
            kv_groups: vec![KvGroupSpec::FullAttention, window(3)],
            ..cached.clone()
        })
        .unwrap(),
        KvCacheManager::new(ManagerConfig {
            num_blocks: 20,
            block_size: 2,
            kv_groups: vec![window(1), KvGroupSpec::FullAttention, window(5)],
            num_offload_blocks: 4,
            max_model_len: 24,
            max_in_flight_tokens: Some(6),
            watermark_blocks: 1,
            reserve_null_block: true,
            record_new_block_ids: true,
            ..cached
        })
        .unwrap(),
        KvCacheManager::new(ManagerConfig {
            num_blocks: 12,
            block_size: 3,
            kv_groups: vec![window(4)],
            record_new_block_ids: true,
            ..Default::default()
        })
        .unwrap(),
        KvCacheManager::new(ManagerConfig {
            num_blocks: 12,
            block_size: 2,
            kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
            num_host_blocks: 4,
            record_new_block_ids: true,
            reserve_null_block: true,
            ..cached_state
        })
        .unwrap(),
    ];
    (kvs, BlockPool::new(8, 4).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn no_public_call_panics(ops in prop::collection::vec((0usize..7, prop_oneof![3 => op(), 2 => chunk_op()]), 1..80)) {
        let (mut kvs, side_pool) = managers();
        for (which, op) in &ops {
            let kv = &mut kvs[*which];
            let before = snapshot(kv);
            let pending = kv.take_copy_ops();
            let result = catch_unwind(AssertUnwindSafe(|| apply(kv, op, &side_pool)));
            let failed = match result {
                Ok(failed) => failed,
                Err(_) => panic!("{op:?} panicked"),
            };
            if failed {
                prop_assert_eq!(snapshot(kv), before, "failed {:?} changed state", op);
                prop_assert!(kv.take_copy_ops().is_empty(), "failed {:?} left copy ops", op);
            }
            drop(pending);
            for kv in &mut kvs {
                let result = kv.check_invariants();
                prop_assert!(result.is_ok(), "after {:?}: {:?}", op, result);
            }
            prop_assert!(side_pool.check_invariants().is_ok());
        }
        // Every block comes back once every sequence is freed.
        for kv in &mut kvs {
            let ids: Vec<u64> = kv.seq_ids().collect();
            for id in ids {
                kv.free(id).unwrap();
            }
            kv.reset_prefix_cache();
            prop_assert!(kv.check_invariants().is_ok());
        }
        // Pins outlive frees and resets; dropping the managers releases them too.
        let pools: Vec<Arc<BlockPool>> = kvs.iter().map(|kv| Arc::clone(kv.pool())).collect();
        drop(kvs);
        prop_assert_eq!(pools[0].num_free_list_blocks(), 14);
        prop_assert_eq!(pools[2].num_free_list_blocks(), 10);
        prop_assert_eq!(pools[3].num_free_list_blocks(), 16);
        prop_assert_eq!(pools[4].num_free_list_blocks(), 20);
        prop_assert_eq!(pools[5].num_free_list_blocks(), 12);
    }

    #[test]
    fn constructors_take_any_config(
        num_blocks in count(),
        block_size in count(),
        num_host_blocks in prop_oneof![3 => 0usize..16, 1 => count()],
        num_offload_blocks in prop_oneof![3 => 0usize..16, 1 => count()],
        max_events in count(),
        hash_seed in any::<u64>(),
        enable_prefix_caching in any::<bool>(),
        enable_kv_events in any::<bool>(),
        kv_groups in prop_oneof![
            3 => Just(vec![KvGroupSpec::FullAttention]),
            1 => prop::collection::vec(prop_oneof![
                Just(KvGroupSpec::FullAttention),
                count().prop_map(|window| KvGroupSpec::SlidingWindow { window }),
                Just(KvGroupSpec::MambaState),
            ], 0..70),
        ],
        max_model_len in prop_oneof![3 => Just(usize::MAX), 1 => count()],
        max_in_flight_tokens in prop::option::of(count()),
        watermark_blocks in count(),
        reserve_null_block in any::<bool>(),
        record_new_block_ids in any::<bool>(),
    ) {
        let config = ManagerConfig {
            num_blocks, block_size, enable_prefix_caching, num_host_blocks, num_offload_blocks,
            hash_seed, max_events, enable_kv_events, kv_groups: kv_groups.clone(), max_model_len,
            max_in_flight_tokens, watermark_blocks, reserve_null_block, record_new_block_ids,
        };
        let result = catch_unwind(|| {
            let mut created = [false; 3];
            if let Ok(mut kv) = KvCacheManager::new(config.clone()) {
                kv.check_invariants().unwrap();
                created[0] = true;
            }
            if let Ok(pool) = BlockPool::new(num_blocks, block_size) {
                pool.check_invariants().unwrap();
                pool.check_invariants_quiescent().unwrap();
                created[1] = true;
            }
            let shared = Arc::new(BlockPool::new(4, 4).unwrap());
            if let Ok(mut kv) = KvCacheManager::with_pool(shared, config.clone()) {
                kv.check_invariants().unwrap();
                created[2] = true;
            }
            created
        });
        prop_assert!(result.is_ok(), "{:?} panicked", config);
        // Refusing is right only where the documented geometry rules fail: a constructor that
        // refused every valid config would pass the "no panic" check alone.
        let geometry = |blocks: usize, size: usize| {
            (1..=MAX_NUM_BLOCKS).contains(&blocks)
                && size >= 1
                && blocks.checked_mul(size).is_some_and(|slots| slots <= MAX_NUM_SLOTS)
        };
        let host = |size: usize| num_host_blocks == 0 || geometry(num_host_blocks, size);
        // The offload tier keeps evicted prefix blocks: it needs prefix caching.
        let offload = |size: usize| {
            num_offload_blocks == 0
                || (enable_prefix_caching && geometry(num_offload_blocks, size))
        };
        // Groups: one to 64, every window at least one token; a model length of a token at
        // least. The null block takes block 0 of a pool of its own (the fresh pool of `new`,
        // and the fresh shared pool below, whose block 0 is free too).
        let groups = (1..=64).contains(&kv_groups.len())
            && kv_groups.iter().all(|g| g.window() != Some(0))
            && max_model_len >= 1;
        let expected = [
            geometry(num_blocks, block_size) && host(block_size) && offload(block_size) && groups,
            geometry(num_blocks, block_size),
            host(4) && offload(4) && groups,
        ];
        prop_assert_eq!(result.unwrap(), expected, "{:?}", config);
    }
}
