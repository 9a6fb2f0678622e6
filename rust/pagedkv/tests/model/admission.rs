//! Admission in the reference model (docs/design.md, KV groups and Per-chunk allocation): the
//! declarative hit rule (the longest `L` every group serves, or with a diverged hit the
//! full-attention groups' own run), `match_prefix`, and `add` under either contract, with its
//! lookahead, external tokens and state groups.

use pagedkv::{KvGroupSpec, Tier};

use crate::policy::{cap, fresh_cap, fresh_for, grow, hit_len, skipped, table_bound};
use crate::reference::{Kind, MBlock, MSeq, Model};

impl Model {
    /// The block holding group `g`'s block `i` of `t`, if cached.
    fn cached_block(&self, g: usize, t: &[u32], extra: Option<u8>, i: usize) -> Option<MBlock> {
        let bs = self.block_size;
        self.index
            .get(&(g, extra, t[..(i + 1) * bs].to_vec()))
            .copied()
    }

    /// The longest hit `<= max_blocks` every group serves (declarative), and per group the
    /// blocks at its positions (`None`: released). (See [`hit_len`].)
    pub fn hit(
        &self,
        t: &[u32],
        extra: Option<u8>,
        max_blocks: usize,
    ) -> (usize, Vec<Vec<Option<MBlock>>>) {
        let bs = self.block_size;
        let max = max_blocks.min(t.len() / bs);
        let l = hit_len(&self.specs, bs, max, |g, i| {
            self.cached_block(g, t, extra, i).is_some()
        });
        let places = self
            .specs
            .iter()
            .enumerate()
            .map(|(g, &spec)| {
                let skip = skipped(spec, l * bs, bs);
                (0..l)
                    .map(|i| (i >= skip).then(|| self.cached_block(g, t, extra, i).unwrap()))
                    .collect()
            })
            .collect();
        (l, places)
    }

    /// The diverged hit `<= max_blocks` (declarative): the longest run every full-attention
    /// group holds from block 0; a state group's positions all released.
    fn diverged_hit(
        &self,
        t: &[u32],
        extra: Option<u8>,
        max_blocks: usize,
    ) -> (usize, Vec<Vec<Option<MBlock>>>) {
        let max = max_blocks.min(t.len() / self.block_size);
        let full = |g: usize| self.specs[g] == KvGroupSpec::FullAttention;
        let l = (0..=max)
            .rev()
            .find(|&l| {
                (0..self.ng())
                    .filter(|&g| full(g))
                    .all(|g| (0..l).all(|i| self.cached_block(g, t, extra, i).is_some()))
            })
            .unwrap_or(0);
        let places = (0..self.ng())
            .map(|g| match full(g) {
                true => (0..l).map(|i| self.cached_block(g, t, extra, i)).collect(),
                false => vec![None; l],
            })
            .collect();
        (l, places)
    }

    pub fn match_prefix(&self, t: &[u32], extra: Option<u8>) -> usize {
        if !self.caching {
            return 0;
        }
        self.hit(t, extra, t.len().saturating_sub(1) / self.block_size)
            .0
            * self.block_size
    }

    /// Admission under either contract (`reserve`), with lookahead slots; per chunk, the
    /// whole-prompt check only with `whole` (vLLM's `full_sequence_must_fit`), and `external`
    /// of the scheduled tokens computed elsewhere: a window group's positions out of its
    /// window at the hit plus them are released before anything is counted (never allocated).
    #[allow(clippy::too_many_arguments)]
    pub fn add(
        &mut self,
        id: u64,
        tokens: Option<Vec<u32>>,
        n: usize,
        extra: Option<u8>,
        scheduled: usize,
        reserve: bool,
        whole: bool,
        lookahead: usize,
        external: usize,
    ) -> Result<usize, Kind> {
        let args = (scheduled, reserve, whole, lookahead, external);
        self.add_with(id, tokens, n, extra, args, false)
    }

