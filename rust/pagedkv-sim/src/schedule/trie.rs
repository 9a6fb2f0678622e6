//! The block trie under the waiting queue: one node per chained block hash that a waiting
//! request's prompt contains or that the prefix cache holds, linked child to parent.
//!
//! Chained hashes name whole prefixes, so the nodes form a tree: a node's parent is the block
//! before it in every chain that contains it. Each node knows how many copies of its block the
//! prefix cache holds (`copies`, stored minus removed in the allocator's KV events: the plain
//! manager reports one copy per content, a hybrid one every copy), hence whether it is cached, and
//! whether every block from the root to it
//! is cached (`reachable`): exactly the blocks a request through it would hit now. Reachability
//! changes only where an event lands and is pushed down the cached subtree from there, so an
//! event costs the nodes whose answer changes, not a pass over the queue.
//!
//! Per node the trie also keeps who waits through it (`waiters`). For the depth-first policy that
//! is the oldest waiting request through the node, and the children are ordered by it
//! (`dfs_key`). The longest-prefix policy reads neither: it only needs to know whether anyone
//! waits through a node (to keep the node, and for queue-aware eviction's marks), so a trie
//! built with `counts` keeps how many wait through each node instead, which an arrival or a
//! removal changes by one along its chain, with no search among siblings for the next oldest.
//! The requests themselves (which node each waits at) live in `index.rs`. docs/scheduling.md
//! describes the whole index.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use pagedkv::BlockHash;

use super::lists::List;

/// A node of the trie (an index into its node table).
pub(crate) type NodeId = u32;
/// The root: the empty prefix, always reachable, never in the map.
pub(crate) const ROOT: NodeId = 0;
const NO_NODE: NodeId = u32::MAX;
/// Children beyond this many are also kept in a [`BTreeSet`] ordered by [`DfsKey`], so that the
/// depth-first policy finds the heaviest one in O(log children) (a node with few children is
/// scanned instead: cheaper than keeping the set). A trie with `counts` keeps no such set.
const ORDERED_CHILDREN: u32 = 8;

/// A child's rank for the depth-first policy, largest first: a child some waiting request goes
/// through, then a reachable (cached) one, then the one whose oldest waiting request arrived
/// first, then the larger node id (a fixed tie-break; arrival ranks are distinct, so it only
/// orders children nobody waits below).
pub(crate) type DfsKey = (bool, bool, Reverse<u64>, NodeId);

/// `Node::waiters` of a node no waiting request goes through, in a trie without `counts`.
pub(crate) const NOBODY: u64 = u64::MAX;

/// Hashes a block hash by its own low 64 bits: block hashes are XXH3 outputs, already uniform.
#[derive(Default)]
pub(crate) struct LowBits(u64);

impl Hasher for LowBits {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u128 keys are hashed; any other input still gets a well-mixed value.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u128(&mut self, value: u128) {
        self.0 = value as u64;
    }
}

/// One block of the trie.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    /// The block's chained hash (the map's key; 0 for the root).
    pub hash: BlockHash,
    /// The node of the block before it (`NO_NODE` for the root).
    pub parent: NodeId,
    /// Blocks from the root (the root is 0, a prompt's first block 1).
    pub depth: u32,
    /// The waiting requests whose chain passes through this node (those ending here included):
    /// without `counts`, the smallest arrival rank among them ([`NOBODY`] when there are none);
    /// with `counts`, how many they are (0 when none).
    pub waiters: u64,
    /// Copies of the block the prefix cache holds (stored minus evicted; the root: 1).
    pub copies: u32,
    /// `copies > 0`: the prefix cache holds the block.
    pub cached: bool,
    /// `cached`, and the parent is reachable (the root: always): a request through here hits it.
    pub reachable: bool,
    /// First child, and this node's neighbours among its parent's children (`NO_NODE` ends).
    first_child: NodeId,
    next_sibling: NodeId,
    prev_sibling: NodeId,
    num_children: u32,
    /// The children by [`DfsKey`], kept once there are more than [`ORDERED_CHILDREN`].
    ordered: Option<BTreeSet<DfsKey>>,
    /// Waiting requests whose first not-reachable block is this one (`index.rs`).
    pub blocked: List,
    /// Waiting requests whose chain ends here.
    pub enders: List,
    /// In use (not on the free list).
    live: bool,
}

