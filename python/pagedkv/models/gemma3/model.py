"""The Gemma 3 forward pass in NumPy fp32, with attention delegated to a KV store.

Per layer (llama.cpp's ``llm_build_gemma3``, Hugging Face's ``Gemma3DecoderLayer``):

    h = rms_norm(x) -> q, k, v projections -> rms_norm per head on q and k (QK-norm)
      -> RoPE on q and k (rotate-half pairs (x[i], x[i + head_dim/2]), llama.cpp's NEOX mode)
      -> attention (sliding window on local layers) -> output projection -> rms_norm (post-attention)
    x = x + that
    h = rms_norm(x) -> gelu_tanh(h @ W_gate) * (h @ W_up) -> @ W_down -> rms_norm (post-FFN)
    x = x + that

The embedding is scaled by sqrt(d_model) (fp32, as llama.cpp does); the output projection is the
tied embedding. Local (sliding-window) layers rotate with base 10,000, global layers with the
file's ``rope.freq_base``. The norms' weights multiply as stored (the file stores Gemma's 1 + w).

The store is called as ``kv.attend(layer, q, k, v, window=...)``: ``window`` is the layer's
sliding window (None for global layers); queries are pre-scaled so that the store's default scale
``head_dim ** -0.5`` yields the model's attention scale.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pagedkv.models.blas_threads import limit_blas_threads
from pagedkv.models.gemma3.config import Gemma3Config
from pagedkv.models.gemma3.file import Gemma3File
from pagedkv.models.projection import ProjectionBuilder, weight_mode

__all__ = ["Gemma3Model", "WindowedKvAttention", "gelu_tanh", "rms_norm", "rotary_half"]


class WindowedKvAttention(Protocol):
    def attend(
        self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None
    ) -> np.ndarray:
        """Store this layer's k/v [T, num_kv_heads, head_dim] for the batch's tokens and return the
        attention of q [T, num_q_heads, head_dim] over each token's history (itself included),
        restricted to the last ``window`` keys when given."""
        ...


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (fp32)."""
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(variance + np.float32(eps))) * weight


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Gemma's ``gelu_pytorch_tanh``, ggml's ``ggml_gelu``)."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def rotary_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, head_dim] with each pair (x[i], x[i + head_dim/2]) rotated by angle i:
    (a, b) -> (a cos - b sin, a sin + b cos); cos/sin [T, head_dim / 2]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


class Gemma3Model:
    """The weights of a Gemma 3 GGUF model (projections in ``weight_dtype`` precision, see
    ``projection``: the file's block codes by default) and its forward pass."""

    def __init__(self, weights: Gemma3File, weight_dtype: str | None = None) -> None:
        self.config: Gemma3Config = weights.config
        self.weights = weights
        self.weight_dtype = weight_mode(weight_dtype, "weight_dtype")
        c = self.config
        limit_blas_threads()
        proj = ProjectionBuilder(self.weight_dtype, weights.path, weights.block_codes)
        self._wqkv, self._wo, self._w_gate_up, self._w_down = proj.decoder_layers(weights.layers)
        self._output = proj(["token_embd.weight"], weights.token_embedding.T)
        exponents = np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim
        self._inv_freq_local = 1.0 / np.float64(c.rope_base_local) ** exponents
        self._inv_freq_global = c.rope_scale_global / np.float64(c.rope_base_global) ** exponents
        self._embed_scale = np.float32(np.sqrt(np.float32(c.d_model)))
        # The store scales scores by head_dim ** -0.5; fold the model's own scale into q.
        self._q_scale = np.float32(c.attention_scale * np.sqrt(c.head_dim))

    def rope_tables(self, positions: np.ndarray, local: bool) -> tuple[np.ndarray, np.ndarray]:
        inv_freq = self._inv_freq_local if local else self._inv_freq_global
        angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def forward(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        kv: WindowedKvAttention,
        logit_rows: np.ndarray | None = None,
    ) -> np.ndarray:
        """Logits [len(logit_rows), vocab] (every row when None) for a flat batch of tokens.

        token_ids, positions: int [T]; ``kv`` knows which sequence each row belongs to.
        """
        c, w = self.config, self.weights
        token_ids = np.asarray(token_ids, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        t = token_ids.shape[0]
        tables = {local: self.rope_tables(positions, local) for local in (True, False)}
        x = w.token_embedding[token_ids] * self._embed_scale
        for i, layer in enumerate(w.layers):
            cos, sin = tables[c.is_local(i)]
            h = rms_norm(x, layer.attn_norm, c.rms_eps)
            qkv = self._wqkv[i](h)  # [t, q | k | v]: one product
            q_width, kv_width = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
            q = rms_norm(qkv[:, :q_width].reshape(t, c.num_q_heads, c.head_dim), layer.q_norm, c.rms_eps)
            k = rms_norm(
                qkv[:, q_width : q_width + kv_width].reshape(t, c.num_kv_heads, c.head_dim),
                layer.k_norm,
                c.rms_eps,
            )
            v = qkv[:, q_width + kv_width :].reshape(t, c.num_kv_heads, c.head_dim)
            q = rotary_half(q, cos, sin)
            if self._q_scale != 1.0:
                q = q * self._q_scale
            k = rotary_half(k, cos, sin)
            attn = kv.attend(
                i,
                np.ascontiguousarray(q, dtype=np.float32),
                np.ascontiguousarray(k, dtype=np.float32),
                np.ascontiguousarray(v, dtype=np.float32),
                window=c.window(i),
            )
            out = self._wo[i](attn.reshape(t, c.num_q_heads * c.head_dim))
            x = x + rms_norm(out, layer.post_attn_norm, c.rms_eps)
            h = rms_norm(x, layer.ffn_norm, c.rms_eps)
            gate_up = self._w_gate_up[i](h)  # [t, gate | up]: one product
            d_ffn = gate_up.shape[1] // 2
            ffn = self._w_down[i](gelu_tanh(gate_up[:, :d_ffn]) * gate_up[:, d_ffn:])
            x = x + rms_norm(ffn, layer.post_ffn_norm, c.rms_eps)
        rows = x if logit_rows is None else x[np.asarray(logit_rows, dtype=np.int64)]
        return self._output(rms_norm(rows, w.output_norm, c.rms_eps))
