"""Gemma 3 hyperparameters as read from a GGUF file's ``gemma3.*`` metadata."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Gemma3Config"]


@dataclass(frozen=True)
class Gemma3Config:
    """The shapes and constants a Gemma 3 forward pass needs (names follow the GGUF keys).

    The field names the engine reads (num_layers, num_kv_heads, head_dim, vocab_size,
    max_model_len) are those of ``LlamaConfig``.
    """

    num_layers: int  # gemma3.block_count
    d_model: int  # gemma3.embedding_length
    d_ffn: int  # gemma3.feed_forward_length
    num_q_heads: int  # gemma3.attention.head_count
    num_kv_heads: int  # gemma3.attention.head_count_kv
    head_dim: int  # gemma3.attention.key_length (== value_length; 256, not d_model / heads)
    vocab_size: int
    max_model_len: int  # gemma3.context_length
    rope_base_global: float  # gemma3.rope.freq_base (the full-attention layers)
    rope_base_local: float  # 10,000 for the sliding-window layers (not in the file; llama.cpp's value)
    rope_scale_global: float  # 1 / gemma3.rope.scaling.factor for linear scaling (global layers only)
    sliding_window: int  # gemma3.attention.sliding_window (keys a local-layer query sees, itself included)
    sliding_window_pattern: int  # every pattern-th layer is global: layer i is local iff (i + 1) % pattern
    rms_eps: float  # gemma3.attention.layer_norm_rms_epsilon
    attention_scale: float  # query_pre_attn_scalar ** -0.5 (= head_dim ** -0.5 but for 27B)

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding-window layer (five local to one global for Gemma 3)."""
        return (layer + 1) % self.sliding_window_pattern != 0

    def window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: full causal attention)."""
        return self.sliding_window if self.is_local(layer) else None

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """K and V of one token over all layers in fp32: what the all-full layout holds per token
        (``hybrid_kv=False``); under hybrid KV groups the local layers keep only their window
        (the engine sizes its caches by ``KvLayout.bytes_per_block``)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
