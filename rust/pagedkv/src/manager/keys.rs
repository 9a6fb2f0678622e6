//! Caller-supplied per-block extra keys and block hashes (docs/design.md, Per-chunk
//! allocation, "Caller-supplied keys and hashes"), and the content hashes of a prompt's blocks
//! computed lazily from them.
//!
//! A block's **effective key** is what the index stores and compares as its extra key: the
//! sequence's `extra_key` when the block has no key of its own (so a sequence without block
//! keys hashes exactly as before), otherwise both keys in one unambiguous encoding
//! ([`combine`]). A block's **content hash** is the caller's when the caller gave block hashes,
//! otherwise the chained hash of its parent's hash, its token ids and its effective key.

use std::sync::Arc;

use super::config::AdmitOptions;
use crate::error::{invalid, Result};
use crate::prefix::hash::{BlockHash, BlockHasher};
use crate::TokenId;

/// A sequence's caller-supplied keys and hashes, by block position from block 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct BlockKeys {
    /// Effective key of each block that has a key of its own (see the module docs); positions
    /// past the end, or `None`, take the sequence's key.
    pub(super) own: Vec<Option<Arc<[u8]>>>,
    /// The caller's content hashes of the full blocks (`None`: pagedkv hashes them).
    pub(super) hashes: Option<Vec<BlockHash>>,
    /// pagedkv's own hashes of the first full blocks, given at admission
    /// (`AdmitOptions::prompt_hashes`) and read instead of hashing those blocks as they are
    /// computed; never with `own` or `hashes` (empty once used).
    pub(super) given: Vec<BlockHash>,
}

impl BlockKeys {
    /// Keys holding only pagedkv's own hashes `given` (`AdmitOptions::prompt_hashes`).
    pub(super) fn given(given: &[BlockHash]) -> Box<BlockKeys> {
        Box::new(BlockKeys {
            given: given.to_vec(),
            ..BlockKeys::default()
        })
    }

    /// Whether the caller gave block keys or hashes of its own (then the fast paths, which
    /// know neither, do not apply); pagedkv's own given hashes do not count.
    pub(super) fn is_keyed(&self) -> bool {
        !self.own.is_empty() || self.hashes.is_some()
    }

    /// The keys of an admission (`None` when it gave neither), each block key combined with
    /// the sequence's key. InvalidArgument when a list is longer than the prompt's blocks
    /// (`block_hashes`: its full blocks) or hashes are given without token ids.
    pub(super) fn from_admission(
        seq_key: Option<&[u8]>,
        block_extra_keys: Option<&[Option<&[u8]>]>,
        block_hashes: Option<&[BlockHash]>,
        num_tokens: usize,
        has_tokens: bool,
        block_size: usize,
    ) -> Result<Option<Box<BlockKeys>>> {
        if block_extra_keys.is_none() && block_hashes.is_none() {
            return Ok(None);
        }
        let (num_blocks, num_full) = (num_tokens.div_ceil(block_size), num_tokens / block_size);
        if let Some(k) = block_extra_keys {
            if k.len() > num_blocks {
                return invalid(format!(
                    "block_extra_keys has {} entries for a prompt of {num_blocks} blocks",
                    k.len()
                ));
            }
        }
        if let Some(h) = block_hashes {
            if !has_tokens {
                return invalid("block_hashes needs the prompt's token ids");
            }
            if h.len() > num_full {
                return invalid(format!(
                    "block_hashes has {} entries for a prompt of {num_full} full blocks",
                    h.len()
                ));
            }
        }
        let mut keys = BlockKeys::default();
        keys.extend(seq_key, block_extra_keys, block_hashes);
        if block_hashes.is_some() && keys.hashes.is_none() {
            keys.hashes = Some(Vec::new());
        }
        Ok(Some(Box::new(keys)))
    }

