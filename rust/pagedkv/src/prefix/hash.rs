//! The keyed, chained block hash.
//!
//! A full block's hash chains its parent's hash, its token ids and an optional extra key
//! (cache salt, adapter id, multimodal content hash): equal hashes mean equal whole prefixes,
//! not just equal blocks. The function is XXH3-128 (the `xxhash-rust` crate) seeded with the
//! configurable `hash_seed`, so runs are reproducible and a deployment can pick a secret seed.
//! It is fed this byte string (every integer little-endian; every variable part
//! length-prefixed, so no two inputs share an encoding):
//!
//! ```text
//! parent (u128, 0 for the first block) | num_tokens << 1 | has_parent (u64)
//! | extra tag (u64: 0 none, else len + 1) | extra bytes | token ids (u32 each)
//! ```
//!
//! which any XXH3 implementation reproduces: `xxh3_128(message, seed)`, for instance Python's
//! `xxhash.xxh3_128_intdigest(message, seed=seed)` (the golden values below come from it).
//!
//! Why XXH3-128: hashing every full block of every prompt was most of prefix admission's
//! instructions (a 1,324-token prompt is 82 blocks), and XXH3-128 costs less than half of
//! SipHash-1-3-128 or HighwayHash-128 per 16-token block including building the message (the
//! counts: benches/results/2026-12-01-prefix-admission.md). The guarantees kept: keyed by the
//! seed, 128 bits (vLLM offers the same function as its `xxhash` prefix-caching hash), and
//! every hit compares the block's token ids, parent hash and extra key
//! (`prefix/index.rs`), so a colliding hash never serves another block's tokens. What is
//! given up is SipHash's standing as a PRF: XXH3 is not a cryptographic hash, so a
//! deployment where clients choose prompts and must not be able to collide two prefixes
//! keeps its `hash_seed` secret and separates tenants with an extra key (cache salt).
//!
//! Admission hashes a prompt's blocks with one `ChainHasher`: the message is built once and each block rewrites only its parent and token ids, so
//! nothing is allocated per block.

use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::TokenId;

/// A 128-bit chained block hash.
pub type BlockHash = u128;

/// Bytes before the extra key: parent (16), `num_tokens << 1 | has_parent` (8), extra tag (8).
const HEADER_BYTES: usize = 32;

/// Messages up to this size are built on the stack (blocks of up to 56 tokens without an
/// extra key); longer ones on the heap.
const STACK_MESSAGE_BYTES: usize = 256;

/// The keyed, chained block hash (XXH3-128 seeded, see the module docs).
///
/// ```
/// use pagedkv::BlockHasher;
/// let h = BlockHasher::new(42);
/// let first = h.hash_block(None, &[1, 2, 3, 4], None);
/// let second = h.hash_block(Some(first), &[5, 6, 7, 8], None);
/// assert_ne!(first, second);
/// assert_eq!(first, BlockHasher::new(42).hash_block(None, &[1, 2, 3, 4], None)); // reproducible
/// assert_ne!(first, BlockHasher::new(43).hash_block(None, &[1, 2, 3, 4], None)); // keyed
/// assert_ne!(first, h.hash_block(None, &[1, 2, 3, 4], Some(b"tenant-a")));      // salted
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    seed: u64,
}

/// Writes the parent, the `num_tokens << 1 | has_parent` word and the token ids of one block
/// into a message whose extra tag and extra bytes are already in place (`tokens_at` is where
/// the token ids start).
#[inline]
fn write_block(msg: &mut [u8], tokens_at: usize, parent: Option<BlockHash>, token_ids: &[TokenId]) {
    msg[..16].copy_from_slice(&parent.unwrap_or(0).to_le_bytes());
    let word = (token_ids.len() as u64) << 1 | u64::from(parent.is_some());
    msg[16..24].copy_from_slice(&word.to_le_bytes());
    let dst = &mut msg[tokens_at..tokens_at + 4 * token_ids.len()];
    for (d, t) in dst.chunks_exact_mut(4).zip(token_ids) {
        d.copy_from_slice(&t.to_le_bytes());
    }
}

/// Writes the extra tag and extra bytes; returns where the token ids start.
#[inline]
fn write_extra(msg: &mut [u8], extra_key: Option<&[u8]>) -> usize {
    let tag = extra_key.map_or(0, |e| e.len() as u64 + 1);
    msg[24..32].copy_from_slice(&tag.to_le_bytes());
    let extra = extra_key.unwrap_or_default();
    msg[HEADER_BYTES..HEADER_BYTES + extra.len()].copy_from_slice(extra);
    HEADER_BYTES + extra.len()
}

