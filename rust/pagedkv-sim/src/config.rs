//! Simulation settings: which allocator, how large the pool, how requests arrive.

use std::fmt;
use std::str::FromStr;

use pagedkv::{Error, Result, MAX_NUM_SLOTS};

/// How KV memory is handed to requests.
///
/// ```
/// use pagedkv_sim::AllocatorKind;
/// let kind: AllocatorKind = "contiguous-pow2".parse()?;
/// assert_eq!(kind, AllocatorKind::ContiguousPow2);
/// assert_eq!(kind.to_string(), "contiguous-pow2");
/// assert!("paged-ish".parse::<AllocatorKind>().is_err());
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocatorKind {
    /// Blocks of `block_size` slots from the real [`pagedkv::KvCacheManager`], grown on demand.
    Paged,
    /// One contiguous reservation of `max_model_len` slots per sequence.
    ContiguousMax,
    /// Prompt plus the output rounded up to a power of two (at most 2x the output).
    ContiguousPow2,
    /// Exactly prompt plus output (an oracle that knows the output length).
    ContiguousOracle,
}

/// Where contiguous reservations are placed in the slot array.
///
/// ```
/// use pagedkv_sim::Placement;
/// assert_eq!("buddy".parse::<Placement>()?, Placement::Buddy);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Lowest address with a long enough free run ([`crate::FirstFitAllocator`]).
    FirstFit,
    /// Power-of-two runs ([`crate::BuddyAllocator`]).
    Buddy,
}

/// When requests become visible to the scheduler.
///
/// ```
/// use pagedkv_sim::Arrival;
/// assert_eq!("poisson".parse::<Arrival>()?, Arrival::Poisson);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Every request is waiting at time 0.
    Saturated,
    /// The workload's own `arrival_s`, shifted so that the first request arrives at time 0.
    Trace,
    /// A Poisson process at [`SimConfig::poisson_rate`] requests per second, seeded.
    Poisson,
}

/// What happens to a preempted (paged) request group.
///
/// ```
/// use pagedkv_sim::Preemption;
/// assert_eq!("swap".parse::<Preemption>()?, Preemption::Swap);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    /// Free its blocks; it re-queues at the front with prompt + generated tokens as its prompt.
    Recompute,
    /// Move its blocks to the host tier; swapped back in before any new admission. Falls back
    /// to recompute when the host tier is full.
    Swap,
}

/// The order in which waiting requests are admitted (docs/scheduling.md).
///
/// ```
/// use pagedkv_sim::Scheduling;
/// assert_eq!("dfs".parse::<Scheduling>()?, Scheduling::Dfs);
/// assert_eq!(Scheduling::Lpm.to_string(), "lpm");
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Scheduling {
    /// First come, first served: the oldest waiting request, which blocks the rest.
    #[default]
    Fcfs,
    /// Longest prefix match: the request the prefix cache serves most of now (oldest on ties).
    Lpm,
    /// Depth first over the waiting requests' shared prefixes, heaviest subtree first.
    Dfs,
}

macro_rules! string_enum {
    ($ty:ident, $what:literal, { $($name:literal => $variant:ident),+ $(,)? }) => {
        impl FromStr for $ty {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    other => Err(Error::InvalidArgument(format!(
                        concat!("unknown ", $what, " {:?}; expected one of: {}"),
                        other,
                        [$($name),+].join(", ")
                    ))),
                }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(match self { $($ty::$variant => $name,)+ })
            }
        }
    };
}

string_enum!(AllocatorKind, "allocator", {
    "paged" => Paged,
    "contiguous-max" => ContiguousMax,
    "contiguous-pow2" => ContiguousPow2,
    "contiguous-oracle" => ContiguousOracle,
});
string_enum!(Placement, "placement", { "first-fit" => FirstFit, "buddy" => Buddy });
string_enum!(Arrival, "arrival", { "saturated" => Saturated, "trace" => Trace, "poisson" => Poisson });
string_enum!(Preemption, "preemption", { "recompute" => Recompute, "swap" => Swap });
string_enum!(Scheduling, "scheduling", { "fcfs" => Fcfs, "lpm" => Lpm, "dfs" => Dfs });

/// Default [`SimConfig::aging_bound`]: admissions that may pass over a waiting request.
pub const DEFAULT_AGING_BOUND: usize = 2048;

