//! The plain path's admission: any group list, the reserve or the per-chunk contract,
//! lookahead, caller-supplied keys and hashes (docs/design.md, KV groups and Per-chunk
//! allocation). The single full-attention group's default admission keeps its tuned path
//! (`admission.rs`); both are compared with the same reference by the model test.

use std::sync::Arc;

use super::config::PrefillCheckpoint;
use super::config::{AdmitOptions, Prompt};
use super::group_spec::{has_state_group, NULL_BLOCK};
use super::hits::{GroupHit, Place};
use super::keys::{given_prompt_hashes, BlockKeys, PromptHashes};
use super::policy::{
    checkpoint_blocks, fresh_for_positions, grow_table, prefill_checkpoint, state_table_bound,
    validate_checkpoint,
};
use super::state::{GroupTables, KvCacheManager, SeqHashing, Sequence};
use super::state_diverged;
use super::state_external;
use crate::error::{invalid, Error, Result, Tier};
use crate::prefix::hash::group_key;
use crate::table::BlockTable;
use crate::{BlockId, SeqId};

/// What an admission takes, validated and counted before anything changes.
struct AdmitPlan {
    /// The hit and where each group's hit blocks are.
    hit: GroupHit,
    /// Table positions of every group after admission.
    num_positions: usize,
    /// Fresh blocks over every group: new positions and device blocks for host hits.
    fresh: usize,
    /// Device hit blocks that are cached-evictable (revived; an eviction must not take them).
    revived: usize,
    /// The computed watermark after admission.
    num_computed: usize,
    /// Per group, the first position that takes a fresh block: the hit's end, or past it
    /// where a window at the hit plus the external computed tokens left earlier positions
    /// (those are the null entry, never allocated).
    first_fresh: Vec<usize>,
    /// Per group, the end of the positions that take fresh blocks first, every group's in
    /// turn, before the rest of every group's: those of the external computed tokens, as
    /// vLLM allocates them for every group before the new tokens' (`allocate_new_computed_blocks`,
    /// then `allocate_new_blocks`); without external tokens, all of them (one group after the
    /// other).
    external_end: Vec<usize>,
    /// The state groups' prefill check-point position, when the admitted chunk takes one.
    checkpoint: Option<usize>,
}

