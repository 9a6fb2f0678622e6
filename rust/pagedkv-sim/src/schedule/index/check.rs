//! The index's invariants, checked from scratch against its trie and lists (slow; for tests).

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};

use super::super::lists::{Chain, List, Slot, NO_SLOT};
use super::super::trie::{NodeId, NOBODY};
use super::WaitingIndex;

impl WaitingIndex {
    /// Checks every invariant of the index and its trie (slow; for tests).
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut keys = BTreeSet::new();
        for (&id, &slot) in &self.by_id {
            let r = &self.requests.0[slot as usize];
            if r.id != id {
                return Err(format!("slot {slot} holds request {} under id {id}", r.id));
            }
            let reachable = r
                .path
                .iter()
                .take_while(|&&n| self.trie.node(n).reachable)
                .count() as u32;
            if reachable != r.matched {
                return Err(format!(
                    "request {id} matched {} but {reachable} blocks are reachable",
                    r.matched
                ));
            }
            if let Some(&at) = r.path.get(r.matched as usize) {
                if !self.member(self.trie.node(at).blocked, Chain::Blocked, slot) {
                    return Err(format!(
                        "request {id} is not blocked at its first unreachable block"
                    ));
                }
            }
            if !self.member(self.trie.node(r.last_node()).enders, Chain::Ender, slot) {
                return Err(format!("request {id} is not listed at its last block"));
            }
            keys.insert((Reverse(r.score()), r.rank, slot));
        }
        if keys != self.lpm {
            return Err("the longest-prefix order is out of date".into());
        }
        let blocked: usize = self
            .trie
            .nodes
            .iter()
            .map(|n| self.list_len(n.blocked, Chain::Blocked))
            .sum();
        let waiting_blocked = self
            .by_id
            .values()
            .filter(|&&s| {
                let r = &self.requests.0[s as usize];
                (r.matched as usize) < r.path.len()
            })
            .count();
        if blocked != waiting_blocked {
            return Err(format!(
                "{blocked} blocked entries for {waiting_blocked} blocked requests"
            ));
        }
        let mut ending: HashMap<NodeId, (u64, u32)> = HashMap::new();
        for &slot in self.by_id.values() {
            let r = &self.requests.0[slot as usize];
            let at = ending.entry(r.last_node()).or_insert((NOBODY, 0));
            *at = (at.0.min(r.rank), at.1 + 1);
        }
        let pending: Vec<NodeId> = self
            .pending_collect
            .iter()
            .filter_map(|&h| self.trie.get(h))
            .collect();
        self.orphans.check(&|h| self.trie.get(h).is_some())?;
        self.trie
            .check(&|n| ending.get(&n).copied().unwrap_or((NOBODY, 0)), &|n| {
                pending.contains(&n)
            })
    }

    fn member(&self, list: List, chain: Chain, slot: Slot) -> bool {
        let mut at = list.head;
        while at != NO_SLOT {
            if at == slot {
                return true;
            }
            at = self.requests.0[at as usize].links[chain as usize].next;
        }
        false
    }

    fn list_len(&self, list: List, chain: Chain) -> usize {
        let mut n = 0;
        let mut at = list.head;
        while at != NO_SLOT {
            n += 1;
            at = self.requests.0[at as usize].links[chain as usize].next;
        }
        n
    }
}
