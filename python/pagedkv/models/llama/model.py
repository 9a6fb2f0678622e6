"""The llama forward pass in NumPy fp32, with attention delegated to a KV store.

The model computes everything that is per token (embedding, norms, projections, rotary embedding,
MLP, logits) on a flat batch of tokens from any number of sequences; the ``KvAttention`` it is given
stores each layer's new keys/values and attends each query over its sequence's history. The paged
engine passes its paged caches; tests pass a contiguous per-sequence buffer, and both see the same
per-token arithmetic for the same batch.

Rotary embedding: llama.cpp's converter permutes the Q/K projection rows of llama checkpoints so
that a GGUF file rotates **adjacent pairs** (x[2i], x[2i+1]) by angle pos * base^(-2i/head_dim)
(ggml's "normal" rope mode), not the rotate-half pairs (x[i], x[i + head_dim/2]) of the original
checkpoint.

Weights are laid out for the BLAS call they feed: each projection stays row-major ``[out, in]``
(seen as its ``[in, out]`` transpose, so ``h @ w`` is one sgemm/sgemv reading whole rows), and the
three attention projections and the two MLP input projections are fused into one matrix each
(``[q | k | v]`` and ``[gate | up]``): one BLAS call per group instead of three and two, which at
decode batch sizes is what bounds the step (docs/cpu_data_plane.md).

Weight precision (``weights=``, else ``PAGEDKV_WEIGHTS``, else ``int8``): see ``projection``
(by default the file's block codes times activations quantized to 8 bits per block, in integer
dot products; ``quantized`` keeps the exact weights in fp32 arithmetic; ``fp32`` for NumPy's
BLAS, the reference; ``bf16``). Norms, rotary embedding, the embedding lookup and all
activations outside the projections are fp32 in every mode.

Elementwise work: in the ``int8`` and ``quantized`` modes the norms (each fused with the residual add before
it), the rotary embedding and the SiLU gate run as fused Rust ops (``_core.cpu_rms_norm``,
``cpu_add_rms_norm``, ``cpu_rope_interleaved``, ``cpu_silu_mul``: one pass per op instead of ~40
NumPy calls and their temporaries per layer); rope is bit-identical to ``rotary_interleaved``, the
norms and SiLU agree with the NumPy functions here within a few ulp (docs/cpu_data_plane.md). The
other modes keep the NumPy functions below, the reference.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedkv import _core
from pagedkv.models.blas_threads import limit_blas_threads
from pagedkv.models.llama.config import LlamaConfig
from pagedkv.models.llama.file import GgufModel
from pagedkv.models.projection import WEIGHT_DTYPES, ProjectionBuilder, default_weight_dtype, weight_mode

__all__ = [
    "WEIGHT_DTYPES",
    "KvAttention",
    "LlamaModel",
    "default_weight_dtype",
    "rms_norm",
    "rotary_interleaved",
]


class KvAttention(Protocol):
    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Store this layer's k/v [T, num_kv_heads, head_dim] for the batch's tokens and return the
        attention of q [T, num_q_heads, head_dim] over each token's history (itself included)."""
        ...


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(variance + np.float32(eps))) * weight


