//! Trace prefix blocks: a request's prompt as a chain of shared block ids (the Mooncake trace
//! format's `hash_ids`), so that requests share exactly the leading tokens their id lists share.
//!
//! Block id `h` of `block_tokens` tokens stands for the token ids `h * block_tokens + [0,
//! block_tokens)` (what `pagedkv cluster` replays, `pagedkv.sim.cluster.block_tokens`): distinct
//! per block, equal for equal ids. A prompt position past the request's last listed block gets a
//! token of the request's own (docs/metrics.md, Prefix-sharing traces).

use pagedkv::{Error, Result, TokenId};

/// Every request's trace block ids, flattened (`ids[offsets[i]..offsets[i + 1]]` are request
/// `i`'s).
///
/// ```
/// use pagedkv_sim::PrefixBlocks;
/// let blocks = PrefixBlocks::new(512, &[0, 2, 3], &[7, 8, 7])?;
/// assert_eq!(blocks.of(0), &[7, 8]);
/// assert_eq!(blocks.of(1), &[7]);
/// assert!(PrefixBlocks::new(512, &[0, 2], &[7]).is_err());  // offsets past the ids
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixBlocks {
    /// Tokens per trace block (>= 1).
    block_tokens: usize,
    /// `[R + 1]`, non-decreasing, from 0 to `ids.len()`.
    offsets: Vec<usize>,
    /// Block ids; every `id * block_tokens + block_tokens - 1` fits a token id (u32).
    ids: Vec<u32>,
}

impl PrefixBlocks {
    /// Validates the columns: `offsets` is `[R + 1]` (0 first, non-decreasing, `ids.len()` last),
    /// every id is >= 0 and small enough that its last token id fits a `u32`. Errors name the
    /// offending request or entry.
    pub fn new(block_tokens: usize, offsets: &[i64], ids: &[i64]) -> Result<PrefixBlocks> {
        let bad = |msg: String| Err(Error::InvalidArgument(msg));
        if block_tokens == 0 || block_tokens > u32::MAX as usize {
            return bad(format!(
                "block_tokens must lie in 1..=2**32-1, got {block_tokens}"
            ));
        }
        if offsets.first() != Some(&0) {
            return bad("block_offsets must start at 0 (one entry per request, plus one)".into());
        }
        if offsets.last().copied() != Some(ids.len() as i64) {
            return bad(format!(
                "block_offsets must end at the number of block ids ({}), got {:?}",
                ids.len(),
                offsets.last()
            ));
        }
        if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
            return bad(format!(
                "request {i}: block_offsets decrease ({} then {})",
                offsets[i],
                offsets[i + 1]
            ));
        }
        // The largest id whose last token, id * block_tokens + block_tokens - 1, fits a u32.
        let max_id = (u32::MAX as u64 + 1) / block_tokens as u64 - 1;
        if let Some(k) = ids.iter().position(|&h| h < 0 || h as u64 > max_id) {
            return bad(format!(
                "block id {} (entry {k}) must lie in 0..={max_id} for blocks of {block_tokens} tokens",
                ids[k]
            ));
        }
        Ok(PrefixBlocks {
            block_tokens,
            offsets: offsets.iter().map(|&o| o as usize).collect(),
            ids: ids.iter().map(|&h| h as u32).collect(),
        })
    }

    /// Tokens per trace block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Requests described (`offsets.len() - 1`).
    pub fn num_requests(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Request `request`'s block ids, in prompt order.
    pub fn of(&self, request: usize) -> &[u32] {
        &self.ids[self.offsets[request]..self.offsets[request + 1]]
    }

    /// The flattened columns (`offsets` `[R + 1]`, `ids`), as [`PrefixBlocks::new`] takes them.
    pub fn columns(&self) -> (Vec<i64>, Vec<i64>) {
        (
            self.offsets.iter().map(|&o| o as i64).collect(),
            self.ids.iter().map(|&h| i64::from(h)).collect(),
        )
    }

    /// The token at `position` of a prompt listing `ids`, if a listed block covers it.
    #[inline]
    pub(crate) fn token(&self, ids: &[u32], position: usize) -> Option<TokenId> {
        let block = position / self.block_tokens;
        ids.get(block)
            .map(|&h| h * self.block_tokens as u32 + (position % self.block_tokens) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_malformed_columns_naming_the_entry() {
        let msg = |r: Result<PrefixBlocks>| r.unwrap_err().to_string();
        assert!(msg(PrefixBlocks::new(0, &[0], &[])).contains("block_tokens"));
        assert!(msg(PrefixBlocks::new(4, &[1, 1], &[5])).contains("start at 0"));
        assert!(msg(PrefixBlocks::new(4, &[0, 2, 3], &[5])).contains("end at"));
        assert!(msg(PrefixBlocks::new(4, &[0, 2, 1, 3], &[5, 6, 7])).contains("request 1"));
        assert!(msg(PrefixBlocks::new(4, &[0, 1], &[-1])).contains("entry 0"));
        assert!(msg(PrefixBlocks::new(512, &[0, 1], &[1 << 23])).contains("0..=8388607"));
        assert!(PrefixBlocks::new(512, &[0, 1], &[(1 << 23) - 1]).is_ok());
    }

    #[test]
    fn tokens_follow_the_block_ids() {
        let b = PrefixBlocks::new(4, &[0, 2], &[3, 9]).unwrap();
        let ids = b.of(0);
        let row: Vec<_> = (0..9).map(|p| b.token(ids, p)).collect();
        assert_eq!(&row[..4], &[Some(12), Some(13), Some(14), Some(15)]);
        assert_eq!(&row[4..8], &[Some(36), Some(37), Some(38), Some(39)]);
        assert_eq!(row[8], None);
        assert_eq!(b.columns(), (vec![0, 2], vec![3, 9]));
    }
}
