//! Intrusive doubly linked lists of waiting requests (slots of the index's request table):
//! O(1) push at the back, unlink anywhere, and take a whole list, with no allocation.
//!
//! A request is in at most one list of each [`Chain`]: the `Blocked` list of the first block of
//! its chain that is not cached (so it advances when that block becomes reachable) and the
//! `Ender` list of the node its chain ends at (the DFS emits it there).

/// A request table slot.
pub(crate) type Slot = u32;
/// No slot.
pub(crate) const NO_SLOT: Slot = u32::MAX;

/// Which of a request's two links a list uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chain {
    Blocked = 0,
    Ender = 1,
}

/// One request's neighbours in the list of one chain (`NO_SLOT` at the ends).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Link {
    pub prev: Slot,
    pub next: Slot,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            prev: NO_SLOT,
            next: NO_SLOT,
        }
    }
}

/// A list's ends (`NO_SLOT` when empty). Invariant: walking `next` from `head` visits every
/// member once and ends at `tail`; each member's `prev` is the member visited before it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct List {
    pub head: Slot,
    pub tail: Slot,
}

impl Default for List {
    fn default() -> Self {
        List {
            head: NO_SLOT,
            tail: NO_SLOT,
        }
    }
}

impl List {
    pub fn is_empty(&self) -> bool {
        self.head == NO_SLOT
    }
}

/// The links of every slot, per chain.
pub(crate) trait Links {
    fn link(&mut self, slot: Slot, chain: Chain) -> &mut Link;
}

/// Appends `slot` (in no list of `chain`) at the back of `list`.
pub(crate) fn push_back<L: Links>(links: &mut L, list: &mut List, slot: Slot, chain: Chain) {
    *links.link(slot, chain) = Link {
        prev: list.tail,
        next: NO_SLOT,
    };
    if list.tail == NO_SLOT {
        list.head = slot;
    } else {
        links.link(list.tail, chain).next = slot;
    }
    list.tail = slot;
}

/// Removes `slot` (a member) from `list`.
pub(crate) fn unlink<L: Links>(links: &mut L, list: &mut List, slot: Slot, chain: Chain) {
    let Link { prev, next } = std::mem::take(links.link(slot, chain));
    if prev == NO_SLOT {
        list.head = next;
    } else {
        links.link(prev, chain).next = next;
    }
    if next == NO_SLOT {
        list.tail = prev;
    } else {
        links.link(next, chain).prev = prev;
    }
}

/// The members of `list`, front to back, appended to `out`; `list` is left empty (its members'
/// links are stale until they are pushed again).
pub(crate) fn drain_into<L: Links>(
    links: &mut L,
    list: &mut List,
    chain: Chain,
    out: &mut Vec<Slot>,
) {
    let mut at = list.head;
    while at != NO_SLOT {
        out.push(at);
        at = links.link(at, chain).next;
    }
    *list = List::default();
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Table(Vec<[Link; 2]>);
    impl Links for Table {
        fn link(&mut self, slot: Slot, chain: Chain) -> &mut Link {
            &mut self.0[slot as usize][chain as usize]
        }
    }

    fn members(t: &mut Table, list: &List) -> Vec<Slot> {
        let mut copy = *list;
        let mut out = Vec::new();
        drain_into(t, &mut copy, Chain::Blocked, &mut out);
        out
    }

    #[test]
    fn push_unlink_and_drain_keep_order() {
        let mut t = Table(vec![[Link::default(); 2]; 5]);
        let mut list = List::default();
        for s in 0..5 {
            push_back(&mut t, &mut list, s, Chain::Blocked);
        }
        unlink(&mut t, &mut list, 0, Chain::Blocked);
        unlink(&mut t, &mut list, 2, Chain::Blocked);
        unlink(&mut t, &mut list, 4, Chain::Blocked);
        assert_eq!(members(&mut t, &list), vec![1, 3]);
        push_back(&mut t, &mut list, 2, Chain::Blocked);
        assert_eq!(members(&mut t, &list), vec![1, 3, 2]);
        let mut out = Vec::new();
        drain_into(&mut t, &mut list, Chain::Blocked, &mut out);
        assert_eq!(out, vec![1, 3, 2]);
        assert!(list.is_empty());
    }
}