def rotary_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, head_dim] rotated pairwise: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) for
    each adjacent pair; cos/sin [T, head_dim / 2]."""
    t, h, d = x.shape
    pairs = x.reshape(t, h, d // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(pairs)
    out[..., 0] = x0 * c - x1 * s
    out[..., 1] = x0 * s + x1 * c
    return out.reshape(t, h, d)


class LlamaModel:
    """The weights of a llama GGUF model (projections in ``weights`` precision) and its forward
    pass."""

    def __init__(self, gguf: GgufModel, weights: str | None = None) -> None:
        self.config: LlamaConfig = gguf.config
        self.weights = gguf
        self.weight_dtype = weight_mode(weights, "weights")
        c = self.config
        limit_blas_threads()
        proj = ProjectionBuilder(self.weight_dtype, gguf.path, gguf.block_codes)
        self._wqkv, self._wo, self._w_gate_up, self._w_down = proj.decoder_layers(gguf.layers)
        output = "token_embd.weight" if self.config.tied_embeddings else "output.weight"
        self._output = proj([output], gguf.output)
        self._inv_freq = (
            1.0 / (np.float64(c.rope_base) ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim))
        ).astype(np.float64)

    def rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        angles = positions.astype(np.float64)[:, None] * self._inv_freq[None, :]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def forward(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        kv: KvAttention,
        logit_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Logits [len(logit_rows), vocab] (every row when None) for a flat batch of tokens.

        token_ids, positions: int [T]; ``kv`` knows which sequence each row belongs to.
        """
        if self.weight_dtype in ("quantized", "int8"):
            return self._forward_fused(token_ids, positions, kv, logit_rows)
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        t = token_ids.shape[0]
        cos, sin = self.rope_tables(np.asarray(positions, dtype=np.int64))
        x = w.token_embedding[token_ids]
        q_width = c.num_q_heads * c.head_dim
        kv_width = c.num_kv_heads * c.head_dim
        d_ffn = self._w_gate_up[0].out_features // 2 if self._w_gate_up else 0
        for i, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_eps)
            qkv = self._wqkv[i](h)  # [t, q | k | v]: one product
            q = rotary_interleaved(qkv[:, :q_width].reshape(t, c.num_q_heads, c.head_dim), cos, sin)
            k = rotary_interleaved(
                qkv[:, q_width : q_width + kv_width].reshape(t, c.num_kv_heads, c.head_dim), cos, sin
            )
            v = qkv[:, q_width + kv_width :].reshape(t, c.num_kv_heads, c.head_dim)
            attn = kv.attend(i, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v))
            x = x + self._wo[i](attn.reshape(t, q_width))
            h = rms_norm(x, layer.ffn_norm, c.rms_eps)
            gate_up = self._w_gate_up[i](h)  # [t, gate | up]: one product
            gate, up = gate_up[:, :d_ffn], gate_up[:, d_ffn:]
            x = x + self._w_down[i]((gate / (1.0 + np.exp(-gate))) * up)
        rows = x if logit_rows is None else x[np.asarray(logit_rows, dtype=np.int64)]
        return self._output(rms_norm(rows, w.output_norm, c.rms_eps))

    def _forward_fused(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        kv: KvAttention,
        logit_rows: np.ndarray | None,
    ) -> np.ndarray:
        """``forward`` with the elementwise work in fused Rust ops: each residual add is done
        together with the norm that follows it (the last one with the output norm, on the logit
        rows only), and q and k are rotated straight out of the fused q|k|v product into
        contiguous arrays."""
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        t = token_ids.shape[0]
        cos, sin = self.rope_tables(np.asarray(positions, dtype=np.int64))
        x = np.ascontiguousarray(w.token_embedding[token_ids], dtype=np.float32)
        nq, nkv, hd, eps = c.num_q_heads, c.num_kv_heads, c.head_dim, c.rms_eps
        delta: np.ndarray | None = None  # the residual update not yet added to x
        for i, layer in enumerate(w.layers):
            if delta is None:
                h = _core.cpu_rms_norm(x, layer.attn_norm, eps)
            else:
                x, h = _core.cpu_add_rms_norm(x, delta, layer.attn_norm, eps)
            qkv = self._wqkv[i](h).reshape(t, nq + 2 * nkv, hd)  # [t, q | k | v heads]
            q = _core.cpu_rope_interleaved(qkv, cos, sin, 0, nq)
            k = _core.cpu_rope_interleaved(qkv, cos, sin, nq, nkv)
            attn = kv.attend(i, q, k, np.ascontiguousarray(qkv[:, nq + nkv :]))
            x, h = _core.cpu_add_rms_norm(x, self._wo[i](attn.reshape(t, nq * hd)), layer.ffn_norm, eps)
            delta = self._w_down[i](_core.cpu_silu_mul(self._w_gate_up[i](h)))
        if logit_rows is not None:
            rows = np.asarray(logit_rows, dtype=np.int64)
            x = x[rows]
            delta = None if delta is None else delta[rows]
        if delta is None:
            h = _core.cpu_rms_norm(x, w.output_norm, eps)
        else:
            _, h = _core.cpu_add_rms_norm(x, delta, w.output_norm, eps)
        return self._output(h)
