//! What a call and each unit of its work read: the parameters every query shares, one
//! sequence's rows, one task (rows x KV heads) and the context every task borrows. A leaf of
//! `attention`: the entry points (`mod.rs`) cut a call into these and the tile (`tile.rs`)
//! computes one, so neither imports the other's module for them.

use super::simd::Simd;
use crate::layout::{BlockTables, CacheShape};

/// What every query of a call shares.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Query heads (a multiple of the cache's KV heads).
    pub num_q_heads: usize,
    /// Multiplies q.k before the softmax.
    pub scale: f32,
    /// Query at position p sees keys 0..=p (else every key of its sequence).
    pub causal: bool,
    /// Sliding window: the query at position p sees only keys p+1-window..=p. Blocks wholly
    /// before the window are never read (their table entries may be -1). Requires `causal`.
    pub window: Option<usize>,
}

/// One sequence's rows of a call.
#[derive(Debug, Clone, Copy)]
pub(super) struct SeqRows {
    /// First query row (token) of the sequence in q / out.
    pub(super) q0: usize,
    /// Query rows: the sequence's last `q_len` tokens.
    pub(super) q_len: usize,
    /// Tokens of the sequence in the cache (keys `0..seq_len`).
    pub(super) seq_len: usize,
    /// A decode row of an empty sequence: no query runs, its output row is zeros.
    pub(super) zero_row: bool,
}

/// One unit of parallel work: query rows `r0..r1` of sequence `seq`, against KV heads `h0..h1`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Task {
    pub(super) seq: usize,
    pub(super) h0: usize,
    pub(super) h1: usize,
    pub(super) r0: usize,
    pub(super) r1: usize,
}

/// What every task of a call reads: the call's arrays, shapes and parameters, and the inner
/// loops' path (chosen once per call).
pub(super) struct Ctx<'a, T> {
    pub(super) q: &'a [T],
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    pub(super) cache: CacheShape,
    pub(super) tables: &'a BlockTables<'a>,
    pub(super) params: AttentionParams,
    /// Query heads per KV head (GQA).
    pub(super) group: usize,
    pub(super) simd: Simd,
}
