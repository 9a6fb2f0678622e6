//! Model-based test over every group list (docs/design.md, KV groups and Per-chunk
//! allocation): random operation sequences (admission under the reserve and the per-chunk
//! contract, append / batch append / fork / free / copy-on-write, prefix hits and evictions,
//! swap-out / swap-in, cache reset, chunked prefill with the computed watermark,
//! `allocate_slots` with lookahead, in-flight tokens and rollback, ids given later,
//! match_prefix, truncate, pin / unpin) against a tiny reference model, with
//! `check_invariants()` and a structural comparison after every step.
//!
//! The group lists: the single full-attention group (the tuned paths), and full plus windows,
//! windows alone, two full groups (the plain group loop). The model tracks each sequence's
//! tables per group as abstract ids with refcounts (`None` at a window's released positions),
//! the prefix index keyed by (group, extra key, full token prefix), the LRU of cached blocks
//! and the host tier. After each step the manager's tables must match the model's up to a
//! renaming of blocks (a bijection model block <-> physical block, kept across steps), the
//! refcounts, cached-block order and host tables must agree, and every error must be the one
//! the model predicts (same variant, same numbers). With `record_new_block_ids`, a mirror of
//! the tables patched only from `take_new_block_ids` must equal the real tables every step.
//! An index rebuilt only from the KV events (`model/replay.rs`) must predict
//! `match_prefix` for every base prompt after every step.

use std::collections::{BTreeMap, HashMap};

