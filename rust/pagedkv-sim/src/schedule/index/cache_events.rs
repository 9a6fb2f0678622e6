//! The cache's side of the index: blocks stored, evicted and cleared make trie nodes reachable
//! or not, and move exactly the waiting requests whose match they change (the parent's comment
//! says who moves and why).

use std::cmp::Reverse;

use pagedkv::{BlockHash, Error, Result};

use super::super::lists::{drain_into, push_back, Chain, Slot, NO_SLOT};
use super::super::trie::{NodeId, ROOT};
use super::WaitingIndex;

impl WaitingIndex {
    /// Blocks `block_hashes` (a chain, after `parent` or from the root) entered the prefix
    /// cache. The parent need not be cached nor ever have been (one copy per content,
    /// docs/events.md): blocks after a parent without a node wait as orphans until it gets one.
    pub fn stored(&mut self, parent: Option<BlockHash>, block_hashes: &[BlockHash]) {
        let mut at = match parent {
            None => Some(ROOT),
            Some(h) => self.trie.get(h),
        };
        let mut before = parent;
        for &h in block_hashes {
            let Some(p) = at else {
                self.orphans
                    .store(before.expect("only a named parent can lack a node"), h);
                before = Some(h);
                continue;
            };
            let (n, new) = match self.trie.get(h) {
                Some(n) => (n, false),
                None => (self.trie.insert_new(h, p), true),
            };
            debug_assert_eq!(self.trie.node(n).parent, p, "one hash, two parents");
            let node = self.trie.node_mut(n);
            node.copies += 1;
            if !node.cached {
                node.cached = true;
                if self.trie.node(p).reachable {
                    self.make_reachable(n);
                }
            }
            if new {
                self.adopt(n);
            }
            at = Some(n);
            before = Some(h);
        }
    }

    /// Node `n` was just made: the orphans waiting for it, and theirs below them, become its
    /// cached descendants (reachable where it is).
    pub(super) fn adopt(&mut self, n: NodeId) {
        if self.orphans.is_empty() {
            return;
        }
        self.adopting.clear();
        self.adopting.push(n);
        while let Some(p) = self.adopting.pop() {
            let reachable = self.trie.node(p).reachable;
            for (h, copies) in self.orphans.take_children(self.trie.node(p).hash) {
                let c = self.trie.insert_new(h, p);
                self.trie.update(c, |node| {
                    node.copies = copies;
                    node.cached = true;
                    node.reachable = reachable;
                });
                self.adopting.push(c);
            }
        }
    }

    /// Block `hash` left the prefix cache. A block never reported stored is an error: the
    /// caller missed events.
    pub fn removed(&mut self, hash: BlockHash) -> Result<()> {
        let Some(n) = self.trie.get(hash) else {
            if self.orphans.remove(hash) {
                return Ok(()); // nobody could hit it
            }
            return Err(Error::InvariantViolation(format!(
                "block {hash:#x} was evicted but the scheduling index never saw it stored"
            )));
        };
        let node = self.trie.node_mut(n);
        if node.copies == 0 {
            return Err(Error::InvariantViolation(format!(
                "block {hash:#x} was evicted more often than stored"
            )));
        }
        node.copies -= 1;
        if node.copies > 0 {
            return Ok(()); // another copy still serves it
        }
        node.cached = false;
        let was_reachable = node.reachable;
        if was_reachable && self.trie.waited(n) {
            self.evicted_wanted_blocks += 1;
        }
        if was_reachable {
            self.make_unreachable(n);
        }
        self.trie.collect(n);
        Ok(())
    }

