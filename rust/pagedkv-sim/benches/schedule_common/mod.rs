//! The cache-aware queue in a steady state, for the overhead benches (`schedule_overhead`,
//! `instructions`): a `KvCacheManager` on 65,536 blocks of 16 with 256 resident requests and a
//! fixed number waiting; each step one request arrives, one is chosen and admitted, the oldest
//! resident one finishes, and the allocator's KV events reach the queue. Every part of a step is
//! its own `#[inline(never)]` function (`policy_*`: the scheduler; `allocator_*`: the
//! allocator), so that callgrind can count each (docs/scheduling.md, Cost).

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;

use pagedkv::{splitmix64, BlockHash, DrainedEvents, KvCacheManager, ManagerConfig, TokenId};
use pagedkv_sim::{CacheAwareQueue, Scheduling};

/// Requests running at once: the oldest finishes when one more is admitted.
const RESIDENT: usize = 256;

/// What the prompts share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prompts {
    /// The peer benchmark's W2: one of 16 system prompts of 1,024 tokens, then 100..=500 tokens
    /// of its own.
    Shared,
    /// 1,324 tokens of its own (82 full blocks, nothing to hit).
    Unique,
}

/// How the next request is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chooser {
    /// First come, first served, KV events off: the allocator's baseline.
    Fcfs,
    /// The cache-aware queue under this policy.
    Queue(Scheduling),
    /// Longest prefix match by asking the allocator (`match_prefix`) for every waiting request
    /// at every admission, as a scheduler without an index does: the cost the index avoids.
    Rematch,
    /// The floor of an exact index over the waiting requests' block hashes: first come, first
    /// served, but each arrival hashed (`policy_hash`), admitted with those hashes, and the KV
    /// events recorded, drained and dropped unread. What such an index pays before any
    /// bookkeeping of its own (docs/scheduling.md, The floor).
    Floor,
    /// The feed alone: first come, first served, KV events recorded, drained and dropped unread.
    Feed,
    /// The floor of an index that learns each arrival's hit from the allocator instead of from
    /// hashes (a frontier index): first come, first served, each arrival matched once
    /// (`policy_match`, side-effect free), the KV events recorded, drained and dropped unread.
    Match,
}

impl Chooser {
    /// Whether the allocator records KV events under this chooser.
    fn events(self) -> bool {
        !matches!(self, Chooser::Fcfs | Chooser::Rematch)
    }
}

pub struct Steady {
    kv: KvCacheManager,
    chooser: Chooser,
    /// The cache-aware queue (`Chooser::Queue`).
    queue: Option<CacheAwareQueue>,
    fifo: VecDeque<u64>,
    prompts: HashMap<u64, Vec<TokenId>>,
    /// Each waiting request's block hashes, computed once at arrival and handed to its
    /// admission (`add_sequence_hashed`, `AdmitOptions::prompt_hashes`) under the cache-aware
    /// queue.
    prompt_hashes: HashMap<u64, Vec<BlockHash>>,
    resident: VecDeque<u64>,
    hashes: Vec<BlockHash>,
    kind: Prompts,
    rng: u64,
    next_id: u64,
}

impl Steady {
    /// `waiting` requests queued, chosen by `chooser`, after 2,000 steps of warm-up.
    pub fn new(chooser: Chooser, waiting: usize, kind: Prompts) -> Steady {
        let policy = match chooser {
            Chooser::Queue(p) => Some(p),
            _ => None,
        };
        let kv = KvCacheManager::new(ManagerConfig {
            num_blocks: 65_536,
            block_size: 16,
            enable_prefix_caching: true,
            enable_kv_events: chooser.events(),
            max_events: usize::MAX,
            ..Default::default()
        })
        .unwrap();
        let mut s = Steady {
            kv,
            chooser,
            queue: policy.map(|p| CacheAwareQueue::new(p, 1024)),
            fifo: VecDeque::new(),
            prompts: HashMap::new(),
            prompt_hashes: HashMap::new(),
            resident: VecDeque::new(),
            hashes: Vec::new(),
            kind,
            rng: 0x5EED_0044,
            next_id: 0,
        };
        for _ in 0..waiting {
            s.arrive();
        }
        for _ in 0..2_000 {
            s.step();
        }
        s
    }

    fn prompt(&mut self) -> Vec<TokenId> {
        let id = self.next_id as u32;
        let mut below =
            |n: u64| ((splitmix64::next(&mut self.rng) as u128 * n as u128) >> 64) as u32;
        match self.kind {
            Prompts::Shared => {
                let system = below(16);
                let suffix = 100 + below(401);
                let mut p: Vec<TokenId> = (0..1024)
                    .map(|j| 2_000_000_000 + system * 1024 + j)
                    .collect();
                p.extend((0..suffix).map(|j| id.wrapping_mul(512).wrapping_add(j)));
                p
            }
            Prompts::Unique => (0..1324)
                .map(|j| id.wrapping_mul(4096).wrapping_add(j))
                .collect(),
        }
    }