use pagedkv::{
    AdmitOptions, BlockId, Error, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt, SlotOptions,
    NULL_BLOCK,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add(u64, usize),
    AddPrompt {
        id: u64,
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
    Append(u64, usize),
    AppendTokens(u64, usize),
    AppendBatch {
        ids: Vec<u64>,
        n: usize,
        tokens: bool,
    },
    Fork(u64, u64),
    Free(u64),
    FreeBatch(Vec<u64>),
    TakeCopyOps,
    SwapOut(Vec<u64>),
    SwapIn(Vec<u64>),
    Reset,
    /// `release_skipped_blocks(id, computed - back)`, or one past the computed tokens.
    ReleaseSkipped {
        id: u64,
        back: usize,
        past: bool,
    },
    AddLenScheduled(u64, usize, usize),
    AddScheduled {
        id: u64,
        prompt: usize,
        len: usize,
        extra: Option<u8>,
        scheduled: usize,
    },
    Advance(Vec<u64>, usize),
    Truncate(u64, usize),
    /// Truncate to the sequence's length minus this many tokens (a rollback of drafts).
    TruncateBack(u64, usize),
    Match {
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
    Pin {
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
    Unpin {
        prompt: usize,
        len: usize,
        extra: Option<u8>,
    },
    /// Admission under the per-chunk contract (`reserve_prompt=False`), with lookahead.
    AddPerChunk {
        id: u64,
        prompt: usize,
        len: usize,
        extra: Option<u8>,
        scheduled: usize,
        lookahead: usize,
        tokens: bool,
        /// `require_full_prompt` (vLLM's `full_sequence_must_fit`).
        full: bool,
        /// `num_external_computed_tokens` (a KV connector's tokens).
        external: usize,
        /// `diverged_hit` (full attention's own run as the hit).
        diverged: bool,
    },
    /// `allocate_slots(id, new, lookahead, in_flight, computed = current - rollback)`.
    Slots {
        id: u64,
        new: usize,
        lookahead: usize,
        in_flight: usize,
        rollback: Option<usize>,
    },
    /// `provide_token_ids(id, the next n ids)`, with the watermark rolled back by `rollback`
    /// tokens (rejected drafts) when given.
    Provide(u64, usize, Option<usize>),
    /// `evict_blocks` of physical ids picked by these numbers (`evict_ids`): most in the pool,
    /// some past it.
    EvictBlocks(Vec<u32>),
}

/// The physical ids an `Op::EvictBlocks` names on a pool of `pool_blocks`: one number in eight
/// past the pool (the typed error), the others in it (in use, cached, free, the null block).
fn evict_ids(picks: &[u32], pool_blocks: usize) -> Vec<BlockId> {
    picks
        .iter()
        .map(|&v| match v % 8 {
            7 => (pool_blocks + (v as usize / 8) % 3) as BlockId,
            _ => (v as usize % pool_blocks) as BlockId,
        })
        .collect()
}

fn extra() -> impl Strategy<Value = Option<u8>> {
    prop_oneof![4 => Just(None), 1 => (0u8..2).prop_map(Some)]
}

fn count() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 0usize..12, 1 => 12usize..40, 1 => Just(usize::MAX), 1 => Just(usize::MAX / 2)]
}

fn id() -> impl Strategy<Value = u64> {
    0u64..6
}

fn ids(max: usize) -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(id(), 0..max)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (id(), count()).prop_map(|(i, n)| Op::Add(i, n)),
        4 => (id(), 0usize..3, 0usize..20, prop_oneof![4 => Just(None), 1 => (0u8..2).prop_map(Some)])
            .prop_map(|(id, prompt, len, extra)| Op::AddPrompt { id, prompt, len, extra }),
        2 => (id(), count()).prop_map(|(i, n)| Op::Append(i, n)),
        4 => (id(), 0usize..6).prop_map(|(i, n)| Op::AppendTokens(i, n)),
        2 => (ids(4), 0usize..4, any::<bool>()).prop_map(|(ids, n, tokens)| Op::AppendBatch { ids, n, tokens }),
        3 => (id(), id()).prop_map(|(p, c)| Op::Fork(p, c)),
        3 => id().prop_map(Op::Free),
        1 => ids(3).prop_map(Op::FreeBatch),
        1 => Just(Op::TakeCopyOps),
        2 => ids(3).prop_map(Op::SwapOut),
        2 => ids(3).prop_map(Op::SwapIn),
        1 => Just(Op::Reset),
        1 => (id(), count(), 0usize..12).prop_map(|(i, n, k)| Op::AddLenScheduled(i, n, k)),
        4 => (id(), 0usize..3, 0usize..20, extra(), prop_oneof![0usize..10, Just(usize::MAX)])
            .prop_map(|(id, prompt, len, extra, scheduled)| Op::AddScheduled { id, prompt, len, extra, scheduled }),
        4 => (ids(3), prop_oneof![4 => 0usize..6, 1 => Just(usize::MAX)]).prop_map(|(ids, n)| Op::Advance(ids, n)),
        2 => (id(), 0usize..24).prop_map(|(i, n)| Op::Truncate(i, n)),
        4 => (id(), 0usize..5).prop_map(|(i, n)| Op::TruncateBack(i, n)),
        2 => (0usize..3, 0usize..20, extra()).prop_map(|(prompt, len, extra)| Op::Match { prompt, len, extra }),
        2 => (0usize..3, 0usize..12, extra()).prop_map(|(prompt, len, extra)| Op::Pin { prompt, len, extra }),
        2 => (0usize..3, 0usize..12, extra()).prop_map(|(prompt, len, extra)| Op::Unpin { prompt, len, extra }),
        2 => prop::collection::vec(any::<u32>(), 0..4).prop_map(Op::EvictBlocks),
    ]
}