    /// The whole prefix cache was emptied: the trie is rebuilt from the waiting requests.
    pub fn cleared(&mut self) -> Result<()> {
        type Waiting = (u64, u64, Vec<BlockHash>, u32);
        let mut waiting: Vec<Waiting> = self
            .by_id
            .values()
            .map(|&s| {
                let r = &self.requests.0[s as usize];
                let hashes = r.path.iter().map(|&n| self.trie.node(n).hash).collect();
                (r.id, r.rank, hashes, r.cap)
            })
            .collect();
        waiting.sort_by_key(|w| w.1);
        let (wanted, cursor) = (self.evicted_wanted_blocks, std::mem::take(&mut self.cursor));
        let (record_marks, marks) = (self.record_marks, std::mem::take(&mut self.marks));
        *self = WaitingIndex::new(self.track_cursor);
        self.evicted_wanted_blocks = wanted;
        self.cursor = cursor;
        // The waiting chains are pushed again: their marks repeat, which changes nothing.
        self.record_marks = record_marks;
        self.marks = marks;
        for (id, rank, hashes, cap) in waiting {
            self.push(id, rank, &hashes, cap as usize)?;
        }
        Ok(())
    }

    /// `v` (cached, parent reachable) becomes reachable, and with it its cached subtree; the
    /// requests blocked at `v` advance as far as the reachable blocks go.
    fn make_reachable(&mut self, v: NodeId) {
        let trie = &mut self.trie;
        self.stack.clear();
        self.stack.push(v);
        while let Some(x) = self.stack.pop() {
            trie.update(x, |node| node.reachable = true);
            self.stack
                .extend(trie.children(x).filter(|&c| trie.node(c).cached));
        }
        self.scratch.clear();
        drain_into(
            &mut self.requests,
            &mut trie.node_mut(v).blocked,
            Chain::Blocked,
            &mut self.scratch,
        );
        for i in 0..self.scratch.len() {
            let slot = self.scratch[i];
            let r = &self.requests.0[slot as usize];
            let mut m = r.matched as usize;
            while m < r.path.len() && self.trie.node(r.path[m]).reachable {
                m += 1;
            }
            let blocked_at = r.path.get(m).copied();
            self.set_matched(slot, m as u32);
            if let Some(at) = blocked_at {
                push_back(
                    &mut self.requests,
                    &mut self.trie.node_mut(at).blocked,
                    slot,
                    Chain::Blocked,
                );
            }
        }
    }

    /// `v` (reachable until now, its block evicted) and its reachable subtree become
    /// unreachable; every request that had matched past `v`'s parent now waits at `v`.
    fn make_unreachable(&mut self, v: NodeId) {
        let matched = self.trie.node(v).depth - 1;
        self.stack.clear();
        self.stack.push(v);
        self.scratch.clear();
        while let Some(x) = self.stack.pop() {
            self.trie.update(x, |node| node.reachable = false);
            // Requests ending at `x` had matched all of their chain.
            let mut at = self.trie.node(x).enders.head;
            while at != NO_SLOT {
                self.scratch.push(at);
                at = self.requests.0[at as usize].links[Chain::Ender as usize].next;
            }
            self.children.clear();
            self.children.extend(self.trie.children(x));
            for &c in &self.children {
                if self.trie.node(c).reachable {
                    self.stack.push(c);
                } else {
                    let list = &mut self.trie.node_mut(c).blocked;
                    drain_into(&mut self.requests, list, Chain::Blocked, &mut self.scratch);
                }
            }
        }
        for i in 0..self.scratch.len() {
            let slot = self.scratch[i];
            self.set_matched(slot, matched);
            push_back(
                &mut self.requests,
                &mut self.trie.node_mut(v).blocked,
                slot,
                Chain::Blocked,
            );
        }
    }

    /// Sets a request's `matched`, moving its key in the longest-prefix order.
    fn set_matched(&mut self, slot: Slot, matched: u32) {
        let r = &mut self.requests.0[slot as usize];
        let before = r.score();
        r.matched = matched;
        let after = r.score();
        if before != after {
            self.lpm.remove(&(Reverse(before), r.rank, slot));
            self.lpm.insert((Reverse(after), r.rank, slot));
        }
    }
}