// Every event and arrival touches nodes: one field serves both policies (`waiters`), and a node
// stays 112 bytes (checked here, so that a new field does not grow them unseen).
const _: () = assert!(std::mem::size_of::<Node>() <= 112);

impl Node {
    /// A node nobody waits through (`waiters`: [`NOBODY`], or 0 in a trie with `counts`).
    fn new(hash: BlockHash, parent: NodeId, depth: u32, waiters: u64) -> Node {
        Node {
            hash,
            parent,
            depth,
            waiters,
            copies: 0,
            cached: false,
            reachable: false,
            first_child: NO_NODE,
            next_sibling: NO_NODE,
            prev_sibling: NO_NODE,
            num_children: 0,
            ordered: None,
            blocked: List::default(),
            enders: List::default(),
            live: true,
        }
    }
}

/// The nodes and the hash map onto them.
///
/// Invariants (checked by [`Trie::check`]): every live non-root node is in `map` under its hash
/// and in its parent's child list; `reachable == cached && parent.reachable`; without `counts`,
/// `waiters` of a node is the smallest of its children's and of the ranks of the requests ending
/// there; with `counts`, it is the sum of its children's and the number of requests ending
/// there, and no node keeps ordered children; a node nobody waits through, not
/// cached and without children is not live (it is collected as soon as that happens). So every
/// ancestor of a live node is live: along a chain, the blocks that have nodes are a prefix of it.
#[derive(Debug)]
pub(crate) struct Trie {
    pub nodes: Vec<Node>,
    free: Vec<NodeId>,
    map: HashMap<BlockHash, NodeId, BuildHasherDefault<LowBits>>,
    /// Whether nodes count their waiting requests (`Node::waiters`) instead of keeping the oldest
    /// one and ordered children (the longest-prefix policy).
    pub counts: bool,
}

impl Trie {
    /// An empty trie (the root only); `counts`: see the field.
    pub fn new(counts: bool) -> Trie {
        let mut root = Node::new(0, NO_NODE, 0, if counts { 0 } else { NOBODY });
        root.copies = 1;
        root.cached = true;
        root.reachable = true;
        Trie {
            nodes: vec![root],
            free: Vec::new(),
            map: HashMap::default(),
            counts,
        }
    }

    /// Whether some waiting request's chain passes through node `n`.
    #[inline]
    pub fn waited(&self, n: NodeId) -> bool {
        let node = self.node(n);
        if self.counts {
            node.waiters > 0
        } else {
            node.waiters != NOBODY
        }
    }