/// The per-chunk operations (added to `op()` in the per-chunk runs).
fn chunk_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (id(), 0usize..3, 0usize..24, extra(), 0usize..10, prop_oneof![3 => Just(0usize), 1 => 1usize..5], prop::bool::weighted(0.9), prop::bool::weighted(0.6), prop_oneof![2 => Just(0usize), 2 => 0usize..12], prop::bool::weighted(0.3))
            .prop_map(|(id, prompt, len, extra, scheduled, lookahead, tokens, full, external, diverged)| Op::AddPerChunk { id, prompt, len, extra, scheduled, lookahead, tokens, full, external, diverged }),
        6 => (id(), 0usize..8, prop_oneof![3 => Just(0usize), 1 => 1usize..5], prop_oneof![3 => Just(0usize), 1 => 1usize..6], prop::option::weighted(0.2, 0usize..4))
            .prop_map(|(id, new, lookahead, in_flight, rollback)| Op::Slots { id, new, lookahead, in_flight, rollback }),
        3 => (id(), 0usize..5, prop::option::weighted(0.2, 0usize..4)).prop_map(|(i, n, r)| Op::Provide(i, n, r)),
        2 => (id(), 0usize..6, prop::bool::weighted(0.1)).prop_map(|(id, back, past)| Op::ReleaseSkipped { id, back, past }),
    ]
}

/// The group lists under test: the single full-attention group, full plus a window, a window
/// alone, a window between two fulls, two windows, two full groups, full plus a state group, a
/// state group alone, full plus a state group and a window.
fn groups() -> impl Strategy<Value = Vec<KvGroupSpec>> {
    let w = (1usize..10).prop_map(|window| KvGroupSpec::SlidingWindow { window });
    let f = KvGroupSpec::FullAttention;
    prop_oneof![
        4 => Just(vec![f]),
        3 => w.clone().prop_map(move |w| vec![f, w]),
        1 => w.clone().prop_map(|w| vec![w]),
        1 => (w.clone(), w.clone()).prop_map(move |(a, b)| vec![a, f, b]),
        1 => (w.clone(), w.clone()).prop_map(|(a, b)| vec![a, b]),
        1 => Just(vec![f, f]),
        3 => Just(vec![f, KvGroupSpec::MambaState]),
        1 => Just(vec![KvGroupSpec::MambaState]),
        1 => w.prop_map(move |w| vec![f, KvGroupSpec::MambaState, w]),
    ]
}

/// Three base prompts: 1 shares its first 5 tokens with 0; 2 shares nothing.
fn prompt_tokens(prompt: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| match prompt {
            0 => (i % 7) as u32,
            1 if i < 5 => (i % 7) as u32,
            1 => 100 + i as u32,
            _ => 200 + (i % 3) as u32,
        })
        .collect()
}

/// Tokens a sequence of `len` tokens appends next: continuing pattern 0, so appended blocks
/// collide with prompt 0's blocks and get hit later.
fn next_tokens(len: usize, n: usize) -> Vec<u32> {
    (len..len + n).map(|i| (i % 7) as u32).collect()
}

#[path = "model/admission.rs"]
mod admission;
#[path = "model/host.rs"]
mod host;
#[path = "model/policy.rs"]
mod policy;
#[path = "model/reference.rs"]
mod reference;
#[path = "model/replay.rs"]
mod replay;
#[path = "model/slots.rs"]
mod slots;
#[path = "model/window.rs"]
mod window;

use policy::{hit_len, Limits};
use reference::{kind, Kind, MBlock, Model};
use replay::Replay;

/// Keeps the model-block <-> physical-block renaming consistent across steps.
#[derive(Default)]
struct Names {
    device: HashMap<MBlock, BlockId>,
    host: HashMap<MBlock, BlockId>,
}

fn bind(names: &mut HashMap<MBlock, BlockId>, m: MBlock, p: BlockId) {
    let named = *names.entry(m).or_insert(p);
    assert_eq!(named, p, "model block {m} maps to two physical blocks");
}

fn check_bijection(names: &HashMap<MBlock, BlockId>) {
    let mut back: HashMap<BlockId, MBlock> = HashMap::new();
    for (&m, &p) in names {
        if let Some(other) = back.insert(p, m) {
            panic!("physical block {p} stands for model blocks {m} and {other}");
        }
    }
}

/// The tables a model runner keeps, patched only from `take_new_block_ids`.
#[derive(Default)]
struct Mirror(HashMap<(u64, u32), Vec<BlockId>>);

