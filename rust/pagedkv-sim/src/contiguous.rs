//! Contiguous reservation (Orca-style baselines): each sequence gets one run of slots at
//! admission, sized by a reservation rule and placed by first-fit or buddy; it never grows,
//! so these policies never preempt.

use pagedkv::{Error, Result, SeqId};

use crate::buddy::BuddyAllocator;
use crate::config::{AllocatorKind, Placement, SimConfig};
use crate::extent::{Extent, ExtentAllocator};
use crate::first_fit::FirstFitAllocator;
use crate::frames::{FrameCell, FramePool, FrameSequence};
use crate::group::Group;
use crate::memory::{Admission, FinishedFigures, KvMemory};
use crate::metrics::SlotShares;
use crate::rng::SplitMix64;
use crate::workload::RequestSpec;

/// Slots one sequence of `spec` reserves under a contiguous rule (before placement rounding).
pub(crate) fn reservation_len(
    kind: AllocatorKind,
    spec: &RequestSpec,
    max_model_len: usize,
) -> usize {
    match kind {
        AllocatorKind::ContiguousMax => max_model_len,
        // The output rounded up to a power of two: at most 2x the true output, never beyond
        // max_model_len (which the final length never exceeds).
        AllocatorKind::ContiguousPow2 => (spec.prompt_tokens
            + spec.output_tokens.next_power_of_two())
        .min(max_model_len)
        .max(spec.final_len()),
        AllocatorKind::ContiguousOracle | AllocatorKind::Paged => spec.final_len(),
    }
}

pub(crate) struct ContiguousMemory {
    kind: AllocatorKind,
    max_model_len: usize,
    block_size: usize,
    slots: Box<dyn ExtentAllocator>,
}

impl ContiguousMemory {
    pub fn new(config: &SimConfig) -> Self {
        let slots: Box<dyn ExtentAllocator> = match config.placement {
            Placement::FirstFit => Box::new(FirstFitAllocator::new(config.num_slots)),
            Placement::Buddy => Box::new(BuddyAllocator::new(config.num_slots)),
        };
        ContiguousMemory {
            kind: config.allocator,
            max_model_len: config.max_model_len,
            block_size: config.block_size,
            slots,
        }
    }

    /// Placed extent length of one sequence of `spec`.
    pub fn extent_len(&self, spec: &RequestSpec) -> usize {
        self.slots
            .extent_len_for(reservation_len(self.kind, spec, self.max_model_len))
    }

    /// Whether an empty pool could hold the whole group at once (else the request can never run).
    pub fn fits_empty_pool(config: &SimConfig, spec: &RequestSpec) -> (bool, usize) {
        let len = reservation_len(config.allocator, spec, config.max_model_len);
        match config.placement {
            Placement::FirstFit => (len * spec.group_size <= config.num_slots, len),
            Placement::Buddy => {
                let buddy = BuddyAllocator::new(config.num_slots);
                let extent = buddy.extent_len_for(len);
                (buddy.capacity_for(extent) >= spec.group_size, extent)
            }
        }
    }
}

impl KvMemory for ContiguousMemory {
    fn try_admit(
        &mut self,
        group: &mut Group,
        next_seq_id: &mut SeqId,
        _alone: bool,
    ) -> Result<Option<Admission>> {
        let n = group.spec.group_size;
        let reserve = reservation_len(self.kind, &group.spec, self.max_model_len);
        if !self.slots.can_place(self.slots.extent_len_for(reserve), n) {
            return Ok(None);
        }
        group.extents.clear();
        group.members.clear();
        for _ in 0..n {
            let extent = self.slots.allocate(reserve).ok_or_else(|| {
                Error::InvariantViolation(
                    "contiguous placement failed after can_place said it fits".into(),
                )
            })?;
            group.extents.push(extent);
            group.members.push(*next_seq_id);
            *next_seq_id += 1;
        }
        // Without sharing every sequence computes its own copy of the prompt.
        Ok(Some(Admission {
            query_tokens: 0,
            hit_tokens: 0,
            prefill_tokens: n * group.num_tokens(),
        }))
    }

    fn append_one(&mut self, _groups: &[Group]) -> Result<Option<usize>> {
        // Reservations cover the final length: growing never needs memory.
        Ok(None)
    }