impl BlockHasher {
    /// A hasher keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        BlockHasher { seed }
    }

    /// The XXH3 seed (the key).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Hash of one block given its parent's hash (`None` for the first block), its token ids
    /// and the sequence's extra key.
    #[inline]
    pub fn hash_block(
        &self,
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> BlockHash {
        self.chain(token_ids.len(), extra_key)
            .hash(parent, token_ids)
    }

    /// A [`ChainHasher`] for the `block_size`-token blocks of a sequence with `extra_key`.
    #[inline]
    pub(crate) fn chain(&self, block_size: usize, extra_key: Option<&[u8]>) -> ChainHasher {
        let len = HEADER_BYTES + extra_key.map_or(0, <[u8]>::len) + 4 * block_size;
        let mut chain = ChainHasher {
            seed: self.seed,
            stack: [0; STACK_MESSAGE_BYTES],
            heap: if len > STACK_MESSAGE_BYTES {
                vec![0; len]
            } else {
                Vec::new()
            },
            len,
            tokens_at: 0,
        };
        chain.tokens_at = write_extra(chain.message(), extra_key);
        chain
    }

    /// The exact byte string [`BlockHasher::hash_block`] hashes (for cross-checking against
    /// any standard XXH3-128 implementation).
    pub fn message_bytes(
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
        let word = (token_ids.len() as u64) << 1 | u64::from(parent.is_some());
        m.extend_from_slice(&word.to_le_bytes());
        let tag = extra_key.map_or(0, |e| e.len() as u64 + 1);
        m.extend_from_slice(&tag.to_le_bytes());
        m.extend_from_slice(extra_key.unwrap_or_default());
        for t in token_ids {
            m.extend_from_slice(&t.to_le_bytes());
        }
        m
    }
}

/// The index key of a block of KV-cache group `group` holding content `hash`
/// (docs/design.md, KV groups): the content hash itself for group 0, so a single-group
/// manager's keys are its content hashes, and `hash ^ mix(group)` for the others, so the same
/// content in two groups is two entries. XOR with a per-group constant is its own inverse:
/// [`content_hash`] recovers the content hash (what KV events carry) from the key.
#[inline]
pub(crate) fn group_key(group: u32, hash: BlockHash) -> BlockHash {
    hash ^ group_mix(group)
}

/// The content hash of the block entered under `key` for `group` (see [`group_key`]).
#[inline]
pub(crate) fn content_hash(group: u32, key: BlockHash) -> BlockHash {
    key ^ group_mix(group)
}

/// The per-group constant of [`group_key`]: 0 for group 0, two SplitMix64 outputs otherwise
/// (distinct and non-zero for every group a manager can have).
#[inline]
fn group_mix(group: u32) -> BlockHash {
    if group == 0 {
        return 0;
    }
    let mut state = u64::from(group);
    let hi = crate::splitmix64::next(&mut state);
    let lo = crate::splitmix64::next(&mut state);
    (u128::from(hi) << 64) | u128::from(lo)
}

/// A caller's block hash of any length reduced to the 128 bits the index keys blocks by
/// (docs/design.md, Per-chunk allocation, "Caller-supplied keys and hashes"): its first 16
/// bytes read little-endian, zero-padded when shorter. vLLM's `request.block_hashes` are 32-byte
/// SHA-256 digests (or 16-byte XXH3-128 ones), whose leading 128 bits are as uniform as the whole.
///
/// ```
/// use pagedkv::reduce_block_hash;
/// assert_eq!(reduce_block_hash(&[1, 0, 0]), 1);
/// assert_eq!(reduce_block_hash(&[0xff; 32]), u128::MAX);
/// assert_eq!(reduce_block_hash(&[]), 0);
/// ```
pub fn reduce_block_hash(bytes: &[u8]) -> BlockHash {
    let mut buf = [0u8; 16];
    let n = bytes.len().min(16);
    buf[..n].copy_from_slice(&bytes[..n]);
    u128::from_le_bytes(buf)
}