    /// [`Self::add`], with `diverged`: the hit is the full-attention groups' own leading run,
    /// the state groups' hit positions all released, and each state group's own hit block (its
    /// rightmost cached block below the hit) counted when cached-evictable (vLLM's diverged
    /// admission); only per chunk, with external tokens, token ids, prefix caching and
    /// full-attention and state groups only (one of each at least).
    pub fn add_with(
        &mut self,
        id: u64,
        tokens: Option<Vec<u32>>,
        n: usize,
        extra: Option<u8>,
        (scheduled, reserve, whole, lookahead, external): (usize, bool, bool, usize, usize),
        diverged: bool,
    ) -> Result<usize, Kind> {
        if self.seqs.contains_key(&id) {
            return Err(Kind::Exists(id));
        }
        let (fa, st) = (KvGroupSpec::FullAttention, KvGroupSpec::MambaState);
        if diverged
            && (reserve
                || external == 0
                || tokens.is_none()
                || !self.caching
                || self.specs.iter().any(|&s| s != fa && s != st)
                || !self.specs.contains(&fa)
                || !self.specs.contains(&st))
        {
            return Err(Kind::Invalid);
        }
        let bs = self.block_size;
        let ng = self.ng();
        let lim = self.limits;
        if lookahead > 0 && self.specs.contains(&KvGroupSpec::MambaState) {
            return Err(Kind::Invalid);
        }
        if n > lim.max_model_len {
            return Err(Kind::Invalid);
        }
        let full = n.min(lim.max_model_len).div_ceil(bs);
        let external = if reserve { 0 } else { external };
        let never = if reserve {
            let positions = (n + lookahead.min(lim.max_model_len - n)).div_ceil(bs);
            fresh_for(&self.specs, 0, positions).max(table_bound(&self.specs, positions))
        } else if !whole {
            0
        } else {
            self.specs
                .iter()
                .map(|&s| {
                    let new = cap(s, bs, lim)
                        .map_or(full, |c| full.min(c))
                        .saturating_sub(skipped(s, external, bs));
                    fresh_cap(s).map_or(new, |c| c.min(new))
                })
                .fold(0usize, usize::saturating_add)
                .max(table_bound(&self.specs, full))
        };
        if never > self.num_blocks {
            return Err(Kind::Invalid);
        }
        let tokens = tokens.filter(|_| self.caching);
        let (l, mut places) = match &tokens {
            Some(t) if diverged => self.diverged_hit(t, extra, n.saturating_sub(1) / bs),
            Some(t) => self.hit(t, extra, n.saturating_sub(1) / bs),
            None => (0, vec![Vec::new(); ng]),
        };
        // A diverged hit's state groups count their own hit block below it.
        let own_state: Vec<Option<MBlock>> = match &tokens {
            Some(t) if diverged => (0..ng)
                .map(|g| match self.specs[g] {
                    KvGroupSpec::MambaState => {
                        (0..l).rev().find_map(|i| self.cached_block(g, t, extra, i))
                    }
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        let computed = l * bs + scheduled.min(n - l * bs);
        if external > computed - l * bs {
            return Err(Kind::Invalid);
        }
        let at = l * bs + external;
        if external > 0 && at.div_ceil(bs) > self.num_blocks {
            return Err(Kind::Invalid);
        }
        // Per group, the positions before `base` are the hit's or released.
        let base: Vec<usize> = self
            .specs
            .iter()
            .map(|&s| skipped(s, at, bs).max(l))
            .collect();
        // With external tokens a state group's hit positions are all released (its hit block
        // never taken), yet vLLM counts that block when cached-evictable: noted first.
        let state_hit_cached: Vec<bool> = self
            .specs
            .iter()
            .enumerate()
            .map(|(g, &s)| match diverged {
                true => own_state[g].is_some_and(|b| self.cached.contains(&b)),
                false => {
                    s == KvGroupSpec::MambaState
                        && external > 0
                        && l > 0
                        && places[g][l - 1].is_some_and(|b| self.cached.contains(&b))
                }
            })
            .collect();
        for (g, &s) in self.specs.iter().enumerate() {
            for p in places[g].iter_mut().take(skipped(s, at, bs)) {
                *p = None;
            }
        }
        let slots = if reserve {
            n + lookahead.min(lim.max_model_len - n)
        } else {
            computed.saturating_add(lookahead).min(lim.max_model_len)
        };
        let positions = slots.div_ceil(bs);
        // The first fresh position: a state group's is its last new one.
        let first: Vec<usize> = base
            .iter()
            .zip(&self.specs)
            .map(|(&b, &s)| match s {
                // One block at the last external token's position, one at the chunk's last.
                KvGroupSpec::MambaState if external > 0 => (at - 1) / bs,
                KvGroupSpec::MambaState if positions > b => positions - 1,
                _ => b,
            })
            .collect();
        let live = if reserve {
            fresh_for(&self.specs, 0, positions)
        } else {
            self.live(positions, at)
        }
        .max(table_bound(&self.specs, positions));
        if live > self.num_blocks {
            return Err(Kind::Invalid);
        }
        let revived_now: Vec<usize> = places
            .iter()
            .map(|p| {
                p.iter()
                    .flatten()
                    .filter(|b| self.cached.contains(b))
                    .count()
            })
            .collect();
        let revived: usize = revived_now.iter().sum();
        let state_external = |s: KvGroupSpec| s == KvGroupSpec::MambaState && external > 0;
        let fresh_per: Vec<usize> = first
            .iter()
            .zip(&self.specs)
            .map(|(&f, &s)| {
                if state_external(s) {
                    1 + usize::from(positions - 1 > f)
                } else {
                    positions - f
                }
            })
            .collect();
        let fresh: usize = fresh_per.iter().sum();
        // What vLLM counts: a state group admitted with external tokens, one new block and
        // its hit's cached-evictable state block (whatever it allocates).
        let revived_per: Vec<usize> = revived_now
            .iter()
            .zip(&state_hit_cached)
            .map(|(&r, &c)| r + usize::from(c))
            .collect();
        let counted: usize = fresh_per
            .iter()
            .zip(&self.specs)
            .map(|(&f, &s)| if state_external(s) { 1 } else { f })
            .sum::<usize>()
            + revived_per.iter().sum::<usize>();
        let available = self.available();
        let wm = lim.watermark;
        if !reserve && whole {
            let required = self
                .specs
                .iter()
                .enumerate()
                .map(|(g, &s)| {
                    let new = cap(s, bs, lim)
                        .map_or(full, |c| full.min(c))
                        .saturating_sub(base[g]);
                    fresh_cap(s).map_or(new, |c| c.min(new)) + revived_per[g]
                })
                .fold(0usize, usize::saturating_add)
                + wm;
            if required > available {
                return Err(Kind::Oob(Tier::Device, required, available));
            }
        }
        if counted + wm > available {
            return Err(Kind::Oob(Tier::Device, counted + wm, available));
        }
        if fresh + revived > available {
            // vLLM's count passed, its allocation does not fit (vLLM's pool raises there).
            return Err(Kind::Oob(Tier::Device, fresh + revived, available));
        }
        for b in places
            .iter()
            .flatten()
            .flatten()
            .copied()
            .collect::<Vec<_>>()
        {
            self.take(b);
        }
        let mut supply = self.alloc_fresh(fresh).into_iter();
        // Every group's external positions first, then every group's new ones (vLLM's order);
        // a window of one token keeps no external token.
        let mut tables: Vec<Vec<Option<MBlock>>> = places
            .into_iter()
            .zip(&first)
            .zip(&self.specs)
            .map(|((mut t, &f), &spec)| {
                t.resize(f, None);
                let end = match spec {
                    _ if external == 0 => positions,
                    KvGroupSpec::SlidingWindow { window: 1 } => f,
                    _ => at.div_ceil(bs).max(f).min(positions),
                };
                t.extend(supply.by_ref().take(end - f).map(Some));
                t
            })
            .collect();
        for (t, &spec) in tables.iter_mut().zip(&self.specs) {
            grow(spec, t, positions, &mut supply);
        }
        if tokens.is_some() {
            self.hit_tokens += (l * bs) as u64;
        }
        self.seqs.insert(
            id,
            MSeq {
                num_tokens: n,
                tables,
                swapped: false,
                tokens,
                extra,
                computed,
                hashed: l,
            },
        );
        self.register_ready(id);
        Ok(l * bs)
    }
}
