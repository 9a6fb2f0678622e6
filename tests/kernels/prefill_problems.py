"""Builders for paged prefill problems: random non-contiguous caches with NaN-poisoned unused slots,
queries for each sequence's last q_len positions, both table layouts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .conftest import PagedProblem, make_problem, to_kind


@dataclass
class PrefillProblem:
    paged: PagedProblem  # caches, padded tables, whole-context keys/values per sequence
    q: np.ndarray  # [total_q, num_q_heads, head_dim]
    query_start_loc: np.ndarray  # int32 [B + 1]
    q_lens: list[int]

    @property
    def seq_lens(self) -> np.ndarray:
        return self.paged.seq_lens

    def csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The padded tables in FlashInfer's CSR layout (unused padding dropped)."""
        bs = self.paged.k_cache.shape[1]
        lens = [int(n) for n in self.paged.seq_lens]
        pages = [-(-n // bs) for n in lens]
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = np.concatenate(
            [self.paged.block_tables[b, : pages[b]] for b in range(len(lens))] + [np.zeros(0, np.int32)]
        ).astype(np.int32)
        last = np.array([0 if n == 0 else (n - 1) % bs + 1 for n in lens], np.int32)
        return indptr, indices, last

    def args(self, layout: str = "padded") -> tuple:
        tables = self.paged.block_tables if layout == "padded" else self.csr()
        return (
            self.q,
            self.paged.k_cache,
            self.paged.v_cache,
            tables,
            self.paged.seq_lens,
            self.query_start_loc,
        )


def make_prefill_problem(
    rng: np.random.Generator,
    kind: str,
    cached_lens: list[int],
    q_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
) -> PrefillProblem:
    """Sequence i holds cached_lens[i] + q_lens[i] tokens (all written), its last q_lens[i] are the
    new tokens whose queries are given."""
    seq_lens = [c + n for c, n in zip(cached_lens, q_lens, strict=True)]
    paged = make_problem(rng, kind, seq_lens, num_kv_heads, group, head_dim, block_size)
    total_q = sum(q_lens)
    q = to_kind(rng.standard_normal((total_q, num_kv_heads * group, head_dim)), kind)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PrefillProblem(paged, q, qsl, list(q_lens))