impl Mirror {
    fn patch(&mut self, kv: &mut KvCacheManager) {
        let new = kv.take_new_block_ids();
        for i in 0..new.len() {
            let t = self.0.entry((new.seq_ids[i], new.groups[i])).or_default();
            let pos = new.positions[i] as usize;
            if t.len() <= pos {
                t.resize(pos + 1, u32::MAX - 1);
            }
            t[pos] = new.block_ids[i];
            assert_eq!(
                new.fresh[i],
                new.fresh[i] && new.block_ids[i] != NULL_BLOCK,
                "a released position marked fresh"
            );
        }
    }

    /// Every resident sequence's tables equal the mirror's first positions.
    fn check(&self, kv: &KvCacheManager, model: &Model) {
        for (&id, s) in &model.seqs {
            if s.swapped {
                continue;
            }
            for g in 0..model.ng() {
                let real = kv.block_table_group(id, g).unwrap();
                let mirror = self.0.get(&(id, g as u32)).map_or(&[][..], |t| &t[..]);
                assert!(
                    mirror.len() >= real.len() && &mirror[..real.len()] == real,
                    "seq {id} group {g}: mirror {mirror:?}, table {real:?}"
                );
            }
        }
    }
}

/// The manager's state must equal the model's up to renaming blocks.
fn compare(kv: &mut KvCacheManager, model: &Model, names: &mut Names) {
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_sequences(), model.seqs.len());
    assert_eq!(kv.num_available_blocks(), model.available());
    let stats = kv.stats();
    assert_eq!(stats.num_blocks_in_use, model.refcounts.len());
    assert_eq!(stats.num_cached_blocks, model.cached.len());
    assert_eq!(stats.blocks_evicted, model.evictions);
    assert_eq!(stats.prefix_hit_tokens, model.hit_tokens);
    assert_eq!(stats.num_pinned_blocks, model.pin_counts.len());
    assert_eq!(kv.num_free_host_blocks(), model.host_free());
    names
        .device
        .retain(|m, _| model.refcounts.contains_key(m) || model.key_of.contains_key(m));
    names.host.retain(|m, _| model.host_refs.contains_key(m));
    let bs = model.block_size;
    for (&id, s) in &model.seqs {
        assert_eq!(kv.num_tokens(id).unwrap(), s.num_tokens, "seq {id} tokens");
        assert_eq!(
            kv.num_computed_tokens(id).unwrap(),
            s.computed,
            "seq {id} computed"
        );
        assert_eq!(kv.num_slots(id).unwrap(), s.len() * bs, "seq {id} slots");
        assert_eq!(kv.is_swapped_out(id).unwrap(), s.swapped);
        for (g, mt) in s.tables.iter().enumerate() {
            let (table, host) = if s.swapped {
                (kv.host_block_table_group(id, g).unwrap(), true)
            } else {
                (kv.block_table_group(id, g).unwrap(), false)
            };
            assert_eq!(table.len(), mt.len(), "seq {id} group {g} table length");
            for (&p, &m) in table.iter().zip(mt) {
                let Some(m) = m else {
                    assert_eq!(p, NULL_BLOCK, "seq {id} group {g}: {table:?} vs {mt:?}");
                    continue;
                };
                assert_ne!(p, NULL_BLOCK, "seq {id} group {g}: {table:?} vs {mt:?}");
                if host {
                    bind(&mut names.host, m, p);
                    assert_eq!(kv.host_refcount(p).unwrap(), model.host_refs[&m]);
                } else {
                    bind(&mut names.device, m, p);
                    assert_eq!(
                        kv.refcount(p).unwrap(),
                        model.refcounts[&m],
                        "refcount of block {p}"
                    );
                }
            }
        }
    }
    check_bijection(&names.device);
    check_bijection(&names.host);
    let cached: Vec<BlockId> = model
        .cached
        .iter()
        .map(|m| {
            *names
                .device
                .get(m)
                .expect("a cached block was once in a table")
        })
        .collect();
    assert_eq!(kv.cached_blocks(), cached, "cached blocks / LRU order");
}