impl KvCacheManager {
    /// Admits a sequence with everything an admission can ask (docs/design.md, Per-chunk
    /// allocation): the reserve contract (`reserve_prompt`, the default: blocks for the whole
    /// prompt) or the per-chunk one (blocks for the hit plus `num_scheduled` tokens only, after
    /// vLLM's admission check: the whole prompt must fit after the hit, each window group at
    /// most at its admission cap, plus `ManagerConfig::watermark_blocks`; only the chunk
    /// without `require_full_prompt`), lookahead slots,
    /// and caller-supplied per-block keys and hashes. Returns the prompt tokens served from
    /// the cache. A refusal (`OutOfBlocks`, `InvalidArgument`, `SequenceExists`) changes
    /// nothing.
    ///
    /// ```
    /// use pagedkv::{AdmitOptions, KvCacheManager, ManagerConfig, Prompt};
    /// let mut kv = KvCacheManager::new(ManagerConfig { num_blocks: 8, block_size: 4, ..Default::default() })?;
    /// let prompt: Vec<u32> = (0..20).collect();            // 5 blocks
    /// let per_chunk = AdmitOptions { num_scheduled: 6, reserve_prompt: false, ..Default::default() };
    /// kv.add_sequence_with(1, Prompt::Tokens(&prompt), &per_chunk)?;
    /// assert_eq!(kv.block_table(1)?.len(), 2);             // the first chunk only
    /// assert_eq!((kv.num_tokens(1)?, kv.num_computed_tokens(1)?), (20, 6));
    /// assert!(kv.allocate_slots(1, 14, 0)?);               // the rest of the prompt
    /// assert_eq!(kv.block_table(1)?.len(), 5);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn add_sequence_with(
        &mut self,
        seq_id: SeqId,
        prompt: Prompt<'_>,
        options: &AdmitOptions<'_>,
    ) -> Result<usize> {
        let o = options;
        if o.block_hashes.is_some() || o.prompt_hashes.is_some_and(|h| !h.is_empty()) {
            if let Some(prefix) = self.prefix.as_mut() {
                prefix.expect_caller_names();
            }
        }
        let tuned = self.tuned
            && o.reserve_prompt
            && o.num_lookahead_tokens == 0
            && o.block_extra_keys.is_none()
            && o.block_hashes.is_none()
            && !o.diverged_hit;
        match prompt {
            Prompt::Tokens(t) if tuned && self.prefix.is_some() => match o.prompt_hashes {
                None => self.admit_cached::<false>(seq_id, t, o.extra_key, o.num_scheduled, &[]),
                Some(_) => {
                    let given = given_prompt_hashes(o, t.len(), true, self.block_size)?;
                    self.admit_cached::<true>(seq_id, t, o.extra_key, o.num_scheduled, given)
                }
            },
            _ if tuned && o.prompt_hashes.is_some() => {
                // Validated (no token ids is an error); without prefix caching they are unused.
                given_prompt_hashes(o, prompt.len(), prompt.tokens().is_some(), self.block_size)?;
                self.admit(seq_id, prompt.len(), o.num_scheduled)
            }
            _ if tuned => self.admit(seq_id, prompt.len(), o.num_scheduled),
            _ => self.admit_groups(seq_id, prompt, o),
        }
    }

    /// The plain path of [`Self::add_sequence_with`].
    #[cold]
    #[inline(never)]
    pub(super) fn admit_groups(
        &mut self,
        seq_id: SeqId,
        prompt: Prompt<'_>,
        o: &AdmitOptions<'_>,
    ) -> Result<usize> {
        if self.seqs.contains_key(&seq_id) {
            return Err(Error::SequenceExists(seq_id));
        }
        if o.num_lookahead_tokens > 0 && has_state_group(&self.config.kv_groups) {
            return invalid(
                "a MambaState group takes no lookahead slots (its state block is the chunk's \
                 last token's)",
            );
        }
        let bs = self.block_size;
        let tokens = prompt.tokens();
        if o.diverged_hit {
            let (specs, caching) = (&self.config.kv_groups, self.prefix.is_some());
            state_diverged::check_option(specs, caching, tokens.is_some(), o)?;
        }
        let num_tokens = prompt.len();
        let keys = BlockKeys::from_admission(
            o.extra_key,
            o.block_extra_keys,
            o.block_hashes,
            num_tokens,
            tokens.is_some(),
            bs,
        )?;
        let given = given_prompt_hashes(o, num_tokens, tokens.is_some(), bs)?;
        self.check_admission_fits(num_tokens, o)?;
        let seq_key: Option<Arc<[u8]>> = o.extra_key.map(Arc::from);
        let caching = self.prefix.is_some() && tokens.is_some();
        let hasher = self.prefix.as_ref().map(|p| p.hasher);
        let mut hashes = tokens.zip(hasher).map(|(t, hasher)| {
            PromptHashes::new(hasher, bs, t, &seq_key, keys.as_deref()).with_given(given)
        });
        let hit = match hashes.as_mut() {
            Some(h) if caching => {
                let max_blocks = num_tokens.saturating_sub(1) / bs;
                self.find_group_hit_on(h, max_blocks, true, o.diverged_hit)
            }
            _ => GroupHit {
                num_blocks: 0,
                places: vec![Vec::new(); self.num_groups()],
                state_own: Vec::new(),
            },
        };
        let state_this_step = match hashes.as_mut() {
            Some(hs) if hit.num_blocks > 0 => self.hits_state_this_step(&hit, hs),
            _ => false,
        };
        let plan = self.plan_admission(hit, num_tokens, o, state_this_step)?;

        // Reserve the fresh blocks; the cached hits are pinned so no eviction takes them.
        let mut fresh_blocks: Vec<BlockId> = Vec::with_capacity(plan.fresh);
        let reservation = self.reserve_fresh(plan.fresh, plan.revived, &mut fresh_blocks)?;

        // Commit (infallible from here): hits first, so the eviction cannot take them.
        for b in plan.hit.device_blocks().collect::<Vec<_>>() {
            self.take_hit(b);
        }
        let host_hits: Vec<BlockId> = plan
            .hit
            .places
            .iter()
            .flatten()
            .filter_map(|p| match *p {
                Place::Host(h) => Some(h),
                _ => None,
            })
            .collect();
        self.pin_host_hits(&host_hits);
        self.complete_fresh(reservation, &mut fresh_blocks);
        let h = plan.hit.num_blocks;
        let mut supply = fresh_blocks.into_iter();
        let mut first_fresh = plan.first_fresh.iter().copied();
        let mut external_end = plan.external_end.iter().copied();
        let (mut loads_from, mut loads_to) = (Vec::new(), Vec::new());
        let mut tables: Vec<Vec<BlockId>> = plan
            .hit
            .places
            .iter()
            .zip(&self.config.kv_groups)
            .map(|(places, spec)| {
                let mut t = Vec::with_capacity(plan.num_positions);
                for &p in places {
                    t.push(match p {
                        Place::Device(b) => b,
                        Place::Released => NULL_BLOCK,
                        Place::Host(hb) => {
                            let d = supply.next().expect("planned block");
                            loads_from.push(hb);
                            loads_to.push(d);
                            d
                        }
                    });
                }
                // A state group's check-point block, below its chunk's last position (its
                // positions between are null: grow_table's order).
                if let Some(p) = plan
                    .checkpoint
                    .filter(|&p| spec.takes_checkpoint(p, t.len(), plan.num_positions))
                {
                    t.resize(p, NULL_BLOCK);
                    t.extend(supply.by_ref().take(1));
                }
                t.resize(
                    first_fresh.next().expect("one per group").max(h),
                    NULL_BLOCK,
                );
                let end = external_end
                    .next()
                    .expect("one per group")
                    .min(plan.num_positions);
                t.extend(supply.by_ref().take(end.saturating_sub(t.len())));
                t
            })
            .collect();
        // A state group's later new positions are null but its last (grow_table).
        for (t, spec) in tables.iter_mut().zip(&self.config.kv_groups) {
            grow_table(spec, t, plan.num_positions, None, &mut supply);
        }
        debug_assert!(supply.next().is_none());
        self.record_loads(&loads_from, &loads_to);
        // Hashing starts after the leading positions every group took from the device (a
        // block loaded from the host is new content here, entered as it is computed).
        let first_load = plan
            .hit
            .places
            .iter()
            .filter_map(|p| p.iter().position(|x| matches!(x, Place::Host(_))))
            .min()
            .unwrap_or(h);
        let hashing = match (tokens, hashes) {
            (Some(t), Some(mut hs)) if caching => {
                if first_load > 0 {
                    hs.get(first_load - 1);
                }
                let block_hashes = hs.hashes[..first_load].to_vec();
                let prefix = self.prefix.as_mut().expect("caching");
                prefix.query_tokens += num_tokens as u64;
                prefix.hit_tokens += (h * bs) as u64;
                Some(SeqHashing {
                    extra_key: seq_key.clone(),
                    block_hashes,
                    pending_tokens: t[first_load * bs..].to_vec(),
                    keys: match keys {
                        None if given.len() > first_load => Some(BlockKeys::given(given)),
                        keys => keys,
                    },
                })
            }
            _ => None,
        };
        let rest = tables.split_off(1);
        let table0 = tables.pop().expect("one group at least");
        self.seqs.insert(
            seq_id,
            Sequence {
                table: BlockTable {
                    block_ids: table0,
                    num_tokens,
                },
                groups: GroupTables::new(rest),
                swapped: false,
                per_chunk: !o.reserve_prompt,
                hashing,
                num_computed: plan.num_computed,
            },
        );
        self.note_placed_all(seq_id, 0..h, false);
        self.note_placed_all(seq_id, h..plan.num_positions, true);
        self.index_ready(seq_id);
        Ok(h * bs)
    }

    /// InvalidArgument when the prompt can never be admitted: longer than `max_model_len`, or,
    /// without any hit, more blocks than the pool has (the whole prompt and lookahead in every
    /// group under the reserve contract; each window group at most at its admission cap under
    /// the per-chunk one with `require_full_prompt`; nothing more without it).
    fn check_admission_fits(&self, num_tokens: usize, o: &AdmitOptions<'_>) -> Result<()> {
        let bs = self.block_size;
        let max_len = self.config.max_model_len;
        if num_tokens > max_len {
            return invalid(format!(
                "a prompt of {num_tokens} tokens is longer than max_model_len={max_len}"
            ));
        }
        let usable = self.num_usable_blocks();
        let needed = if o.reserve_prompt {
            let slots = num_tokens + o.num_lookahead_tokens.min(max_len - num_tokens);
            let positions = slots.div_ceil(bs);
            fresh_for_positions(&self.config.kv_groups, 0, positions)
                .max(state_table_bound(&self.config.kv_groups, positions))
        } else if o.require_full_prompt {
            self.admission_requirement(num_tokens, 0, &[], o.num_external_computed_tokens, None)
                .max(state_table_bound(
                    &self.config.kv_groups,
                    num_tokens.min(max_len).div_ceil(bs),
                ))
        } else {
            // Only the scheduled chunk must fit (`plan_admission`, once the hit is known).
            return Ok(());
        };
        if needed > usable {
            return invalid(format!(
                "{num_tokens} tokens need {needed} blocks over {} kv_groups, more than the \
                 pool's {usable} blocks of {bs} tokens",
                self.num_groups()
            ));
        }
        Ok(())
    }

    /// vLLM's admission requirement (`get_num_blocks_to_allocate(..., apply_admission_cap=
    /// True)`): per group, the prompt's blocks (at most `max_model_len`, a window group at
    /// most its admission cap) less the hit's `hit_blocks` positions or, when more, the
    /// positions a window at `computed_tokens` (the hit plus external computed tokens) left,
    /// plus the hit's cached-evictable blocks (`revived_per_group`, empty for none).
    fn admission_requirement(
        &self,
        num_tokens: usize,
        hit_blocks: usize,
        revived_per_group: &[usize],
        computed_tokens: usize,
        checkpoint: Option<&PrefillCheckpoint>,
    ) -> usize {
        let bs = self.block_size;
        let full_tokens = num_tokens.min(self.config.max_model_len);
        let full = full_tokens.div_ceil(bs);
        // The whole prompt's chunk from the computed tokens: its check-point counts (vLLM's
        // check asks the state group the chunk's question).
        let whole_checkpoint =
            checkpoint.and_then(|c| prefill_checkpoint(c, bs, computed_tokens, full_tokens));
        let in_flight = self.config.in_flight_cap();
        let max_len = self.config.max_model_len;
        self.config
            .kv_groups
            .iter()
            .enumerate()
            .map(|(g, spec)| {
                let required = spec
                    .admission_cap_blocks(bs, in_flight, max_len)
                    .map_or(full, |cap| full.min(cap));
                let skipped = spec.skipped_blocks(computed_tokens, bs);
                let first = hit_blocks.max(skipped);
                let new = required.saturating_sub(first);
                let extra = checkpoint_blocks(
                    std::slice::from_ref(spec),
                    whole_checkpoint,
                    first,
                    required,
                );
                spec.fresh_cap().map_or(new, |c| (c + extra).min(new))
                    + revived_per_group.get(g).copied().unwrap_or(0)
            })
            .fold(0usize, usize::saturating_add)
    }

    /// Counts what admitting with `hit` takes and checks it is available now (vLLM's two
    /// checks under the per-chunk contract, only the second without `require_full_prompt`,
    /// the allocation's under the reserve one, each with the watermark): OutOfBlocks when not,
    /// or when the hit ends at a state block cached in this step (`state_this_step`: vLLM
    /// counts the pool's blocks plus one then, so that the request waits for the next step);
    /// InvalidArgument when the scheduled chunk alone could never fit.
    fn plan_admission(
        &self,
        mut hit: GroupHit,
        num_tokens: usize,
        o: &AdmitOptions<'_>,
        state_this_step: bool,
    ) -> Result<AdmitPlan> {
        let bs = self.block_size;
        let ng = self.num_groups();
        let max_len = self.config.max_model_len;
        let h = hit.num_blocks;
        let hit_tokens = h * bs;
        let num_computed = hit_tokens + o.num_scheduled.min(num_tokens - hit_tokens);
        // External computed tokens (a connector's) count as computed for the window release
        // before anything is sized (per-chunk only; the reserve contract holds everything).
        let external = if o.reserve_prompt {
            0
        } else {
            o.num_external_computed_tokens
        };
        if external > num_computed - hit_tokens {
            return invalid(format!(
                "{external} external computed tokens, more than the {} scheduled tokens after \
                 the hit of {hit_tokens}",
                num_computed - hit_tokens
            ));
        }
        let released_at = hit_tokens + external;
        validate_checkpoint(o.prefill_checkpoint.as_ref())?;
        if o.prefill_checkpoint.is_some() && (external > 0 || o.diverged_hit) {
            return invalid(
                "prefill check-points with external computed tokens or a diverged hit are not \
                 supported",
            );
        }
        // Per chunk only (the reserve contract's prompt is one allocation of every block).
        let checkpoint = o
            .prefill_checkpoint
            .filter(|_| !o.reserve_prompt)
            .and_then(|c| prefill_checkpoint(&c, bs, hit_tokens, num_computed));
        if external > 0 && released_at.div_ceil(bs) > self.num_usable_blocks() {
            // A connector's tokens the pool could never have held: a window-only table of
            // that many null positions would only cost memory (full attention needs their
            // blocks, so vLLM refuses such an admission there).
            return invalid(format!(
                "the hit and {external} external computed tokens pass the pool's {} blocks of \
                 {bs} tokens",
                self.num_usable_blocks()
            ));
        }
        let slots = if o.reserve_prompt {
            num_tokens + o.num_lookahead_tokens.min(max_len - num_tokens)
        } else {
            num_computed
                .saturating_add(o.num_lookahead_tokens)
                .min(max_len)
        };
        let num_positions = slots.div_ceil(bs);
        // A state group's new positions are null but the last (`fresh_positions`).
        let first_fresh: Vec<usize> = self
            .config
            .kv_groups
            .iter()
            .map(|spec| {
                if spec.is_state() && external > 0 {
                    // One block at the last external token's (state_external.rs).
                    return state_external::external_span(released_at, bs).0;
                }
                let first = spec.skipped_blocks(released_at, bs).max(h);
                spec.fresh_positions(first, num_positions).start
            })
            .collect();
        // A window group whose window keeps none of the external tokens (one token) allocates
        // none for them; the others up to their end.
        let external_end: Vec<usize> = self
            .config
            .kv_groups
            .iter()
            .zip(&first_fresh)
            .map(|(spec, &f)| match spec.window() {
                _ if external == 0 => usize::MAX,
                _ if spec.is_state() => state_external::external_span(released_at, bs).1,
                Some(1) => f,
                _ => released_at.div_ceil(bs).max(f),
            })
            .collect();
        // vLLM counts a state group's hit block, though an admission with external tokens
        // never takes it (state_external.rs): its place before the release below, or, on a
        // diverged hit, the group's own hit block below it (state_diverged.rs).
        let state_hits: Vec<Option<Place>> = if o.diverged_hit {
            hit.state_own
                .iter()
                .map(|own| own.map(|(_, p)| p))
                .collect()
        } else if external > 0 && h > 0 {
            hit.places
                .iter()
                .zip(&self.config.kv_groups)
                .map(|(places, spec)| spec.is_state().then(|| places[h - 1]))
                .collect()
        } else {
            Vec::new()
        };
        if external > 0 {
            // The hit's positions the window left at the hit plus the external tokens are
            // released from the start: neither taken nor counted (vLLM skips them).
            for (g, spec) in self.config.kv_groups.iter().enumerate() {
                let skip = spec.skipped_blocks(released_at, bs).min(h);
                hit.places[g][..skip].fill(Place::Released);
            }
        }
        // Under the per-chunk contract a window group holds only what its window at the hit
        // leaves (the hit's earlier positions are released); under the reserve one, everything.
        let live = if o.reserve_prompt {
            fresh_for_positions(&self.config.kv_groups, 0, num_positions)
        } else {
            self.live_positions(num_positions, released_at)
        }
        .max(state_table_bound(&self.config.kv_groups, num_positions));
        if live > self.num_usable_blocks() {
            return invalid(format!(
                "the scheduled {} tokens need {live} blocks over {ng} kv_groups, more than the \
                 pool's {} blocks",
                slots - hit_tokens,
                self.num_usable_blocks()
            ));
        }
        let is_cached = |b: BlockId| self.prefix.as_ref().is_some_and(|p| p.is_cached(b));
        let mut revived_per_group = vec![0usize; ng];
        let mut loads = 0;
        for (g, places) in hit.places.iter().enumerate() {
            for p in places {
                match *p {
                    Place::Device(b) if is_cached(b) => revived_per_group[g] += 1,
                    Place::Device(b) => {
                        if self.pool.refcount(b)? == u32::MAX {
                            return invalid(format!("block {b} refcount would overflow"));
                        }
                    }
                    Place::Host(_) => loads += 1,
                    Place::Released => {}
                }
            }
        }
        let revived: usize = revived_per_group.iter().sum();
        let group_fresh = |g: usize| {
            let spec = &self.config.kv_groups[g];
            state_external::group_fresh(spec, first_fresh[g], external_end[g], num_positions)
        };
        let fresh = (0..ng).map(group_fresh).sum::<usize>()
            + checkpoint_blocks(&self.config.kv_groups, checkpoint, h, num_positions)
            + loads;
        // What vLLM's checks count: the allocation, but for a state group admitted with
        // external tokens, vLLM's count of it (state_external.rs); `revived_per_group` becomes
        // the counted revivals (the actual ones are `revived`).
        let mut counted = fresh;
        let mut counted_revived = revived_per_group;
        if external > 0 {
            for (g, spec) in self.config.kv_groups.iter().enumerate() {
                if spec.is_state() {
                    let hit_state = state_hits.get(g).copied().flatten();
                    let c = state_external::counted_blocks(hit_state, is_cached);
                    counted = counted - group_fresh(g) + 1;
                    counted_revived[g] += c - 1;
                }
            }
        }
        let counted_revived_total: usize = counted_revived.iter().sum();
        let watermark = if o.apply_watermark {
            self.config.watermark_blocks
        } else {
            0
        };
        let available = self.num_available_blocks();
        let short = |needed: usize| Error::OutOfBlocks {
            tier: Tier::Device,
            needed_blocks: needed,
            available_blocks: available,
        };
        if state_this_step {
            return Err(short(self.num_usable_blocks() + 1));
        }
        if !o.reserve_prompt && o.require_full_prompt {
            let required = self
                .admission_requirement(
                    num_tokens,
                    h,
                    &counted_revived,
                    released_at,
                    o.prefill_checkpoint.as_ref(),
                )
                .saturating_add(loads)
                .saturating_add(watermark);
            if required > available {
                return Err(short(required));
            }
        }
        let needed =
            (counted + counted_revived_total + watermark).saturating_add(o.reserved_blocks);
        if needed > available {
            return Err(short(needed));
        }
        if fresh + revived > available {
            // vLLM's count passed, its allocation (a state group's two blocks with external
            // tokens) does not fit: vLLM's pool raises; refused here, nothing changed.
            return Err(short(fresh + revived));
        }
        Ok(AdmitPlan {
            hit,
            num_positions,
            fresh,
            revived,
            num_computed,
            first_fresh,
            external_end,
            checkpoint,
        })
    }

    /// Whether `hit` ends, in a state group, at a device block whose content a state block
    /// cached in this step holds (vLLM's `cached_blocks_this_step`; prefix/states_this_step.rs).
    fn hits_state_this_step(&self, hit: &GroupHit, hashes: &mut PromptHashes<'_>) -> bool {
        let Some(prefix) = self.prefix.as_ref() else {
            return false;
        };
        let last = hit.num_blocks - 1;
        self.config.kv_groups.iter().enumerate().any(|(g, spec)| {
            // A diverged hit: the group's own hit block (state_diverged.rs).
            let at = match hit.state_own.get(g) {
                Some(&Some((i, p))) => Some((i, p)),
                Some(None) => None,
                None => hit.places[g].get(last).map(|&p| (last, p)),
            };
            spec.is_state()
                && matches!(at, Some((_, Place::Device(_))))
                && at.is_some_and(|(i, _)| {
                    let key = group_key(g as u32, hashes.get(i));
                    prefix.states_this_step.contains(key)
                })
        })
    }

    /// Takes one more reference on hit block `b`: `revive_cached` when it is cached-evictable
    /// (refcount 0 -> 1, hash kept), else `share` (refcount + 1; its refcount was checked).
    pub(super) fn take_hit(&mut self, b: BlockId) {
        if self.prefix.as_ref().is_some_and(|p| p.is_cached(b)) {
            self.revive_cached(b);
        } else {
            let shared = self.share(b);
            debug_assert!(shared.is_ok(), "share of a hit block failed: {shared:?}");
        }
    }
}
