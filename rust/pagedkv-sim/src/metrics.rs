//! Slot accounting and the result of a run. Definitions: docs/metrics.md.

use crate::config::Scheduling;

/// Every slot of the pool at one step, in exactly one of five states (the fields sum to the
/// pool's `num_slots`).
///
/// ```
/// use pagedkv_sim::SlotShares;
/// let s = SlotShares { token_slots: 50, reserved_slots: 10, internal_slots: 5, external_slots: 3, free_slots: 32 };
/// assert_eq!(s.total(), 100);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotShares {
    /// Slots holding a token of a running sequence (each physical slot once, however many
    /// sequences share it).
    pub token_slots: usize,
    /// Allocated, empty, and going to be filled by its owner before it finishes.
    pub reserved_slots: usize,
    /// Allocated, empty, and never going to be filled (over-reservation, rounding, the unused
    /// tail of a last block).
    pub internal_slots: usize,
    /// Free but unusable: contiguous free runs too short for the next waiting request; paged:
    /// the pool's remainder slots that make no whole block.
    pub external_slots: usize,
    /// Free and usable.
    pub free_slots: usize,
}

impl SlotShares {
    /// Sum of the five states (the pool size).
    pub fn total(&self) -> usize {
        self.token_slots
            + self.reserved_slots
            + self.internal_slots
            + self.external_slots
            + self.free_slots
    }

    /// Allocated slots (token + reserved + internal).
    pub fn allocated(&self) -> usize {
        self.token_slots + self.reserved_slots + self.internal_slots
    }
}

/// Classifies the slots of logical block `index` (positions `[index*bs, (index+1)*bs)`) of a
/// sequence holding `num_tokens` now and `final_len` when finished: (filled, reserved, internal).
pub(crate) fn classify_block(
    index: usize,
    block_size: usize,
    num_tokens: usize,
    final_len: usize,
) -> (usize, usize, usize) {
    let begin = index * block_size;
    let filled = num_tokens.saturating_sub(begin).min(block_size);
    let will_fill = final_len.saturating_sub(begin).min(block_size);
    (
        filled,
        will_fill.saturating_sub(filled),
        block_size - will_fill.max(filled),
    )
}

/// The outcome of a simulation run. Shares are time averages over steps and sum to 1.
///
/// ```
/// use pagedkv_sim::{simulate, GroupKind, SimConfig, Workload};
/// let w = Workload::from_arrays(&[30, 50], &[10, 20], &[0.0, 0.0], None, GroupKind::None, None, None)?;
/// let r = simulate(&w, &SimConfig { num_slots: 256, ..Default::default() })?;
/// assert_eq!(r.finished_requests, 2);
/// assert_eq!(r.generated_tokens, 30);
/// let sum = r.token_states + r.reserved + r.internal_fragmentation + r.external_fragmentation + r.free;
/// assert!((sum - 1.0).abs() < 1e-9);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimResult {
    /// Pool size in token slots (the denominator of every share).
    pub num_slots: usize,
    /// Engine steps run (idle gaps between arrivals are skipped, not stepped).
    pub steps: usize,
    /// Simulated clock at the end: steps * step_time_s plus idle gaps.
    pub simulated_seconds: f64,
    /// Time-averaged share of slots holding tokens.
    pub token_states: f64,
    /// ... reserved for tokens still to come.
    pub reserved: f64,
    /// ... allocated but never to be filled.
    pub internal_fragmentation: f64,
    /// ... free but unusable for the next waiting request.
    pub external_fragmentation: f64,
    /// ... free and usable.
    pub free: f64,
    /// Steps at whose accounting a request was waiting (memory or the batch cap was the limit).
    pub queued_steps: usize,
    /// The five shares averaged over the queued steps only, in the order token states,
    /// reserved, internal fragmentation, external fragmentation, free (all 0 if none).
    pub shares_while_queued: [f64; 5],
    /// Mean over steps of requests (groups) holding memory.
    pub mean_resident_requests: f64,
    /// Most requests holding memory at one step.
    pub peak_resident_requests: usize,
    /// Mean over steps of sequences running.
    pub mean_running_sequences: f64,
    /// Mean over steps of blocks (paged) or block-size cells (contiguous) in use.
    pub mean_used_blocks: f64,
    /// Preemptions of either kind.
    pub preemptions: usize,
    /// Preemptions that freed the group's blocks for recomputation.
    pub recompute_preemptions: usize,
    /// Preemptions that swapped the group to the host tier.
    pub swap_preemptions: usize,
    /// Requests that generated all their tokens.
    pub finished_requests: usize,
    /// Tokens generated (one per running sequence per step).
    pub generated_tokens: usize,
    /// Tokens whose KV was computed at admission (prompts, recomputed context; minus cache hits).
    pub prefill_tokens: usize,
    /// Of `prefill_tokens`, those recomputed after a recompute preemption.
    pub recomputed_tokens: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_query_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: usize,
    /// Blocks copied device -> host by swap-outs.
    pub swapped_out_blocks: usize,
    /// Blocks copied host -> device by swap-ins.
    pub swapped_in_blocks: usize,
    /// Workload index of each finished request, in finishing order.
    pub finished_request_ids: Vec<usize>,
    /// Allocated-but-empty slots of each finished request just before release (same order).
    pub waste_per_request_tokens: Vec<f64>,
    /// Block-table length of each finished request's first sequence (0 for contiguous).
    pub block_table_len: Vec<usize>,
    /// Seconds from arrival to finish of each finished request (same order).
    pub latency_s: Vec<f64>,
    /// Seconds from arrival to first admission of each finished request (same order).
    pub wait_s: Vec<f64>,
    /// Prompt tokens of the requests admitted, each counted at its first admission (a
    /// recomputation after preemption queries the cache again but is not counted here).
    pub prompt_tokens: usize,
    /// Of those, tokens the prefix cache served at the first admission.
    pub prompt_hit_tokens: usize,
    /// Prompt tokens of the whole workload (0 without prefix caching).
    pub optimal_prompt_tokens: usize,
    /// The most of them any admission order serves from the prefix cache ([`crate::optimal_hits`];
    /// 0 without prefix caching).
    pub optimal_hit_tokens: usize,
    /// The admission order of the run.
    pub scheduling: Scheduling,
    /// The aging bound of the run (`SimConfig::aging_bound`; it binds only `Lpm` and `Dfs`).
    pub aging_bound: usize,
    /// Most admissions that passed over one waiting request (`Lpm`, `Dfs`; at most `aging_bound`).
    pub max_passed_over: usize,
    /// Admissions of the oldest request because it had reached the aging bound.
    pub forced_admissions: usize,
    /// Blocks evicted while a waiting request would have hit them (`Lpm`, `Dfs`).
    pub evicted_wanted_blocks: usize,
}

