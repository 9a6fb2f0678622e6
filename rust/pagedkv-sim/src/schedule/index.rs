//! The waiting requests on the block trie: how much of each one's prompt the cache would serve
//! now, kept up to date as requests arrive and leave and as blocks are stored and evicted.
//!
//! Every waiting request knows how many leading blocks of its chain are reachable (`matched`)
//! and sits in the `blocked` list of its first block that is not: when that block becomes
//! reachable, exactly the requests in its list advance (and only they); when a reachable block
//! is evicted, the requests that had matched past it are found in the reachable subtree below it
//! (ended there, or blocked at one of its unreachable children) and fall back to it. The
//! longest-prefix-match order is one ordered set over `(matched blocks, arrival rank)`; the
//! depth-first order walks the trie from the root by [`super::trie::DfsKey`]. docs/scheduling.md
//! gives the costs.
//!
//! This file holds the requests' side (arrivals, departures, the two orders); the cache's side,
//! blocks stored and evicted, is `index/cache_events.rs`, and the invariant check
//! `index/check.rs`.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::BuildHasherDefault;

use pagedkv::{BlockHash, Error, Result};
use rustc_hash::FxHasher;

use super::lists::{push_back, unlink, Chain, Link, Links, Slot};
use super::orphans::Orphans;
use super::trie::{NodeId, Trie, NOBODY, ROOT};

mod cache_events;
mod check;

/// One waiting request.
#[derive(Debug, Clone)]
struct Request {
    /// The caller's id.
    id: u64,
    /// Arrival rank (strictly increasing over pushes).
    rank: u64,
    /// The trie node of each full block of its prompt, in order.
    path: Box<[NodeId]>,
    /// Leading blocks of `path` that are reachable (the hit it would get now, before `cap`).
    matched: u32,
    /// Most blocks it can hit (its last prompt token is always computed).
    cap: u32,
    /// Its links in the `Blocked` and `Ender` lists.
    links: [Link; 2],
}

impl Request {
    #[inline]
    fn score(&self) -> u32 {
        self.matched.min(self.cap)
    }

    #[inline]
    fn last_node(&self) -> NodeId {
        self.path.last().copied().unwrap_or(ROOT)
    }
}

/// The request table (slots reused through `free`).
#[derive(Debug, Default)]
struct Requests(Vec<Request>);

impl Links for Requests {
    #[inline]
    fn link(&mut self, slot: Slot, chain: Chain) -> &mut Link {
        &mut self.0[slot as usize].links[chain as usize]
    }
}

/// The longest-prefix-match order: most matched blocks first, then the earliest arrival.
type LpmKey = (Reverse<u32>, u64, Slot);

/// Waiting requests indexed by the cached prefix each would hit and by the prefixes they share.
///
/// Invariants (checked by [`WaitingIndex::check`]): each live request's `matched` is the number
/// of leading reachable nodes of its `path`; it is in the `blocked` list of `path[matched]` iff
/// `matched < path.len()`, and in the `enders` list of its last node (the root for a prompt
/// shorter than a block); `lpm` holds exactly one key per live request, with its current score.
#[derive(Debug)]
pub(crate) struct WaitingIndex {
    trie: Trie,
    requests: Requests,
    /// Slots of the request table not in use.
    free: Vec<Slot>,
    by_id: HashMap<u64, Slot, BuildHasherDefault<FxHasher>>,
    lpm: BTreeSet<LpmKey>,
    /// Reused buffers of the cascades.
    stack: Vec<NodeId>,
    children: Vec<NodeId>,
    scratch: Vec<Slot>,
    /// The chain of the last admitted request: the depth-first walk resumes at its deepest block
    /// that a waiting request's chain contains (kept only when `track_cursor`).
    cursor: Vec<BlockHash>,
    /// Whether the depth-first walk is used (only it reads `cursor`).
    track_cursor: bool,
    /// The last blocks of removed requests' chains, collected (with their unneeded ancestors)
    /// only at the next push or removal: an admission's own blocks are stored by then, so they
    /// stay as cached nodes instead of being dropped and entered again.
    pending_collect: Vec<BlockHash>,
    /// Cached blocks whose parent has no node (`orphans.rs`): they become nodes with it.
    orphans: Orphans,
    /// Reused buffer of [`WaitingIndex::adopt`].
    adopting: Vec<NodeId>,
    /// Blocks evicted while reachable and on some waiting request's chain (hits lost).
    pub evicted_wanted_blocks: u64,
    /// Whether `marks` are recorded (queue-aware eviction).
    record_marks: bool,
    /// Blocks that some waiting request came to go through (`true`) or that the last one
    /// through left (`false`), in order, since the caller last drained them: the marks of
    /// queue-aware eviction (docs/scheduling.md).
    pub marks: Vec<(BlockHash, bool)>,
}