    fn beam_step(
        &mut self,
        _group: &mut Group,
        _rng: &mut SplitMix64,
        _next_seq_id: &mut SeqId,
    ) -> Result<()> {
        // A beam that replaces another copies its parent's cache into its own reservation: the
        // reservations themselves do not change.
        Ok(())
    }

    fn release(&mut self, group: &mut Group) -> Result<()> {
        for extent in group.extents.drain(..) {
            self.slots.release(extent.start).ok_or_else(|| {
                Error::InvariantViolation(format!(
                    "released reservation at slot {} was not allocated",
                    extent.start
                ))
            })?;
        }
        group.members.clear();
        Ok(())
    }

    fn swap_out(&mut self, _group: &mut Group) -> Result<Option<usize>> {
        Ok(None)
    }

    fn try_swap_in(&mut self, _group: &mut Group, _alone: bool) -> Result<Option<usize>> {
        Err(Error::InvariantViolation(
            "contiguous reservations are never swapped out".into(),
        ))
    }

    fn sample(&mut self, running: &[Group], head: Option<&Group>) -> Result<SlotShares> {
        let mut shares = SlotShares::default();
        for group in running {
            let tokens = group.num_tokens();
            let final_len = group.final_len();
            for extent in &group.extents {
                shares.token_slots += tokens;
                shares.reserved_slots += final_len - tokens;
                shares.internal_slots += extent.len - final_len;
            }
        }
        let free = self.slots.free_slots();
        shares.external_slots = head.map_or(0, |h| {
            self.slots
                .free_slots_in_extents_shorter_than(self.extent_len(&h.spec))
        });
        shares.free_slots = free - shares.external_slots;
        debug_assert_eq!(shares.total(), self.slots.num_slots());
        Ok(shares)
    }

    fn finished_figures(&mut self, group: &Group) -> Result<FinishedFigures> {
        let final_len = group.final_len();
        let waste: usize = group.extents.iter().map(|e| e.len - final_len).sum();
        Ok(FinishedFigures {
            waste_slots: waste as f64,
            block_table_len: 0,
        })
    }

    fn used_blocks(&self) -> usize {
        // Cells of block_size slots touched by a reservation; approximated by allocated slots
        // rounded up (exact cells are computed in frame_pool).
        (self.slots.num_slots() - self.slots.free_slots()).div_ceil(self.block_size)
    }

    fn check_invariants(&mut self) -> Result<()> {
        self.slots
            .check_invariants()
            .map_err(Error::InvariantViolation)
    }

    fn frame_pool(&mut self, running: &[Group]) -> Result<FramePool> {
        let num_slots = self.slots.num_slots();
        let bs = self.block_size;
        let num_cells = num_slots.div_ceil(bs);
        // Per cell: slots per owner are few, so keep (owner, slots) pairs.
        let mut owners: Vec<Vec<(i64, usize)>> = vec![Vec::new(); num_cells];
        let mut cells = vec![
            FrameCell {
                owner: -1,
                tokens: 0,
                reserved: 0
            };
            num_cells
        ];
        let mut tables = Vec::with_capacity(running.len());
        for group in running {
            let tokens = group.num_tokens();
            let mut seqs = Vec::with_capacity(group.extents.len());
            for extent in &group.extents {
                let Extent { start, len } = *extent;
                let filled_end = start + tokens.min(len);
                let first_cell = start / bs;
                let last_cell = (start + len - 1) / bs;
                for (cell_idx, cell) in cells
                    .iter_mut()
                    .enumerate()
                    .take(last_cell + 1)
                    .skip(first_cell)
                {
                    let lo = (cell_idx * bs).max(start);
                    let hi = ((cell_idx + 1) * bs).min(start + len);
                    let filled = filled_end.clamp(lo, hi) - lo;
                    cell.tokens += filled;
                    cell.reserved += (hi - lo) - filled;
                    owners[cell_idx].push((group.request as i64, hi - lo));
                }
                seqs.push(FrameSequence {
                    blocks: (first_cell as u32..=last_cell as u32).collect(),
                    num_tokens: tokens,
                });
            }
            tables.push((group.request, seqs));
        }
        for (cell, cell_owners) in cells.iter_mut().zip(&owners) {
            // The owner holding most of the cell; the lowest address wins ties (first pushed
            // in address order within a group, groups in admission order).
            if let Some(&(owner, _)) = cell_owners
                .iter()
                .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
            {
                cell.owner = owner;
            }
        }
        Ok(FramePool {
            cells,
            tables,
            shared: Vec::new(),
        })
    }
}