    /// Appends keys for the blocks after those given so far, and hashes for the full blocks
    /// after those given so far (`provide_token_ids`). Each block key is combined with the
    /// sequence's key.
    pub(super) fn extend(
        &mut self,
        seq_key: Option<&[u8]>,
        block_extra_keys: Option<&[Option<&[u8]>]>,
        block_hashes: Option<&[BlockHash]>,
    ) {
        if let Some(new) = block_extra_keys {
            self.own
                .extend(new.iter().map(|k| k.map(|k| combine(seq_key, k))));
        }
        if let Some(new) = block_hashes {
            self.hashes
                .get_or_insert_with(Vec::new)
                .extend_from_slice(new);
        }
    }

    /// Keeps what describes the first `num_tokens` tokens (`truncate`): keys of the blocks
    /// that hold any of them, hashes of the full ones.
    pub(super) fn truncate(&mut self, num_tokens: usize, block_size: usize) {
        self.own.truncate(num_tokens.div_ceil(block_size));
        if let Some(h) = self.hashes.as_mut() {
            h.truncate(num_tokens / block_size);
        }
        self.given.truncate(num_tokens / block_size);
    }
}

/// The validated `AdmitOptions::prompt_hashes` of an admission of `num_tokens` tokens (empty
/// when none were given): InvalidArgument when they come with the caller's `block_hashes` or
/// `block_extra_keys` (then pagedkv's own hashes are not the blocks' names), without token ids,
/// or longer than the prompt's full blocks.
pub(super) fn given_prompt_hashes<'a>(
    o: &AdmitOptions<'a>,
    num_tokens: usize,
    has_tokens: bool,
    block_size: usize,
) -> Result<&'a [BlockHash]> {
    let Some(given) = o.prompt_hashes else {
        return Ok(&[]);
    };
    if o.block_hashes.is_some() || o.block_extra_keys.is_some() {
        return invalid("prompt_hashes cannot be combined with block_hashes or block_extra_keys");
    }
    if !has_tokens {
        return invalid("prompt_hashes needs the prompt's token ids");
    }
    let num_full = num_tokens / block_size;
    if given.len() > num_full {
        return invalid(format!(
            "prompt_hashes has {} entries for a prompt of {num_full} full blocks",
            given.len()
        ));
    }
    Ok(given)
}

/// The effective key of block `i` (see the module docs).
#[inline]
pub(super) fn effective_key<'a>(
    seq_key: &'a Option<Arc<[u8]>>,
    keys: Option<&'a BlockKeys>,
    i: usize,
) -> &'a Option<Arc<[u8]>> {
    match keys.and_then(|k| k.own.get(i)) {
        Some(own @ Some(_)) => own,
        _ => seq_key,
    }
}

/// A block's own key combined with the sequence's: a tag no plain key is likely to start
/// with, the sequence key's length (`u64::MAX` for none) and bytes, then the block's key.
/// Length-prefixed, so no two pairs share an encoding.
pub(super) fn combine(seq_key: Option<&[u8]>, block_key: &[u8]) -> Arc<[u8]> {
    let mut out = Vec::with_capacity(16 + seq_key.map_or(0, <[u8]>::len) + block_key.len());
    out.extend_from_slice(b"\0pkv-blk");
    let len = seq_key.map_or(u64::MAX, |k| k.len() as u64);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(seq_key.unwrap_or_default());
    out.extend_from_slice(block_key);
    Arc::from(out)
}

/// The content hashes of a prompt's full blocks, computed on demand in chain order (a walk
/// that stops at its first miss hashes no further), or the caller's.
pub(super) struct PromptHashes<'a> {
    hasher: BlockHasher,
    block_size: usize,
    tokens: &'a [TokenId],
    seq_key: &'a Option<Arc<[u8]>>,
    keys: Option<&'a BlockKeys>,
    /// pagedkv's own hashes of the first blocks, given by the caller
    /// (`AdmitOptions::prompt_hashes`): read instead of hashing those blocks.
    given: &'a [BlockHash],
    /// Hashes of blocks `0..len`.
    pub(super) hashes: Vec<BlockHash>,
}

