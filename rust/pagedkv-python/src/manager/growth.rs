//! Growing and shrinking a running sequence: `append_tokens` (one or a batch), `can_append`,
//! `advance_computed`, `truncate`.
//! Argument conversion and error mapping only, as in `manager/mod.rs`.

use pyo3::prelude::*;

use crate::errors::invalid_argument;
use crate::scalars::{CountArg, SeqIdArg};

use super::{check_token_count, PyKvCacheManager, DETACH_MIN_BATCH, DETACH_MIN_PROMPT_TOKENS};

#[pymethods]
impl PyKvCacheManager {
    /// Grows a sequence by `token_ids` (`[n]`) or by `num_tokens` (default 1) id-less tokens;
    /// copies a shared, partly filled last block first (see `take_copy_ops`).
    #[pyo3(signature = (seq_id, token_ids=None, *, num_tokens=None))]
    fn append_tokens(
        &self,
        py: Python<'_>,
        seq_id: SeqIdArg,
        token_ids: Option<Bound<'_, PyAny>>,
        num_tokens: Option<CountArg>,
    ) -> PyResult<()> {
        match token_ids {
            Some(token_ids) => {
                let token_ids = self.token_ids(&token_ids)?;
                let ids = token_ids.as_slice()?;
                check_token_count(py, ids.len(), num_tokens)?;
                let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
                self.run(py, heavy, |kv| kv.append_tokens(seq_id.0, ids))
            }
            None => {
                let count = num_tokens.map_or(1, |n| n.0);
                self.run(py, false, |kv| kv.append_len(seq_id.0, count))
            }
        }
    }

    /// Whether `num_tokens` more tokens fit now (False when short of blocks, when they could
    /// never fit, or while the sequence is still prefilling; a swapped-out sequence raises
    /// `SequenceSwappedOutError`).
    #[pyo3(signature = (seq_id, num_tokens=CountArg(1)), text_signature = "(self, seq_id, num_tokens=1)")]
    fn can_append(&self, py: Python<'_>, seq_id: SeqIdArg, num_tokens: CountArg) -> PyResult<bool> {
        self.run(py, false, |kv| kv.can_append(seq_id.0, num_tokens.0))
    }

    /// One engine step: appends `num_tokens` tokens to each of `seq_ids` (`[B]`), all or none.
    /// `token_ids`, if given, is `[B * num_tokens]` row-major (sequence 0's tokens first).
    #[pyo3(
        signature = (seq_ids, token_ids=None, *, num_tokens=CountArg(1)),
        text_signature = "(self, seq_ids, token_ids=None, *, num_tokens=1)"
    )]
    fn append_tokens_batch(
        &self,
        py: Python<'_>,
        seq_ids: Bound<'_, PyAny>,
        token_ids: Option<Bound<'_, PyAny>>,
        num_tokens: CountArg,
    ) -> PyResult<()> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let heavy = seqs.len() >= DETACH_MIN_BATCH;
        match token_ids {
            Some(token_ids) => {
                let token_ids = self.token_ids(&token_ids)?;
                let ids = token_ids.as_slice()?;
                let expected = seqs.len().checked_mul(num_tokens.0);
                if expected != Some(ids.len()) {
                    return Err(invalid_argument(
                        py,
                        format!(
                            "token_ids has {} ids, expected len(seq_ids) * num_tokens = {} * {}",
                            ids.len(),
                            seqs.len(),
                            num_tokens.0
                        ),
                    ));
                }
                self.run(py, heavy, |kv| {
                    kv.append_tokens_batch(seqs, ids, num_tokens.0)
                })
            }
            None => self.run(py, heavy, |kv| kv.append_len_batch(seqs, num_tokens.0)),
        }
    }

    /// Schedules the next `num_tokens` tokens of each of `seq_ids` (`[B]`): their blocks
    /// enter the prefix index once wholly computed. All or none.
    fn advance_computed(
        &self,
        py: Python<'_>,
        seq_ids: Bound<'_, PyAny>,
        num_tokens: CountArg,
    ) -> PyResult<()> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
            kv.advance_computed(seqs, num_tokens.0)
        })
    }

    /// Keeps the first `num_tokens` tokens of the sequence (rollback of rejected drafts).
    fn truncate(&self, py: Python<'_>, seq_id: SeqIdArg, num_tokens: CountArg) -> PyResult<()> {
        self.run(py, false, |kv| kv.truncate(seq_id.0, num_tokens.0))
    }
}