    /// Live nodes other than the root.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    #[inline]
    pub fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n as usize]
    }

    #[inline]
    pub fn node_mut(&mut self, n: NodeId) -> &mut Node {
        &mut self.nodes[n as usize]
    }

    pub fn get(&self, hash: BlockHash) -> Option<NodeId> {
        self.map.get(&hash).copied()
    }

    /// A new node for `hash` (not in the trie) under `parent`.
    pub fn insert_new(&mut self, hash: BlockHash, parent: NodeId) -> NodeId {
        debug_assert!(!self.map.contains_key(&hash));
        let depth = self.node(parent).depth + 1;
        let nobody = if self.counts { 0 } else { NOBODY };
        let node = Node::new(hash, parent, depth, nobody);
        let n = match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        };
        self.map.insert(hash, n);
        self.attach(parent, n);
        n
    }

    /// The node's rank among its siblings for the depth-first policy.
    #[inline]
    pub fn dfs_key(&self, n: NodeId) -> DfsKey {
        let node = self.node(n);
        (
            node.waiters != NOBODY,
            node.reachable,
            Reverse(node.waiters),
            n,
        )
    }

    /// The oldest waiting request below `n` (the smallest `waiters` among its children; [`NOBODY`]
    /// when nobody waits below them). Without `counts` only.
    pub fn oldest_below(&self, n: NodeId) -> u64 {
        match self.node(n).ordered.as_ref() {
            // The largest key of each reachability holds the smallest rank of its kind.
            Some(ordered) => [true, false]
                .into_iter()
                .filter_map(|reachable| {
                    let low = (true, reachable, Reverse(u64::MAX), 0);
                    let high = (true, reachable, Reverse(0), NodeId::MAX);
                    ordered.range(low..=high).next_back().map(|key| key.2 .0)
                })
                .min()
                .unwrap_or(NOBODY),
            None => self
                .children(n)
                .map(|c| self.node(c).waiters)
                .min()
                .unwrap_or(NOBODY),
        }
    }

    /// Changes node `n`'s `waiters` or reachability through `change`, keeping its parent's child
    /// order.
    #[inline]
    pub fn update(&mut self, n: NodeId, change: impl FnOnce(&mut Node)) {
        let parent = self.node(n).parent;
        if parent != NO_NODE && self.node(parent).ordered.is_some() {
            let before = self.dfs_key(n);
            change(self.node_mut(n));
            let after = self.dfs_key(n);
            if before != after {
                let ordered = self.nodes[parent as usize]
                    .ordered
                    .as_mut()
                    .expect("checked above");
                ordered.remove(&before);
                ordered.insert(after);
            }
        } else {
            change(self.node_mut(n));
        }
    }

    /// The child of `n` that comes first in depth-first order, if any waiting request goes
    /// through one.
    pub fn best_child(&self, n: NodeId) -> Option<NodeId> {
        let node = self.node(n);
        let best = match node.ordered.as_ref() {
            Some(ordered) => ordered.last().copied(),
            None => self.children(n).map(|c| self.dfs_key(c)).max(),
        };
        best.filter(|key| key.0).map(|key| key.3)
    }

    /// The children of `n`.
    pub fn children(&self, n: NodeId) -> Children<'_> {
        Children {
            trie: self,
            at: self.node(n).first_child,
        }
    }

    /// Collects node `n` and then each ancestor left with no reason to exist (nobody waiting, not
    /// cached, no children).
    pub fn collect(&mut self, mut n: NodeId) {
        while n != ROOT {
            let node = self.node(n);
            if self.waited(n) || node.cached || node.num_children > 0 {
                return;
            }
            let (parent, hash) = (node.parent, node.hash);
            self.detach(parent, n);
            self.map.remove(&hash);
            let node = self.node_mut(n);
            node.live = false;
            node.ordered = None;
            self.free.push(n);
            n = parent;
        }
    }

    fn attach(&mut self, parent: NodeId, n: NodeId) {
        let key = self.dfs_key(n);
        let counts = self.counts;
        let p = self.node_mut(parent);
        let first = p.first_child;
        p.first_child = n;
        p.num_children += 1;
        let grow = !counts && p.ordered.is_none() && p.num_children > ORDERED_CHILDREN;
        if let Some(ordered) = p.ordered.as_mut() {
            ordered.insert(key);
        }
        if first != NO_NODE {
            self.node_mut(first).prev_sibling = n;
        }
        let node = self.node_mut(n);
        node.next_sibling = first;
        node.prev_sibling = NO_NODE;
        if grow {
            let ordered: BTreeSet<DfsKey> =
                self.children(parent).map(|c| self.dfs_key(c)).collect();
            self.node_mut(parent).ordered = Some(ordered);
        }
    }

    fn detach(&mut self, parent: NodeId, n: NodeId) {
        let key = self.dfs_key(n);
        let (prev, next) = {
            let node = self.node(n);
            (node.prev_sibling, node.next_sibling)
        };
        if prev == NO_NODE {
            self.node_mut(parent).first_child = next;
        } else {
            self.node_mut(prev).next_sibling = next;
        }
        if next != NO_NODE {
            self.node_mut(next).prev_sibling = prev;
        }
        let p = self.node_mut(parent);
        p.num_children -= 1;
        if let Some(ordered) = p.ordered.as_mut() {
            ordered.remove(&key);
            if p.num_children == 0 {
                p.ordered = None;
            }
        }
    }

    /// Checks the invariants of the struct docs (slow; for tests). `ending_here`: the oldest rank
    /// and the number of the waiting requests whose chain ends at a node; `awaiting_collection`:
    /// nodes that may be unneeded until collected (whose descendants may be too).
    pub fn check(
        &self,
        ending_here: &dyn Fn(NodeId) -> (u64, u32),
        awaiting_collection: &dyn Fn(NodeId) -> bool,
    ) -> Result<(), String> {
        let mut live = 0;
        for (i, node) in self.nodes.iter().enumerate() {
            let n = i as NodeId;
            if !node.live {
                continue;
            }
            if n != ROOT {
                live += 1;
                if self.map.get(&node.hash) != Some(&n) {
                    return Err(format!("node {n} is not in the map under its hash"));
                }
                let parent = self.node(node.parent);
                if !parent.live || !self.children(node.parent).any(|c| c == n) {
                    return Err(format!("node {n} is not a child of its parent"));
                }
                if node.cached != (node.copies > 0) {
                    return Err(format!(
                        "node {n}: cached {} with {} copies",
                        node.cached, node.copies
                    ));
                }
                if node.reachable != (node.cached && parent.reachable) {
                    return Err(format!(
                        "node {n}: reachable {} but cached {} and parent reachable {}",
                        node.reachable, node.cached, parent.reachable
                    ));
                }
                if !self.waited(n)
                    && !node.cached
                    && node.num_children == 0
                    && !awaiting_collection(n)
                {
                    return Err(format!("node {n} should have been collected"));
                }
            }
            let children: Vec<NodeId> = self.children(n).collect();
            if children.len() != node.num_children as usize {
                return Err(format!(
                    "node {n} counts {} children, has {}",
                    node.num_children,
                    children.len()
                ));
            }
            let (oldest_ending, num_ending) = ending_here(n);
            let waiters = if self.counts {
                let below: u64 = children.iter().map(|&c| self.node(c).waiters).sum();
                below + u64::from(num_ending)
            } else {
                let below = children.iter().map(|&c| self.node(c).waiters).min();
                below.unwrap_or(NOBODY).min(oldest_ending)
            };
            if waiters != node.waiters {
                let what = if self.counts { "count" } else { "oldest" };
                return Err(format!(
                    "node {n} has waiters ({what}) {} but its subtree's is {waiters}",
                    node.waiters
                ));
            }
            if self.counts && node.ordered.is_some() {
                return Err(format!(
                    "node {n} keeps ordered children in a counting trie"
                ));
            }
            if let Some(ordered) = node.ordered.as_ref() {
                let keys: BTreeSet<DfsKey> = children.iter().map(|&c| self.dfs_key(c)).collect();
                if &keys != ordered {
                    return Err(format!("node {n}: ordered children out of date"));
                }
            }
        }
        if live != self.map.len() {
            return Err(format!(
                "{} hashes mapped but {live} live nodes",
                self.map.len()
            ));
        }
        Ok(())
    }
}

/// Iterator over a node's children.
pub(crate) struct Children<'a> {
    trie: &'a Trie,
    at: NodeId,
}

impl Iterator for Children<'_> {
    type Item = NodeId;
    fn next(&mut self) -> Option<NodeId> {
        if self.at == NO_NODE {
            return None;
        }
        let n = self.at;
        self.at = self.trie.node(n).next_sibling;
        Some(n)
    }
}