fn check_mapping(
    got: &[(BlockId, BlockId)],
    want: &[(MBlock, MBlock)],
    src: &mut HashMap<MBlock, BlockId>,
    dst: &mut HashMap<MBlock, BlockId>,
) {
    assert_eq!(got.len(), want.len(), "swap mapping length");
    for (&(ps, pd), &(ms, md)) in got.iter().zip(want) {
        if let Some(&p) = src.get(&ms) {
            assert_eq!(p, ps, "swap source block");
        }
        bind(dst, md, pd);
    }
}

/// One manager configuration under test.
#[derive(Debug, Clone)]
struct Setup {
    groups: Vec<KvGroupSpec>,
    num_blocks: usize,
    block_size: usize,
    caching: bool,
    num_host: usize,
    limits: Limits,
    log: bool,
}

const UNLIMITED: Limits = Limits {
    max_model_len: usize::MAX,
    max_in_flight: usize::MAX,
    watermark: 0,
};

fn run(setup: Setup, ops: Vec<Op>) {
    let Setup {
        groups,
        num_blocks,
        block_size,
        caching,
        num_host,
        limits,
        log,
    } = setup;
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: caching,
        enable_kv_events: caching,
        num_host_blocks: num_host,
        hash_seed: 99,
        kv_groups: groups.clone(),
        max_model_len: limits.max_model_len,
        max_in_flight_tokens: (limits.max_in_flight != limits.max_model_len)
            .then_some(limits.max_in_flight),
        watermark_blocks: limits.watermark,
        record_new_block_ids: log,
        ..Default::default()
    })
    .unwrap();
    let mut model = Model {
        specs: groups,
        num_blocks,
        block_size,
        caching,
        num_host,
        limits,
        seqs: BTreeMap::new(),
        refcounts: HashMap::new(),
        cached: Vec::new(),
        index: HashMap::new(),
        key_of: HashMap::new(),
        host_refs: HashMap::new(),
        next_block: 0,
        pending_copies: Vec::new(),
        evictions: 0,
        hit_tokens: 0,
        pins: HashMap::new(),
        pin_counts: HashMap::new(),
    };
    let mut names = Names::default();
    let mut mirror = Mirror::default();
    let mut replay = Replay::default();
    for op in ops {
        let len_of = |kv: &KvCacheManager, id: u64| kv.num_tokens(id).unwrap_or(0);
        let (got, want): (Result<usize, Error>, Result<usize, Kind>) = match &op {
            Op::Add(i, n) => (
                kv.add_sequence_len(*i, *n),
                model.add(*i, None, *n, None, usize::MAX, true, true, 0, 0),
            ),
            Op::AddLenScheduled(i, n, k) => (
                kv.add_sequence_len_scheduled(*i, *n, *k),
                model.add(*i, None, *n, None, *k, true, true, 0, 0),
            ),
            Op::AddScheduled {
                id,
                prompt,
                len,
                extra,
                scheduled,
            } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.add_sequence_scheduled(*id, &tokens, extra_bytes.as_deref(), *scheduled),
                    model.add(
                        *id,
                        Some(tokens.clone()),
                        *len,
                        *extra,
                        *scheduled,
                        true,
                        true,
                        0,
                        0,
                    ),
                )
            }
            Op::AddPerChunk {
                id,
                prompt,
                len,
                extra,
                scheduled,
                lookahead,
                tokens,
                full,
                external,
                diverged,
            } => {
                let t = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                let o = AdmitOptions {
                    extra_key: extra_bytes.as_deref(),
                    num_scheduled: *scheduled,
                    reserve_prompt: false,
                    require_full_prompt: *full,
                    num_lookahead_tokens: *lookahead,
                    num_external_computed_tokens: *external,
                    diverged_hit: *diverged,
                    ..Default::default()
                };
                let prompt = if *tokens {
                    Prompt::Tokens(&t)
                } else {
                    Prompt::Len(*len)
                };
                let model_tokens = tokens.then(|| t.clone());
                (
                    kv.add_sequence_with(*id, prompt, &o),
                    model.add_with(
                        *id,
                        model_tokens,
                        *len,
                        *extra,
                        (*scheduled, false, *full, *lookahead, *external),
                        *diverged,
                    ),
                )
            }
            Op::Slots {
                id,
                new,
                lookahead,
                in_flight,
                rollback,
            } => {
                let current = kv.num_computed_tokens(*id).unwrap_or(0);
                let computed = rollback.map(|r| current.saturating_sub(r));
                let o = SlotOptions {
                    num_lookahead_tokens: *lookahead,
                    num_in_flight_tokens: *in_flight,
                    num_computed_tokens: computed,
                    prefill_checkpoint: None,
                };
                (
                    kv.allocate_slots_with(*id, *new, &o).map(usize::from),
                    model
                        .allocate_slots(*id, *new, *lookahead, *in_flight, computed)
                        .map(usize::from),
                )
            }
            Op::Provide(id, n, rollback) => {
                let known = model
                    .seqs
                    .get(id)
                    .and_then(|s| s.tokens.as_ref())
                    .map_or(0, Vec::len);
                let ids = next_tokens(known, *n);
                let current = kv.num_computed_tokens(*id).unwrap_or(0);
                let computed = rollback.map(|r| current.saturating_sub(r));
                (
                    kv.provide_token_ids(*id, &ids, computed, None, None)
                        .map(|_| 0),
                    model.provide(*id, &ids, computed).map(|_| 0),
                )
            }
            Op::Advance(ids, n) => (
                kv.advance_computed(ids, *n).map(|_| 0),
                model.advance(ids, *n).map(|_| 0),
            ),
            Op::Truncate(i, n) => (
                kv.truncate(*i, *n).map(|_| 0),
                model.truncate(*i, *n).map(|_| 0),
            ),
            Op::TruncateBack(i, back) => {
                let n = len_of(&kv, *i).saturating_sub(*back);
                (
                    kv.truncate(*i, n).map(|_| 0),
                    model.truncate(*i, n).map(|_| 0),
                )
            }
            Op::Match { prompt, len, extra } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                replay.apply(kv.take_events());
                let (stats, cached) = (kv.stats(), kv.cached_blocks());
                let got = kv.match_prefix(&tokens, extra_bytes.as_deref());
                assert_eq!(kv.stats(), stats, "match_prefix changed the stats");
                assert_eq!(kv.cached_blocks(), cached, "match_prefix changed the LRU");
                assert!(kv.take_events().is_empty(), "match_prefix recorded events");
                (got, Ok(model.match_prefix(&tokens, *extra)))
            }
            Op::Pin { prompt, len, extra } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.pin_prefix(&tokens, extra_bytes.as_deref()),
                    Ok(model.pin(&tokens, *extra)),
                )
            }
            Op::Unpin { prompt, len, extra } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.unpin_prefix(&tokens, extra_bytes.as_deref()).map(|_| 0),
                    model.unpin(&tokens, *extra).map(|_| 0),
                )
            }
            Op::AddPrompt {
                id,
                prompt,
                len,
                extra,
            } => {
                let tokens = prompt_tokens(*prompt, *len);
                let extra_bytes = extra.map(|e| vec![e; 3]);
                (
                    kv.add_sequence(*id, &tokens, extra_bytes.as_deref()),
                    model.add(
                        *id,
                        Some(tokens.clone()),
                        *len,
                        *extra,
                        usize::MAX,
                        true,
                        true,
                        0,
                        0,
                    ),
                )
            }
            Op::Append(i, n) => (
                kv.append_len(*i, *n).map(|_| 0),
                model.append(*i, *n, None).map(|_| 0),
            ),
            Op::AppendTokens(i, n) => {
                let tokens = next_tokens(len_of(&kv, *i), *n);
                (
                    kv.append_tokens(*i, &tokens).map(|_| 0),
                    model.append(*i, *n, Some(&tokens)).map(|_| 0),
                )
            }
            Op::AppendBatch { ids, n, tokens } => {
                if *tokens {
                    let rows: Vec<Vec<u32>> = ids
                        .iter()
                        .map(|&i| next_tokens(len_of(&kv, i), *n))
                        .collect();
                    let flat: Vec<u32> = rows.concat();
                    (
                        kv.append_tokens_batch(ids, &flat, *n).map(|_| 0),
                        model.append_batch(ids, *n, Some(&rows)).map(|_| 0),
                    )
                } else {
                    (
                        kv.append_len_batch(ids, *n).map(|_| 0),
                        model.append_batch(ids, *n, None).map(|_| 0),
                    )
                }
            }
            Op::Fork(p, c) => (kv.fork(*p, *c).map(|_| 0), model.fork(*p, *c).map(|_| 0)),
            Op::Free(i) => (kv.free(*i).map(|_| 0), model.free(*i).map(|_| 0)),
            Op::FreeBatch(ids) => (
                kv.free_batch(ids).map(|_| 0),
                model.free_batch(ids).map(|_| 0),
            ),
            Op::TakeCopyOps => {
                let got = kv.take_copy_ops();
                let want = std::mem::take(&mut model.pending_copies);
                assert_eq!(got.len(), want.len());
                for ((ps, pd), (ms, md)) in got.into_iter().zip(want) {
                    if let Some(&p) = names.device.get(&ms) {
                        assert_eq!(p, ps, "copy src");
                    }
                    if let Some(&p) = names.device.get(&md) {
                        assert_eq!(p, pd, "copy dst");
                    }
                    assert_ne!(ps, pd);
                }
                (Ok(0), Ok(0))
            }
            Op::SwapOut(ids) => {
                let got = kv.swap_out(ids);
                let want = model.swap_out(ids);
                if let (Ok(g), Ok(w)) = (&got, &want) {
                    check_mapping(g, w, &mut names.device, &mut names.host);
                }
                (got.map(|_| 0), want.map(|_| 0))
            }
            Op::SwapIn(ids) => {
                let got = kv.swap_in(ids);
                let want = model.swap_in(ids);
                if let (Ok(g), Ok(w)) = (&got, &want) {
                    check_mapping(g, w, &mut names.host, &mut names.device);
                }
                (got.map(|_| 0), want.map(|_| 0))
            }
            Op::ReleaseSkipped { id, back, past } => {
                let current = kv.num_computed_tokens(*id).unwrap_or(0);
                let processed = if *past {
                    current + 1 + back
                } else {
                    current.saturating_sub(*back)
                };
                (
                    kv.release_skipped_blocks(*id, processed).map(|()| 0),
                    model.release_skipped(*id, processed).map(|()| 0),
                )
            }
            Op::Reset => (
                Ok(usize::from(kv.reset_prefix_cache())),
                Ok(usize::from(model.reset())),
            ),
            Op::EvictBlocks(picks) => {
                let pool_blocks = kv.pool().num_blocks();
                let ids = evict_ids(picks, pool_blocks);
                // The model block each physical id stands for (none: free or the null block).
                let blocks: Vec<Option<MBlock>> = ids
                    .iter()
                    .map(|&p| names.device.iter().find(|&(_, &q)| q == p).map(|(&m, _)| m))
                    .collect();
                let in_range = ids.iter().all(|&p| (p as usize) < pool_blocks);
                (kv.evict_blocks(&ids), model.evict_blocks(&blocks, in_range))
            }
        };
        match (&got, &want) {
            (Ok(g), Ok(w)) => assert_eq!(g, w, "{op:?}: return value"),
            (Err(e), Err(k)) => assert_eq!(&kind(e), k, "{op:?}"),
            _ => panic!("{op:?}: manager {got:?}, model {want:?}"),
        }
        compare(&mut kv, &model, &mut names);
        if log {
            mirror.patch(&mut kv);
            mirror.check(&kv, &model);
        }
        replay.apply(kv.take_events());
        check_replay(&kv, &replay, &model);
    }
}