impl<'a> PromptHashes<'a> {
    pub(super) fn new(
        hasher: BlockHasher,
        block_size: usize,
        tokens: &'a [TokenId],
        seq_key: &'a Option<Arc<[u8]>>,
        keys: Option<&'a BlockKeys>,
    ) -> Self {
        PromptHashes {
            hasher,
            block_size,
            tokens,
            seq_key,
            keys,
            given: &[],
            hashes: Vec::new(),
        }
    }

    /// Reads pagedkv's own hashes of the first `given.len()` blocks from `given` instead of
    /// hashing them (`AdmitOptions::prompt_hashes`; never with the caller's `BlockKeys`).
    pub(super) fn with_given(mut self, given: &'a [BlockHash]) -> Self {
        debug_assert!(given.is_empty() || self.keys.is_none());
        self.given = given;
        self
    }

    /// Full blocks that have a hash: every full block, or as many as the caller hashed.
    pub(super) fn num_hashable(&self) -> usize {
        let full = self.tokens.len() / self.block_size;
        match self.keys.and_then(|k| k.hashes.as_ref()) {
            Some(h) => h.len().min(full),
            None => full,
        }
    }

    /// The content hash of block `i < num_hashable()`.
    pub(super) fn get(&mut self, i: usize) -> BlockHash {
        while self.hashes.len() <= i {
            let j = self.hashes.len();
            let h = match self.keys.and_then(|k| k.hashes.as_ref()) {
                Some(caller) => caller[j],
                None if j < self.given.len() => self.given[j],
                None => {
                    let bs = self.block_size;
                    let key = effective_key(self.seq_key, self.keys, j);
                    self.hasher.hash_block(
                        self.hashes.last().copied(),
                        &self.tokens[j * bs..(j + 1) * bs],
                        key.as_deref(),
                    )
                }
            };
            self.hashes.push(h);
        }
        self.hashes[i]
    }

    /// Records `h`, found without hashing (a child hint), as block `i`'s hash when blocks
    /// `0..i` are hashed and `i` is not; otherwise whether `h` is block `i`'s hash.
    pub(super) fn learn(&mut self, i: usize, h: BlockHash) -> bool {
        if i == self.hashes.len() && !self.caller_hashes() {
            self.hashes.push(h);
            return true;
        }
        self.get(i) == h
    }

    /// Block `i`'s parent hash (`None` for block 0); block `i - 1` is hashed by now.
    pub(super) fn parent(&mut self, i: usize) -> Option<BlockHash> {
        i.checked_sub(1).map(|p| self.get(p))
    }

    /// Block `i`'s token ids.
    pub(super) fn tokens(&self, i: usize) -> &'a [TokenId] {
        &self.tokens[i * self.block_size..(i + 1) * self.block_size]
    }

    /// Block `i`'s effective key.
    pub(super) fn key(&self, i: usize) -> Option<&'a [u8]> {
        effective_key(self.seq_key, self.keys, i).as_deref()
    }

    /// Whether the hashes are the caller's.
    pub(super) fn caller_hashes(&self) -> bool {
        self.keys.is_some_and(|k| k.hashes.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combined_keys_are_distinct() {
        let a = combine(Some(b"ab"), b"c");
        let b = combine(Some(b"a"), b"bc");
        let c = combine(None, b"abc");
        let d = combine(Some(b""), b"abc");
        assert!(a != b && b != c && c != d && a != c);
    }

    #[test]
    fn extend_continues_and_truncate_keeps_the_kept_blocks() {
        let mut k = BlockKeys::default();
        k.extend(None, None, Some(&[1, 2]));
        k.extend(None, None, Some(&[3]));
        assert_eq!(k.hashes, Some(vec![1, 2, 3]));
        k.extend(Some(b"s"), Some(&[None, Some(b"x")]), None);
        assert_eq!(k.own.len(), 2);
        assert_eq!(k.own[1].as_deref(), Some(&*combine(Some(b"s"), b"x")));
        k.truncate(3, 2);
        assert_eq!((k.own.len(), k.hashes.as_ref().map(Vec::len)), (2, Some(1)));
    }
}