impl SimResult {
    /// Share of the admitted requests' prompt tokens served from the prefix cache at their
    /// first admission.
    pub fn token_hit_rate(&self) -> f64 {
        ratio(self.prompt_hit_tokens, self.prompt_tokens)
    }

    /// The offline optimum's share of the workload's prompt tokens ([`crate::optimal_hits`]).
    pub fn optimal_token_hit_rate(&self) -> f64 {
        ratio(self.optimal_hit_tokens, self.optimal_prompt_tokens)
    }

    /// [`Self::token_hit_rate`] over [`Self::optimal_token_hit_rate`] (1 when the optimum is 0).
    pub fn hit_rate_of_optimum(&self) -> f64 {
        let best = self.optimal_token_hit_rate();
        if best == 0.0 {
            1.0
        } else {
            self.token_hit_rate() / best
        }
    }

    /// Generated tokens per step.
    pub fn generated_tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.generated_tokens as f64 / self.steps as f64
        }
    }
}

fn ratio(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Running sums from which the averages are formed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Accumulator {
    pub queued_steps: usize,
    /// Slot sums of the five states over queued steps.
    pub queued_slots: [u128; 5],
    pub token_slots: u128,
    pub reserved_slots: u128,
    pub internal_slots: u128,
    pub external_slots: u128,
    pub free_slots: u128,
    pub resident_requests: u128,
    pub running_sequences: u128,
    pub used_blocks: u128,
}

impl Accumulator {
    pub fn add(
        &mut self,
        shares: &SlotShares,
        queued: bool,
        resident_requests: usize,
        running_sequences: usize,
        used_blocks: usize,
    ) {
        if queued {
            self.queued_steps += 1;
            let states = [
                shares.token_slots,
                shares.reserved_slots,
                shares.internal_slots,
                shares.external_slots,
                shares.free_slots,
            ];
            for (sum, x) in self.queued_slots.iter_mut().zip(states) {
                *sum += x as u128;
            }
        }
        self.token_slots += shares.token_slots as u128;
        self.reserved_slots += shares.reserved_slots as u128;
        self.internal_slots += shares.internal_slots as u128;
        self.external_slots += shares.external_slots as u128;
        self.free_slots += shares.free_slots as u128;
        self.resident_requests += resident_requests as u128;
        self.running_sequences += running_sequences as u128;
        self.used_blocks += used_blocks as u128;
    }

    /// Writes the averages into `result` (which has `steps` and `num_slots` set).
    pub fn finish(&self, result: &mut SimResult) {
        if result.steps == 0 {
            result.free = 1.0;
            return;
        }
        let slot_steps = result.steps as f64 * result.num_slots as f64;
        let share = |x: u128| x as f64 / slot_steps;
        result.token_states = share(self.token_slots);
        result.reserved = share(self.reserved_slots);
        result.internal_fragmentation = share(self.internal_slots);
        result.external_fragmentation = share(self.external_slots);
        result.free = share(self.free_slots);
        result.queued_steps = self.queued_steps;
        if self.queued_steps > 0 {
            let queued_slot_steps = self.queued_steps as f64 * result.num_slots as f64;
            for (out, &sum) in result
                .shares_while_queued
                .iter_mut()
                .zip(&self.queued_slots)
            {
                *out = sum as f64 / queued_slot_steps;
            }
        }
        let per_step = |x: u128| x as f64 / result.steps as f64;
        result.mean_resident_requests = per_step(self.resident_requests);
        result.mean_running_sequences = per_step(self.running_sequences);
        result.mean_used_blocks = per_step(self.used_blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_block_splits_every_slot_once() {
        // Block 2 of 4 slots = positions 8..12; sequence at 9 tokens, finishing at 11.
        assert_eq!(classify_block(2, 4, 9, 11), (1, 2, 1));
        // Full block.
        assert_eq!(classify_block(0, 4, 9, 11), (4, 0, 0));
        // Finished exactly at the block end.
        assert_eq!(classify_block(1, 4, 6, 8), (2, 2, 0));
        // Block beyond the final length: all internal (a reservation that is never used).
        assert_eq!(classify_block(5, 4, 9, 11), (0, 0, 4));
        for idx in 0..6 {
            let (f, r, i) = classify_block(idx, 4, 9, 11);
            assert_eq!(f + r + i, 4);
        }
    }
}