/// Hashes a sequence's blocks one at a time with one message buffer, built once (the extra
/// key written once); each block rewrites only its parent and token ids. What admission hashes
/// a missed prompt's blocks with as it enters them (each hash waits on its parent's, so computed there, next to the
/// index writes, the chain's latency overlaps their cache misses).
pub(crate) struct ChainHasher {
    seed: u64,
    /// The message, when it fits (`len` bytes of it).
    stack: [u8; STACK_MESSAGE_BYTES],
    /// The message, when it does not (a long extra key); empty otherwise.
    heap: Vec<u8>,
    /// Message bytes.
    len: usize,
    /// Where the token ids start.
    tokens_at: usize,
}

impl ChainHasher {
    #[inline]
    fn message(&mut self) -> &mut [u8] {
        if self.heap.is_empty() {
            &mut self.stack[..self.len]
        } else {
            &mut self.heap
        }
    }

    /// The hash of the block holding `token_ids` (`block_size` of them) after `parent`.
    #[inline]
    pub(crate) fn hash(&mut self, parent: Option<BlockHash>, token_ids: &[TokenId]) -> BlockHash {
        debug_assert_eq!(self.tokens_at + 4 * token_ids.len(), self.len);
        let (tokens_at, seed) = (self.tokens_at, self.seed);
        let msg = self.message();
        write_block(msg, tokens_at, parent, token_ids);
        xxh3_128_with_seed(msg, seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_encoding_is_unambiguous() {
        let a = BlockHasher::message_bytes(None, &[1, 2], Some(b""));
        let b = BlockHasher::message_bytes(None, &[1, 2], None);
        assert_ne!(a, b);
        let h = BlockHasher::new(7);
        assert_ne!(
            h.hash_block(None, &[1, 2], Some(b"")),
            h.hash_block(None, &[1, 2], None)
        );
        assert_ne!(
            h.hash_block(Some(0), &[1, 2], None),
            h.hash_block(None, &[1, 2], None)
        );
        assert_ne!(
            h.hash_block(None, &[1, 2, 0], None),
            h.hash_block(None, &[1, 2], None)
        );
        // The extra key's bytes cannot pass for token ids: its length is in the tag.
        assert_ne!(
            h.hash_block(None, &[1], Some(&2u32.to_le_bytes())),
            h.hash_block(None, &[2, 1], Some(b""))
        );
    }

    /// The stack path, the heap path (a long extra key) and the chain agree with a one-shot
    /// hash of [`BlockHasher::message_bytes`].
    #[test]
    fn every_path_hashes_the_documented_message() {
        let h = BlockHasher::new(99);
        let long = vec![5u8; 300];
        for extra in [None, Some(&b"salt"[..]), Some(&long[..])] {
            let tokens: Vec<TokenId> = (0..50).collect();
            let mut chain = h.chain(16, extra);
            let mut parent = None;
            for block in tokens.chunks_exact(16) {
                let msg = BlockHasher::message_bytes(parent, block, extra);
                let expected = xxh3_128_with_seed(&msg, 99);
                assert_eq!(h.hash_block(parent, block, extra), expected);
                assert_eq!(chain.hash(parent, block), expected);
                parent = Some(expected);
            }
        }
    }

    /// Golden values, computed independently (Python's `xxhash` package,
    /// `xxh3_128_intdigest(message, seed=1234)` over the documented encoding), so a change of
    /// the function or of its encoding, which would change every stored hash and KV event,
    /// cannot go unnoticed.
    #[test]
    fn hashes_match_golden_values() {
        let h = BlockHasher::new(1234);
        let first = h.hash_block(None, &[1, 2, 3, 4, 5], None);
        assert_eq!(first, GOLDEN_FIRST);
        assert_eq!(
            h.hash_block(Some(first), &[7; 16], Some(b"tenant-a")),
            GOLDEN_SECOND
        );
    }

    #[test]
    fn group_keys_leave_group_0_alone_and_invert() {
        let h: BlockHash = 0x1234_5678_9abc_def0_1122_3344_5566_7788;
        assert_eq!(group_key(0, h), h);
        let mut seen = std::collections::HashSet::new();
        for g in 0..64 {
            let k = group_key(g, h);
            assert!(seen.insert(k), "group {g} repeats a key");
            assert_eq!(content_hash(g, k), h);
        }
    }

    const GOLDEN_FIRST: u128 = 0x0aaf_8611_0edd_7e40_b0ed_41c6_448c_4294;
    const GOLDEN_SECOND: u128 = 0xfb16_dde3_c31b_92b9_9ec2_d090_b784_4c34;
}
