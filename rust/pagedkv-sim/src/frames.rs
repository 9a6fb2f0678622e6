//! Step-by-step pictures of the pool for the visualizer (`record_frames`).

use crate::metrics::SlotShares;

/// One cell of the pool picture: a block (paged) or `block_size` slots (contiguous).
///
/// ```
/// use pagedkv_sim::FrameCell;
/// let cell = FrameCell { owner: 3, tokens: 10, reserved: 6 };
/// assert_eq!(cell.owner, 3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameCell {
    /// Workload index of the request holding (most of) the cell, or -1 when free.
    pub owner: i64,
    /// Slots holding tokens.
    pub tokens: usize,
    /// Slots allocated but empty (reserved or internal fragmentation).
    pub reserved: usize,
}

/// One sequence's table in a frame.
///
/// ```
/// use pagedkv_sim::FrameSequence;
/// let s = FrameSequence { blocks: vec![4, 0, 7], num_tokens: 40 };
/// assert_eq!(s.blocks.len(), 3);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameSequence {
    /// Physical block ids (paged) or the cells its reservation covers (contiguous), in logical order.
    pub blocks: Vec<u32>,
    /// Tokens it holds.
    pub num_tokens: usize,
}

/// The pool picture of one step.
///
/// ```
/// use pagedkv_sim::FramePool;
/// let p = FramePool::default();
/// assert!(p.cells.is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FramePool {
    /// Every cell in address order.
    pub cells: Vec<FrameCell>,
    /// (request index, its sequences) for every running request, in admission order.
    pub tables: Vec<(usize, Vec<FrameSequence>)>,
    /// (block id, refcount) of blocks shared by more than one sequence (paged).
    pub shared: Vec<(u32, u32)>,
}

/// Counters and pool picture after one step.
///
/// ```
/// use pagedkv_sim::{record_frames, GroupKind, SimConfig, Workload};
/// let w = Workload::from_arrays(&[20], &[3], &[0.0], None, GroupKind::None, None, None)?;
/// let (result, frames) = record_frames(&w, &SimConfig { num_slots: 64, block_size: 8, ..Default::default() }, 100)?;
/// assert_eq!(frames.len(), result.steps);
/// assert_eq!(frames[0].used_blocks, 3); // 21 tokens in blocks of 8
/// assert_eq!(frames[0].shares.token_slots, 21);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// Step index, from 0.
    pub step: usize,
    /// Simulated time at the step.
    pub time_s: f64,
    /// Requests holding memory (admitted, not finished).
    pub running: usize,
    /// Requests arrived and waiting (including swapped-out ones).
    pub waiting: usize,
    /// Requests finished so far (including this step's).
    pub finished: usize,
    /// Preemptions so far.
    pub preemptions: usize,
    /// Blocks (paged) or cells (contiguous) in use.
    pub used_blocks: usize,
    /// Slot accounting of the step.
    pub shares: SlotShares,
    /// Cells, tables and sharing.
    pub pool: FramePool,
}

impl Frame {
    /// Waste in percent of the pool: slots neither holding a token nor free (reserved, internal
    /// and external fragmentation). The same definition as a run's time-averaged `waste` share
    /// (docs/metrics.md), so the visualizer's per-step value and the tables agree.
    pub fn waste_pct(&self) -> f64 {
        let total = self.shares.total();
        if total == 0 {
            0.0
        } else {
            let wasted = self.shares.reserved_slots
                + self.shares.internal_slots
                + self.shares.external_slots;
            100.0 * wasted as f64 / total as f64
        }
    }
}