    fn arrive(&mut self) {
        let id = self.next_id;
        let prompt = self.prompt();
        self.next_id += 1;
        if let Some(queue) = self.queue.as_mut() {
            policy_hash(&self.kv, &prompt, &mut self.hashes);
            policy_push(queue, id, &self.hashes, (prompt.len() - 1) / 16);
            self.prompt_hashes
                .insert(id, std::mem::take(&mut self.hashes));
        } else {
            match self.chooser {
                Chooser::Floor => {
                    policy_hash(&self.kv, &prompt, &mut self.hashes);
                    self.prompt_hashes
                        .insert(id, std::mem::take(&mut self.hashes));
                }
                Chooser::Match => policy_match(&self.kv, &prompt),
                _ => {}
            }
            self.fifo.push_back(id);
        }
        self.prompts.insert(id, prompt);
    }

    /// One scheduled request: an arrival, a choice, its admission, a finish, the events.
    pub fn step(&mut self) {
        self.arrive();
        let id = match (self.chooser, self.queue.as_mut()) {
            (Chooser::Queue(_), Some(queue)) => policy_pick(queue),
            (Chooser::Rematch, _) => {
                let id = rematch_pick(&self.kv, &self.fifo, &self.prompts);
                self.fifo.retain(|&w| w != id);
                id
            }
            _ => self.fifo.pop_front().unwrap(),
        };
        let prompt = self.prompts.remove(&id).unwrap();
        match self.prompt_hashes.remove(&id) {
            Some(hashes) => allocator_admit_hashed(&mut self.kv, id, &prompt, &hashes),
            None => allocator_admit(&mut self.kv, id, &prompt),
        }
        self.resident.push_back(id);
        if self.resident.len() > RESIDENT {
            allocator_free(&mut self.kv, self.resident.pop_front().unwrap());
        }
        if let Some(queue) = self.queue.as_mut() {
            policy_admitted(queue, id);
            let events = allocator_events(&mut self.kv);
            policy_events(queue, &events);
            drop_events(events);
        } else if self.chooser.events() {
            drop_events(allocator_events(&mut self.kv));
        }
    }
}

/// Learning an arriving prompt's current hit from the allocator (side-effect free).
#[inline(never)]
fn policy_match(kv: &KvCacheManager, prompt: &[TokenId]) {
    black_box(kv.match_prefix(black_box(prompt), None).unwrap());
}

/// The waiting request with the longest cached prefix (the earliest on ties), by asking the
/// allocator about each one.
#[inline(never)]
fn rematch_pick(
    kv: &KvCacheManager,
    fifo: &VecDeque<u64>,
    prompts: &HashMap<u64, Vec<TokenId>>,
) -> u64 {
    let mut best = (0, u64::MAX);
    for &id in fifo {
        let hit = kv.match_prefix(&prompts[&id], None).unwrap();
        if hit > best.0 || best.1 == u64::MAX {
            best = (hit, id);
        }
    }
    best.1
}

/// The chained hashes of an arriving prompt, computed once: the queue indexes them and the
/// admission takes them (`add_sequence_hashed`) instead of hashing the prompt again.
#[inline(never)]
fn policy_hash(kv: &KvCacheManager, prompt: &[TokenId], out: &mut Vec<BlockHash>) {
    *out = kv.prefix_block_hashes(black_box(prompt), None);
}

#[inline(never)]
fn policy_push(queue: &mut CacheAwareQueue, id: u64, hashes: &[BlockHash], max_hit_blocks: usize) {
    queue.push(id, black_box(hashes), max_hit_blocks).unwrap();
}

#[inline(never)]
fn policy_pick(queue: &mut CacheAwareQueue) -> u64 {
    black_box(queue.peek().unwrap())
}

#[inline(never)]
fn policy_admitted(queue: &mut CacheAwareQueue, id: u64) {
    queue.admitted(black_box(id)).unwrap();
}

/// The events read in place (`apply_drained`): no `KvEvent` per block removal.
#[inline(never)]
fn policy_events(queue: &mut CacheAwareQueue, events: &DrainedEvents) {
    queue.apply_drained(black_box(events)).unwrap();
}

#[inline(never)]
fn allocator_admit(kv: &mut KvCacheManager, id: u64, prompt: &[TokenId]) {
    black_box(
        kv.add_sequence(black_box(id), black_box(prompt), None)
            .unwrap(),
    );
}

/// The admission under the cache-aware queue, with the hashes computed at arrival.
#[inline(never)]
fn allocator_admit_hashed(
    kv: &mut KvCacheManager,
    id: u64,
    prompt: &[TokenId],
    hashes: &[BlockHash],
) {
    black_box(
        kv.add_sequence_hashed(black_box(id), black_box(prompt), None, hashes)
            .unwrap(),
    );
}

#[inline(never)]
fn allocator_free(kv: &mut KvCacheManager, id: u64) {
    kv.free(black_box(id)).unwrap();
}

/// Draining the KV events the queue reads (recorded only for the queue: its cost), as the
/// allocator's queue holds them.
#[inline(never)]
fn allocator_events(kv: &mut KvCacheManager) -> DrainedEvents {
    kv.take_drained_events()
}

/// Freeing the drained events (part of the allocator's drain: counted as `allocator_events`
/// counted it when `take_events` built and the caller dropped a `Vec<KvEvent>`).
#[inline(never)]
fn drop_events(events: DrainedEvents) {
    drop(black_box(events));
}