impl WaitingIndex {
    /// An empty index; `track_cursor`: keep what the depth-first walk needs.
    pub fn new(track_cursor: bool) -> WaitingIndex {
        WaitingIndex {
            // Only the depth-first walk reads the oldest request through a node.
            trie: Trie::new(!track_cursor),
            requests: Requests::default(),
            free: Vec::new(),
            by_id: HashMap::default(),
            lpm: BTreeSet::new(),
            stack: Vec::new(),
            children: Vec::new(),
            scratch: Vec::new(),
            cursor: Vec::new(),
            track_cursor,
            pending_collect: Vec::new(),
            orphans: Orphans::default(),
            adopting: Vec::new(),
            evicted_wanted_blocks: 0,
            record_marks: false,
            marks: Vec::new(),
        }
    }

    /// Records `marks` from now on.
    pub fn record_marks(&mut self) {
        self.record_marks = true;
    }

    /// Waiting requests.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Nodes of the trie (waiting chains and cached blocks) and cached blocks waiting for their
    /// parent's node, for memory accounting.
    pub fn num_nodes(&self) -> usize {
        self.trie.len() + self.orphans.len()
    }

    /// Adds request `id` (new) of arrival `rank` whose prompt's full blocks have the chained
    /// hashes `block_hashes` and which can hit at most `max_hit_blocks` of them.
    pub fn push(
        &mut self,
        id: u64,
        rank: u64,
        block_hashes: &[BlockHash],
        max_hit_blocks: usize,
    ) -> Result<()> {
        if self.by_id.contains_key(&id) {
            return Err(Error::InvalidArgument(format!(
                "request {id} is already waiting"
            )));
        }
        self.collect_pending();
        // The blocks that have nodes are a prefix of the chain: find its end by binary search,
        // take those nodes from the deepest one's ancestors, and add the rest.
        let known = block_hashes.partition_point(|h| self.trie.get(*h).is_some());
        let mut path: Box<[NodeId]> = vec![ROOT; block_hashes.len()].into_boxed_slice();
        if known > 0 {
            let mut n = self.trie.get(block_hashes[known - 1]).expect("found above");
            for slot in path[..known].iter_mut().rev() {
                *slot = n;
                n = self.trie.node(n).parent;
            }
            debug_assert_eq!(n, ROOT, "chained hashes name whole prefixes");
        }
        let mut parent = if known > 0 { path[known - 1] } else { ROOT };
        for (slot, &h) in path[known..].iter_mut().zip(&block_hashes[known..]) {
            // A new node adopts the orphans below it, which may be the chain's next blocks.
            parent = match self.trie.get(h) {
                Some(n) => n,
                None => {
                    let n = self.trie.insert_new(h, parent);
                    self.adopt(n);
                    n
                }
            };
            *slot = parent;
        }
        let trie = &mut self.trie;
        if trie.counts {
            // One more request through every node of its chain; marks where it is the first,
            // the deep end of its path (deepest first, as below).
            for &n in path.iter().rev().chain(std::iter::once(&ROOT)) {
                let node = trie.node_mut(n);
                node.waiters += 1;
                if node.waiters == 1 && self.record_marks && n != ROOT {
                    self.marks.push((node.hash, true));
                }
            }
        } else {
            // A new request is the youngest: it is the oldest only where nobody waited, which
            // is the deep end of its path.
            for &n in path.iter().rev().chain(std::iter::once(&ROOT)) {
                if trie.node(n).waiters != NOBODY {
                    break;
                }
                trie.update(n, |node| node.waiters = rank);
                if self.record_marks && n != ROOT {
                    self.marks.push((trie.node(n).hash, true));
                }
            }
        }
        let matched = path.iter().take_while(|&&n| trie.node(n).reachable).count() as u32;
        let request = Request {
            id,
            rank,
            path,
            matched,
            cap: max_hit_blocks.min(u32::MAX as usize) as u32,
            links: [Link::default(); 2],
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.requests.0[slot as usize] = request;
                slot
            }
            None => {
                self.requests.0.push(request);
                (self.requests.0.len() - 1) as Slot
            }
        };
        self.by_id.insert(id, slot);
        let r = &self.requests.0[slot as usize];
        let (last, score) = (r.last_node(), r.score());
        if let Some(&at) = r.path.get(matched as usize) {
            push_back(
                &mut self.requests,
                &mut self.trie.node_mut(at).blocked,
                slot,
                Chain::Blocked,
            );
        }
        push_back(
            &mut self.requests,
            &mut self.trie.node_mut(last).enders,
            slot,
            Chain::Ender,
        );
        self.lpm.insert((Reverse(score), rank, slot));
        Ok(())
    }

    /// Removes request `id` (`admitted`, or dropped); returns its rank, or `None` if it was not
    /// waiting. The depth-first walk resumes next to the last admitted request.
    pub fn remove(&mut self, id: u64, admitted: bool) -> Option<u64> {
        self.collect_pending();
        let slot = self.by_id.remove(&id)?;
        let r = &self.requests.0[slot as usize];
        if admitted && self.track_cursor {
            self.cursor.clear();
            self.cursor
                .extend(r.path.iter().map(|&n| self.trie.node(n).hash));
        }
        let (rank, score, last) = (r.rank, r.score(), r.last_node());
        let blocked_at = r.path.get(r.matched as usize).copied();
        let path = std::mem::take(&mut self.requests.0[slot as usize].path);
        if let Some(at) = blocked_at {
            unlink(
                &mut self.requests,
                &mut self.trie.node_mut(at).blocked,
                slot,
                Chain::Blocked,
            );
        }
        unlink(
            &mut self.requests,
            &mut self.trie.node_mut(last).enders,
            slot,
            Chain::Ender,
        );
        self.lpm.remove(&(Reverse(score), rank, slot));
        if self.trie.counts {
            // One request fewer through every node of its chain (deepest first, as below).
            for &n in path.iter().rev().chain(std::iter::once(&ROOT)) {
                let node = self.trie.node_mut(n);
                node.waiters -= 1;
                if node.waiters == 0 && self.record_marks && n != ROOT {
                    self.marks.push((node.hash, false));
                }
            }
        } else {
            // Where it was the oldest, the next oldest is the oldest below or ending at the node,
            // deepest first so that each node reads its children's new values.
            for &n in path.iter().rev().chain(std::iter::once(&ROOT)) {
                if self.trie.node(n).waiters != rank {
                    break; // then it was not the oldest above either
                }
                let enders = self.trie.node(n).enders;
                let ending = if enders.is_empty() {
                    NOBODY
                } else {
                    self.requests.0[enders.head as usize].rank
                };
                let oldest = self.trie.oldest_below(n).min(ending);
                self.trie.update(n, |node| node.waiters = oldest);
                if self.record_marks && oldest == NOBODY && n != ROOT {
                    self.marks.push((self.trie.node(n).hash, false));
                }
            }
        }
        // Collecting the last node climbs through every ancestor left unneeded.
        if let Some(&deepest) = path.last() {
            self.pending_collect.push(self.trie.node(deepest).hash);
        }
        self.free.push(slot);
        Some(rank)
    }

    /// Collects the nodes left by removals (see `pending_collect`).
    fn collect_pending(&mut self) {
        for h in std::mem::take(&mut self.pending_collect) {
            if let Some(n) = self.trie.get(h) {
                self.trie.collect(n);
            }
        }
    }

    /// The rank of waiting request `id`.
    pub fn rank(&self, id: u64) -> Option<u64> {
        self.by_id
            .get(&id)
            .map(|&s| self.requests.0[s as usize].rank)
    }

    /// The blocks request `id` would hit if admitted now (its cap applied).
    pub fn hit_blocks(&self, id: u64) -> Option<usize> {
        self.by_id
            .get(&id)
            .map(|&s| self.requests.0[s as usize].score() as usize)
    }

    /// The longest-prefix-match choice: the request with the most cached blocks, the earliest
    /// arrival among equals. `(id, rank)`.
    pub fn longest_prefix_first(&self) -> Option<(u64, u64)> {
        self.lpm
            .first()
            .map(|&(_, rank, slot)| (self.requests.0[slot as usize].id, rank))
    }

    /// The depth-first choice, `(id, rank)`. The walk resumes where the last admitted request's
    /// chain ends: up to the nearest node some waiting request goes through (the root when the
    /// chain is gone), then down: into the heaviest reachable child while there is one, else
    /// the earliest request ending here, else into the heaviest child.
    pub fn depth_first(&self) -> Option<(u64, u64)> {
        let trie = &self.trie;
        if trie.node(ROOT).waiters == NOBODY {
            return None;
        }
        // Blocks of the cursor's chain some waiting request shares form a prefix of it (whoever
        // waits through a node waits through its ancestors): binary search for its end.
        let shared = |h: &BlockHash| trie.get(*h).is_some_and(|n| trie.node(n).waiters != NOBODY);
        let depth = self.cursor.partition_point(shared);
        let mut at = match depth {
            0 => ROOT,
            d => trie
                .get(self.cursor[d - 1])
                .expect("shared blocks have nodes"),
        };
        loop {
            let best = trie.best_child(at);
            match best {
                Some(c) if trie.node(c).reachable => at = c,
                _ => {
                    let enders = trie.node(at).enders;
                    if !enders.is_empty() {
                        let r = &self.requests.0[enders.head as usize];
                        return Some((r.id, r.rank));
                    }
                    // Someone waits through here and nobody ends here: below a child.
                    at = best?;
                }
            }
        }
    }
}
