//! What the attention kernels read: block tables (one, padded batch, CSR) and slot mappings.
//! Argument conversion and error mapping only, as in `manager/mod.rs`.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use crate::scalars::{CountArg, SeqIdArg};

use super::{PyKvCacheManager, DETACH_MIN_BATCH};

/// (int32 `[B, max_blocks]` block tables, int32 `[B]` sequence lengths).
pub(crate) type TablesAndLens<'py> = (Bound<'py, PyArray2<i32>>, Bound<'py, PyArray1<i32>>);
/// (kv_indptr, kv_indices, kv_last_page_len), all int32.
type CsrArrays<'py> = (
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
);

#[pymethods]
impl PyKvCacheManager {
    /// int32 `[num_blocks_of_seq]`: logical block i -> physical block id (a fresh array) of
    /// KV-cache group `group`; -1 at a position a sliding-window group released.
    #[pyo3(signature = (seq_id, *, group=CountArg(0)), text_signature = "(self, seq_id, *, group=0)")]
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: SeqIdArg,
        group: CountArg,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let table: Vec<i32> = self.run(py, false, |kv| {
            Ok(kv
                .block_table_group(seq_id.0, group.0)?
                .iter()
                .map(|&b| kv.entry_i32(b))
                .collect())
        })?;
        Ok(PyArray1::from_vec(py, table))
    }

    /// (int32 `[B, max_blocks]` tables padded with -1, int32 `[B]` sequence lengths in tokens).
    #[pyo3(signature = (seq_ids, *, group=CountArg(0)), text_signature = "(self, seq_ids, *, group=0)")]
    fn batch_block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
        group: CountArg,
    ) -> PyResult<TablesAndLens<'py>> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let (tables, max_blocks, seq_lens) =
            self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
                kv.batch_block_tables_group(seqs, group.0)
            })?;
        let tables = PyArray1::from_vec(py, tables).reshape([seqs.len(), max_blocks])?;
        Ok((tables, PyArray1::from_vec(py, seq_lens)))
    }

    /// FlashInfer's CSR page table of `seq_ids`: (int32 `[B + 1]` kv_indptr, int32 `[nnz]`
    /// kv_indices, int32 `[B]` kv_last_page_len).
    #[pyo3(signature = (seq_ids, *, group=CountArg(0)), text_signature = "(self, seq_ids, *, group=0)")]
    fn csr_page_table<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
        group: CountArg,
    ) -> PyResult<CsrArrays<'py>> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let csr = self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
            kv.csr_page_table_group(seqs, group.0)
        })?;
        Ok((
            PyArray1::from_vec(py, csr.kv_indptr),
            PyArray1::from_vec(py, csr.kv_indices),
            PyArray1::from_vec(py, csr.kv_last_page_len),
        ))
    }

    /// int64 `[B * num_new_tokens]`: KV slots (`block_id * block_size + offset`) of each
    /// sequence's last `num_new_tokens` tokens, sequence by sequence.
    #[pyo3(signature = (seq_ids, num_new_tokens, *, group=CountArg(0)), text_signature = "(self, seq_ids, num_new_tokens, *, group=0)")]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Bound<'py, PyAny>,
        num_new_tokens: CountArg,
        group: CountArg,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let seq_ids = self.seq_ids(py, &seq_ids)?;
        let seqs = seq_ids.0.as_slice();
        let slots = self.run(py, seqs.len() >= DETACH_MIN_BATCH, |kv| {
            kv.slot_mapping_group(seqs, num_new_tokens.0, group.0)
        })?;
        Ok(PyArray1::from_vec(py, slots))
    }
}
