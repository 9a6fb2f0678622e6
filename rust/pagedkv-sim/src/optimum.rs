//! The offline optimum of the prefix-cache hit: the most prompt tokens any admission order can
//! serve from the cache, computed from the requests' chained block hashes alone.
//!
//! With `n_r` full blocks in request `r`'s prompt, `D` distinct block hashes over all prompts and
//! `k_v` requests whose prompt ends exactly at the end of block `v` (a multiple of the block size
//! long), the best total is
//!
//! ```text
//! hit blocks = sum_r n_r - D - sum_v max(0, k_v - 1)
//! ```
//!
//! It is an upper bound for every admission order, every pool size and every eviction policy,
//! and an exact optimum: some order reaches it with any pool that can hold one request, one
//! request at a time. docs/scheduling.md, The offline optimum, proves both; the short version:
//! the first request that contains a block computes it (nothing cached it before); a prompt that
//! ends on a block boundary recomputes its last block when it is all cached (the last token is
//! always computed), so at most one of the `k_v` such requests ending at `v` avoids recomputing
//! `v`, by being the first to contain it; and admitting in depth-first order of the block trie,
//! one request at a time, loses nothing else, because each request's hit then lies on the chain
//! of the request just before it, which nothing evicted in between.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use pagedkv::{BlockHash, BlockHasher, Error, Result, TokenId};

use crate::schedule::LowBits;
use crate::tokens::PromptSource;
use crate::workload::Workload;

/// The offline optimum of a workload's prefix-cache hit (prompts only, each request once).
///
/// ```
/// use pagedkv_sim::{optimal_hits, GroupKind, Workload};
/// // Two requests sharing a 64-token system prompt (blocks of 16): the second hits it.
/// let w = Workload::from_arrays(&[100, 90], &[1, 1], &[0.0; 2], None, GroupKind::None,
///                               Some(&[3, 3]), Some(&[64, 64]))?;
/// let best = optimal_hits(&w, 16, 0)?;
/// assert_eq!(best.hit_tokens, 64);
/// assert_eq!(best.prompt_tokens, 190);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OptimalHits {
    /// Prompt tokens of all requests.
    pub prompt_tokens: usize,
    /// The most of them any admission order serves from the prefix cache.
    pub hit_tokens: usize,
    /// Full prompt blocks over all requests (`sum_r n_r`).
    pub prompt_blocks: usize,
    /// Distinct full blocks (`D`): each is computed at least once.
    pub distinct_blocks: usize,
    /// Recomputations of a last block no order avoids (`sum_v max(0, k_v - 1)`).
    pub forced_recomputes: usize,
}

impl OptimalHits {
    /// `hit_tokens / prompt_tokens` (0 for no prompt tokens).
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// The optimum for `workload` in blocks of `block_size` tokens, hashing as a
/// `KvCacheManager` seeded with `hash_seed` does (the simulator passes its `seed`).
pub fn optimal_hits(workload: &Workload, block_size: usize, hash_seed: u64) -> Result<OptimalHits> {
    if block_size == 0 {
        return Err(Error::InvalidArgument(
            "block_size must be at least 1".into(),
        ));
    }
    let hasher = BlockHasher::new(hash_seed);
    let prompts = PromptSource::new(workload);
    let mut seen: HashMap<BlockHash, (), BuildHasherDefault<LowBits>> = HashMap::default();
    // Requests ending exactly at the end of a block, per that block.
    let mut aligned_ends: HashMap<BlockHash, usize, BuildHasherDefault<LowBits>> =
        HashMap::default();
    let mut tokens: Vec<TokenId> = Vec::new();
    let mut out = OptimalHits::default();
    for (request, spec) in workload.requests().iter().enumerate() {
        let len = spec.prompt_tokens;
        out.prompt_tokens += len;
        tokens.clear();
        prompts.extend(spec, request, 0, len, &mut tokens);
        let mut parent = None;
        for chunk in tokens.chunks_exact(block_size) {
            let hash = hasher.hash_block(parent, chunk, None);
            seen.insert(hash, ());
            out.prompt_blocks += 1;
            parent = Some(hash);
        }
        if len % block_size == 0 {
            if let Some(last) = parent {
                *aligned_ends.entry(last).or_default() += 1;
            }
        }
    }
    out.distinct_blocks = seen.len();
    out.forced_recomputes = aligned_ends.values().map(|&k| k - 1).sum();
    out.hit_tokens = (out.prompt_blocks - out.distinct_blocks - out.forced_recomputes) * block_size;
    Ok(out)
}
