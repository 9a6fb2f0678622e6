"""A contiguous float64-softmax attention over each layer's whole history (one sequence), for
comparing a model's weight modes without the paged data plane in the way."""

from __future__ import annotations

import numpy as np


class DenseAttention:
    def __init__(self) -> None:
        self.k: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        kk = self.k[layer] = np.concatenate([self.k.get(layer, k[:0]), k])
        vv = self.v[layer] = np.concatenate([self.v.get(layer, v[:0]), v])
        group = q.shape[1] // kk.shape[1]
        kr, vr = np.repeat(kk, group, axis=1), np.repeat(vv, group, axis=1)
        s = np.einsum("thd,nhd->htn", q, kr) / np.sqrt(q.shape[2])
        t, n = q.shape[0], kk.shape[0]
        s = np.where(np.arange(n)[None, None, :] <= (n - t + np.arange(t))[None, :, None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("htn,nhd->thd", s / s.sum(-1, keepdims=True), vr).astype(np.float32)
