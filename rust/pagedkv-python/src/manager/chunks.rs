//! The per-chunk calls of `pagedkv.KvCacheManager` (docs/design.md, Per-chunk allocation):
//! `allocate_slots`, `provide_token_ids`, `take_new_block_ids`, `num_slots`, `null_block`.
//! Argument conversion and error mapping only, as in `manager.rs`.

use numpy::PyArray1;
use pyo3::prelude::*;

use pagedkv::{PrefillCheckpoint, SlotOptions, NULL_BLOCK};

use crate::block_keys::BlockKeyArgs;
use crate::manager::{PyKvCacheManager, DETACH_MIN_PROMPT_TOKENS};
use crate::scalars::{CountArg, SeqIdArg};

/// (uint64 seq_ids, int32 groups, int32 positions, int32 block_ids, bool fresh), each `[N]`.
type NewBlockArrays<'py> = (
    Bound<'py, PyArray1<u64>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<bool>>,
);

#[pymethods]
impl PyKvCacheManager {
    /// vLLM's per-chunk `allocate_slots`: slots for the `num_new_tokens` tokens scheduled now
    /// plus `num_lookahead_tokens` speculative ones; the window release at `num_computed -
    /// num_in_flight_tokens` first. `num_computed_tokens` is the caller's watermark (lower
    /// than the manager's rolls rejected drafts back). Returns False (nothing else changed)
    /// when blocks are short: vLLM's signal to preempt.
    /// `prefill_checkpoint=(prefill_end, alignment)`: vLLM's prefill check-point blocks in
    /// `MambaState` groups (as at `add_sequence`).
    #[pyo3(signature = (
        seq_id, num_new_tokens, *, num_lookahead_tokens=CountArg(0),
        num_in_flight_tokens=CountArg(0), num_computed_tokens=None, prefill_checkpoint=None
    ))]
    #[pyo3(
        text_signature = "(self, seq_id, num_new_tokens, *, num_lookahead_tokens=0, \
        num_in_flight_tokens=0, num_computed_tokens=None, prefill_checkpoint=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn allocate_slots(
        &self,
        py: Python<'_>,
        seq_id: SeqIdArg,
        num_new_tokens: CountArg,
        num_lookahead_tokens: CountArg,
        num_in_flight_tokens: CountArg,
        num_computed_tokens: Option<CountArg>,
        prefill_checkpoint: Option<(CountArg, CountArg)>,
    ) -> PyResult<bool> {
        let options = SlotOptions {
            num_lookahead_tokens: num_lookahead_tokens.0,
            num_in_flight_tokens: num_in_flight_tokens.0,
            num_computed_tokens: num_computed_tokens.map(|n| n.0),
            prefill_checkpoint: prefill_checkpoint.map(|(end, alignment)| PrefillCheckpoint {
                prefill_end: end.0,
                alignment: alignment.0,
            }),
        };
        self.run(py, false, |kv| {
            kv.allocate_slots_with(seq_id.0, num_new_tokens.0, &options)
        })
    }

    /// Records the ids of the tokens after the known ones (slots allocated before their ids
    /// were sampled), with the caller's `block_extra_keys` / `block_hashes` continuing those
    /// it gave; blocks then full, computed and known enter the prefix index now.
    /// `num_computed_tokens` (the scheduler's watermark after rejected drafts) rolls the
    /// watermark back first, as at `allocate_slots`.
    #[pyo3(signature = (seq_id, token_ids, *, num_computed_tokens=None, block_extra_keys=None, block_hashes=None))]
    fn provide_token_ids(
        &self,
        py: Python<'_>,
        seq_id: SeqIdArg,
        token_ids: Bound<'_, PyAny>,
        num_computed_tokens: Option<CountArg>,
        block_extra_keys: Option<Bound<'_, PyAny>>,
        block_hashes: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let token_ids = self.token_ids(&token_ids)?;
        let ids = token_ids.as_slice()?;
        let keys = BlockKeyArgs::extract(
            py,
            block_extra_keys.as_ref(),
            block_hashes.as_ref(),
            self.num_blocks(),
        )?;
        let extra_keys = keys.extra_keys();
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        self.run(py, heavy, |kv| {
            kv.provide_token_ids(
                seq_id.0,
                ids,
                num_computed_tokens.map(|n| n.0),
                extra_keys.as_deref(),
                keys.hashes.as_deref(),
            )
        })
    }

    /// Drains the table entries placed since the last call (`record_new_block_ids=True`), in
    /// the order placed: (uint64 seq_ids, int32 groups, int32 positions, int32 block_ids,
    /// bool fresh), each `[N]`. A released position's block id is `null_block`; `block_ids[fresh]`
    /// are the newly allocated blocks (vLLM's list to zero). Empty when the log is off.
    fn take_new_block_ids<'py>(&self, py: Python<'py>) -> PyResult<NewBlockArrays<'py>> {
        let (new, null) = self.read(py, |kv| (kv.take_new_block_ids(), kv.null_entry()))?;
        let blocks: Vec<i32> = new
            .block_ids
            .iter()
            .map(|&b| if b == NULL_BLOCK { null } else { b as i32 })
            .collect();
        let groups: Vec<i32> = new.groups.iter().map(|&g| g as i32).collect();
        let positions: Vec<i32> = new.positions.iter().map(|&p| p as i32).collect();
        Ok((
            PyArray1::from_vec(py, new.seq_ids),
            PyArray1::from_vec(py, groups),
            PyArray1::from_vec(py, positions),
            PyArray1::from_vec(py, blocks),
            PyArray1::from_vec(py, new.fresh),
        ))
    }

    /// The sequence's capacity in token slots (its table length times the block size).
    fn num_slots(&self, py: Python<'_>, seq_id: SeqIdArg) -> PyResult<usize> {
        self.run(py, false, |kv| kv.num_slots(seq_id.0))
    }

    /// What tables, CSR page tables and slot mappings show at a released position: -1, or 0
    /// when block 0 is reserved as vLLM's null block (`null_block=0`).
    #[getter]
    fn null_block(&self, py: Python<'_>) -> PyResult<i32> {
        self.read(py, |kv| kv.null_entry())
    }
}
