"""Llama hyperparameters as read from a GGUF file's metadata."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LlamaConfig"]


@dataclass(frozen=True)
class LlamaConfig:
    """The shapes and constants a llama forward pass needs (names follow the GGUF keys)."""

    num_layers: int  # llama.block_count
    d_model: int  # llama.embedding_length
    d_ffn: int  # llama.feed_forward_length
    num_q_heads: int  # llama.attention.head_count
    num_kv_heads: int  # llama.attention.head_count_kv
    head_dim: int  # d_model / num_q_heads (llama.rope.dimension_count when rotating all of it)
    vocab_size: int
    max_model_len: int  # llama.context_length
    rope_base: float  # llama.rope.freq_base
    rms_eps: float  # llama.attention.layer_norm_rms_epsilon
    tied_embeddings: bool  # no output.weight: the logits reuse token_embd

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """K and V of one token over all layers in fp32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
