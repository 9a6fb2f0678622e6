//! The keyed, chained block hash.
//!
//! A full block's hash chains its parent's hash, its token ids and an optional extra key
//! (cache salt, adapter id, multimodal content hash): equal hashes mean equal whole prefixes,
//! not just equal blocks. The function is SipHash-1-3 with 128-bit output (the `siphasher`
//! crate), keyed from a configurable seed (`k0 = seed`, `k1 =` the first SplitMix64 output
//! from `seed`), so runs are reproducible and a deployment can pick a secret seed. It is fed
//! this byte string (little-endian `u64` words, zero-padded, every variable part
//! length-prefixed so no two inputs share an encoding):
//!
//! ```text
//! parent (u128, 0 for the first block) | has_parent (0|1) | extra tag (0: none, len+1)
//! | extra bytes, padded to 8 | num_tokens | token ids as u32, padded to 8
//! ```
//!
//! Whole words go to the hasher one `write_u64` at a time, so no message buffer is built.
//!
//! Why SipHash-1-3: hashing every full block of every prompt is most of prefix admission's
//! instructions (a 1,324-token prompt is 82 blocks). SipHash-1-3 is the keyed PRF Rust's own
//! `HashMap` trusts against chosen-input flooding, at about half SipHash-2-4's rounds; the
//! 128-bit output is kept because equal chain hashes stand for equal whole prefixes, and
//! every hit still compares the block's tokens, parent hash and extra key. A word-only
//! hand-written SipHash-1-3 was tried and measured (callgrind, W2 admission): the same
//! instruction count as the crate's, so the crate stays. Numbers in benches/README.md.

use std::hash::Hasher;

use siphasher::sip128::{Hasher128, SipHasher13};

use crate::{splitmix64, TokenId};

/// A 128-bit chained block hash.
pub type BlockHash = u128;

/// The keyed, chained block hash (SipHash-1-3-128, see the module docs).
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
    k0: u64,
    k1: u64,
}

/// The little-endian `u64` of up to 8 bytes, zero-padded.
#[inline]
fn le_word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..bytes.len()].copy_from_slice(bytes);
    u64::from_le_bytes(w)
}

impl BlockHasher {
    /// A hasher keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        let mut state = seed;
        BlockHasher {
            k0: seed,
            k1: splitmix64::next(&mut state),
        }
    }

    /// The two SipHash keys derived from the seed.
    pub fn keys(&self) -> (u64, u64) {
        (self.k0, self.k1)
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
        let mut s = SipHasher13::new_with_keys(self.k0, self.k1);
        let p = parent.unwrap_or(0);
        s.write_u64(p as u64);
        s.write_u64((p >> 64) as u64);
        s.write_u64(u64::from(parent.is_some()));
        match extra_key {
            None => s.write_u64(0),
            Some(extra) => {
                s.write_u64(extra.len() as u64 + 1);
                for chunk in extra.chunks(8) {
                    s.write_u64(le_word(chunk));
                }
            }
        }
        s.write_u64(token_ids.len() as u64);
        let mut pairs = token_ids.chunks_exact(2);
        for pair in &mut pairs {
            s.write_u64(u64::from(pair[0]) | u64::from(pair[1]) << 32);
        }
        if let [last] = pairs.remainder() {
            s.write_u64(u64::from(*last));
        }
        s.finish128().as_u128()
    }

    /// The exact byte string [`BlockHasher::hash_block`] hashes (for cross-checking against
    /// any standard SipHash-1-3-128 implementation).
    pub fn message_bytes(
        parent: Option<BlockHash>,
        token_ids: &[TokenId],
        extra_key: Option<&[u8]>,
    ) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
        m.extend_from_slice(&u64::from(parent.is_some()).to_le_bytes());
        match extra_key {
            None => m.extend_from_slice(&0u64.to_le_bytes()),
            Some(extra) => {
                m.extend_from_slice(&(extra.len() as u64 + 1).to_le_bytes());
                m.extend_from_slice(extra);
                m.resize(m.len().div_ceil(8) * 8, 0);
            }
        }
        m.extend_from_slice(&(token_ids.len() as u64).to_le_bytes());
        for t in token_ids {
            m.extend_from_slice(&t.to_le_bytes());
        }
        m.resize(m.len().div_ceil(8) * 8, 0);
        m
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
    }

    /// Golden values, computed independently (a plain Python SipHash-1-3-128 over
    /// [`BlockHasher::message_bytes`]), so a change of the function or of its encoding, which
    /// would change every stored hash and KV event, cannot go unnoticed.
    #[test]
    fn hashes_match_golden_values() {
        let h = BlockHasher::new(0);
        assert_eq!(h.keys(), (0, 0xE220_A839_7B1D_CDAF));
        let h = BlockHasher::new(1234);
        let first = h.hash_block(None, &[1, 2, 3, 4, 5], None);
        assert_eq!(first, 0x376e_930b_83f3_5f5e_3ff6_5ec4_73c9_3ba5);
        assert_eq!(
            h.hash_block(Some(first), &[7; 16], Some(b"tenant-a")),
            0x68af_5dad_225d_7778_66eb_8499_c25f_d093
        );
    }
}