/// Settings of one simulation run (field names and defaults match the Python `SimConfig`).
///
/// ```
/// use pagedkv_sim::{AllocatorKind, SimConfig};
/// let config = SimConfig { allocator: AllocatorKind::ContiguousMax, num_slots: 4096, ..Default::default() };
/// config.validate()?;
/// assert_eq!(SimConfig { block_size: 0, ..Default::default() }.validate().is_err(), true);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Allocation policy.
    pub allocator: AllocatorKind,
    /// Placement of contiguous reservations (ignored by `Paged`).
    pub placement: Placement,
    /// Token slots per block (paged), and the cell size of contiguous frames.
    pub block_size: usize,
    /// Pool size in token slots; paged uses `num_slots / block_size` blocks, and the remainder
    /// counts as external fragmentation.
    pub num_slots: usize,
    /// Longest allowed sequence (prompt + output); `ContiguousMax` reserves this much.
    pub max_model_len: usize,
    /// Arrival process.
    pub arrival: Arrival,
    /// Requests per second when `arrival` is `Poisson`.
    pub poisson_rate: f64,
    /// Simulated seconds per engine step.
    pub step_time_s: f64,
    /// Preemption policy of the paged allocator.
    pub preemption: Preemption,
    /// Host-tier size in token slots (`num_host_slots / block_size` host blocks) for swapping.
    pub num_host_slots: usize,
    /// Most sequences running at once (a group of n counts n).
    pub max_num_seqs: usize,
    /// Share prefix blocks among requests (paged only; contiguous never shares).
    pub enable_prefix_caching: bool,
    /// Seed of the Poisson arrivals and of the beam-search model.
    pub seed: u64,
    /// Stop after this many steps (`None`: run until every request finished).
    pub max_steps: Option<usize>,
    /// Paged admission keeps this share of the blocks free for running requests to grow
    /// into (vLLM's watermark, default 1 %). A request is still admitted when nothing else runs.
    pub watermark: f64,
    /// Check the allocator's invariants after every step (slow; for tests).
    pub check_invariants: bool,
    /// Admission order of waiting requests; `Lpm` and `Dfs` need the paged allocator with prefix
    /// caching and no host tier.
    pub scheduling: Scheduling,
    /// Most admissions that may pass over a waiting request under `Lpm` and `Dfs` (0: they
    /// admit first come, first served).
    pub aging_bound: usize,
    /// Queue-aware eviction (docs/scheduling.md): the scheduler marks the blocks its waiting
    /// requests will hit, and the allocator evicts them after every other cached block. Needs
    /// `Lpm` or `Dfs`; off by default (plain LRU).
    pub queue_aware_eviction: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            allocator: AllocatorKind::Paged,
            placement: Placement::FirstFit,
            block_size: 16,
            num_slots: 15_744,
            max_model_len: 2048,
            arrival: Arrival::Saturated,
            poisson_rate: 10.0,
            step_time_s: 0.02,
            preemption: Preemption::Recompute,
            num_host_slots: 0,
            max_num_seqs: 256,
            enable_prefix_caching: false,
            seed: 0,
            max_steps: None,
            watermark: 0.01,
            check_invariants: false,
            scheduling: Scheduling::Fcfs,
            aging_bound: DEFAULT_AGING_BOUND,
            queue_aware_eviction: false,
        }
    }
}

impl SimConfig {
    /// Blocks of the paged pool.
    pub fn num_blocks(&self) -> usize {
        self.num_slots / self.block_size.max(1)
    }

    /// Host blocks of the paged swap tier.
    pub fn num_host_blocks(&self) -> usize {
        self.num_host_slots / self.block_size.max(1)
    }

    /// Blocks paged admission leaves free.
    pub fn watermark_blocks(&self) -> usize {
        (self.watermark * self.num_blocks() as f64).ceil() as usize
    }

    /// Rejects settings that cannot describe a run, with a message naming the setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidArgument(msg));
        if self.block_size == 0 {
            return bad("block_size must be at least 1".into());
        }
        if self.num_slots == 0 || self.num_slots > MAX_NUM_SLOTS {
            return bad(format!(
                "num_slots must lie in 1..={MAX_NUM_SLOTS}, got {}",
                self.num_slots
            ));
        }
        if self.allocator == AllocatorKind::Paged && self.num_slots < self.block_size {
            return bad(format!(
                "num_slots {} holds no block of block_size {}",
                self.num_slots, self.block_size
            ));
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be at least 1".into());
        }
        if !(self.step_time_s.is_finite() && self.step_time_s > 0.0) {
            return bad(format!(
                "step_time_s must be a positive number, got {}",
                self.step_time_s
            ));
        }
        if self.arrival == Arrival::Poisson
            && !(self.poisson_rate.is_finite() && self.poisson_rate > 0.0)
        {
            return bad(format!(
                "poisson_rate must be a positive number, got {}",
                self.poisson_rate
            ));
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1".into());
        }
        if !(self.watermark.is_finite() && (0.0..1.0).contains(&self.watermark)) {
            return bad(format!(
                "watermark must lie in [0, 1), got {}",
                self.watermark
            ));
        }
        if self.max_steps == Some(0) {
            return bad("max_steps must be at least 1 (or None)".into());
        }
        if self.scheduling != Scheduling::Fcfs
            && (self.allocator != AllocatorKind::Paged
                || !self.enable_prefix_caching
                || self.num_host_blocks() > 0)
        {
            return bad(format!(
                "scheduling '{}' orders requests by the prefix cache: it needs the paged allocator \
                 with prefix caching on and no host tier (got allocator '{}', prefix caching {}, \
                 {} host slots)",
                self.scheduling,
                self.allocator,
                if self.enable_prefix_caching { "on" } else { "off" },
                self.num_host_slots
            ));
        }
        if self.queue_aware_eviction && self.scheduling == Scheduling::Fcfs {
            return bad(
                "queue_aware_eviction follows the waiting requests of a cache-aware queue: it needs \
                 scheduling 'lpm' or 'dfs'"
                    .into(),
            );
        }
        if self.allocator == AllocatorKind::Paged
            && self.preemption == Preemption::Swap
            && self.num_host_blocks() == 0
        {
            return bad(format!(
                "preemption 'swap' needs a host tier: num_host_slots {} holds no block of {} slots",
                self.num_host_slots, self.block_size
            ));
        }
        Ok(())
    }
}