/// The hit an index rebuilt from the events predicts for each base prompt (40 tokens, each
/// extra key) is what `match_prefix` returns: with the one full-attention group, the device
/// run then the host run; otherwise the groups' hit rule over what the events say each group
/// stores (on either tier).
fn check_replay(kv: &KvCacheManager, replay: &Replay, model: &Model) {
    let bs = model.block_size;
    for prompt in 0..3 {
        for extra in [None, Some(0u8), Some(1)] {
            let tokens = prompt_tokens(prompt, 40);
            let key = extra.map(|e| vec![e; 3]);
            let hashes = kv.prefix_block_hashes(&tokens, key.as_deref());
            let max_blocks = (tokens.len() - 1) / bs;
            let grouped = model.specs.len() > 1; // events carry group_idx
            let predicted = if model.specs == [KvGroupSpec::FullAttention] {
                replay.predict(&hashes, max_blocks)
            } else {
                hit_len(&model.specs, bs, max_blocks.min(hashes.len()), |g, i| {
                    replay.stored_in_group(grouped.then_some(g as u32), hashes[i])
                })
            } * bs;
            assert_eq!(
                kv.match_prefix(&tokens, key.as_deref()),
                Ok(predicted),
                "prompt {prompt}, extra {extra:?}: the hit differs from what the events say is stored"
            );
        }
    }
}

fn setup(
    groups: Vec<KvGroupSpec>,
    num_blocks: usize,
    block_size: usize,
    caching: bool,
    num_host: usize,
) -> Setup {
    Setup {
        groups,
        num_blocks,
        block_size,
        caching,
        num_host,
        limits: UNLIMITED,
        log: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, max_shrink_iters: 4000, ..ProptestConfig::default() })]

    /// The single full-attention group, the reserve contract (the tuned paths).
    #[test]
    fn manager_matches_model(
        // Small pools evict all the time; larger ones keep chains cached long enough for a
        // truncate or an eviction to cut one in its middle (where a hit was once lost).
        num_blocks in prop_oneof![1usize..12, 12usize..40],
        block_size in 1usize..5,
        caching in any::<bool>(),
        num_host in prop_oneof![Just(0usize), 1usize..12],
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(setup(vec![KvGroupSpec::FullAttention], num_blocks, block_size, caching, num_host), ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, max_shrink_iters: 4000, ..ProptestConfig::default() })]

    /// Every group list, both contracts, ids later, lookahead, rollback, the new-block log.
    #[test]
    fn every_group_count_matches_model(
        groups in groups(),
        num_blocks in 1usize..24,
        block_size in 1usize..5,
        caching in prop::bool::weighted(0.8),
        num_host in prop_oneof![Just(0usize), 1usize..16],
        limits in prop_oneof![
            3 => Just(UNLIMITED),
            1 => (8usize..40, 1usize..12, 0usize..3).prop_map(|(len, in_flight, watermark)| Limits {
                max_model_len: len,
                max_in_flight: in_flight,
                watermark,
            }),
        ],
        log in any::<bool>(),
        ops in prop::collection::vec(prop_oneof![3 => op(), 2 => chunk_op()], 1..60),
    ) {
        run(Setup { groups, num_blocks, block_size, caching, num_host, limits, log }, ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, max_shrink_iters: 4000, ..ProptestConfig::default() })]

    /// Full attention beside a state group on small pools, mostly per-chunk admissions (a
    /// third with the diverged hit: full attention's own run, the state group's own lagging
    /// hit block counted; manager/state_diverged.rs), frees and evictions.
    #[test]
    fn diverged_hits_match_model(
        num_blocks in 2usize..16,
        block_size in 1usize..4,
        ops in prop::collection::vec(prop_oneof![2 => op(), 3 => chunk_op()], 1..60),
    ) {
        let groups = vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState];
        run(setup(groups, num_blocks, block_size, true, 0), ops);
    }
}
