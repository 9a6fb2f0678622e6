"""KvLayout: which layers share which KV-cache group and which K/V tensor (the hybrid layout of
vLLM's hybrid KV-cache manager).

A model whose layers differ in attention kind (Gemma 3: five sliding-window layers to one global)
keeps one block table per *group* of layers. A sliding-window group releases the blocks its
layers can no longer see, so at long contexts it holds about ``window`` tokens while a
full-attention group holds them all. All groups draw on one pool, so a block of any group must
cost the same bytes; as vLLM does (``kv_cache_utils``), the layers of each attention kind are
split into groups of one common size ``layers_per_group``, and the i-th layer of every group
shares the i-th K tensor and the i-th V tensor ``[num_blocks, block_size, kv_heads, head_dim]``:
block ``b`` of group ``g`` is row ``b`` of those tensors, holding the K/V of group g's layers.

The group size is the smallest per-kind layer count, or the largest when every count lies within
1.25x of the smallest (fewer groups, little padding). A kind whose count does not divide by it
gets a last group with fewer layers (vLLM pads it; here the padding tensors are simply not
used by that group). Gemma 3 270M: 3 global and 15 local layers -> 6 groups of 3 (group 0 the
global layers), 3 K and 3 V tensors in all, a block holding 3 layers' K/V. SmolLM2 (no window):
one full-attention group of all 30 layers, exactly the single-table layout.

``hybrid=False`` gives one full-attention group of every layer whatever the windows (vLLM's
``--disable-hybrid-kv-cache-manager``): the sliding-window layers then keep their whole history in
the cache, while their attention still applies the window (same tokens, more memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["KvLayout", "kv_layout", "layer_windows", "new_manager"]

# vLLM's rule: one group size for every kind, the largest count if the counts are this close.
_SAME_SIZE_RATIO = 1.25


@dataclass(frozen=True)
class KvLayout:
    """``group_windows[g]``: group g's sliding window (None: full attention);
    ``group_layers[g]``: its layers in order (at most ``layers_per_group``); layer
    ``group_layers[g][i]`` reads and writes K/V tensor ``i`` through group g's block table."""

    group_windows: tuple[int | None, ...]
    group_layers: tuple[tuple[int, ...], ...]
    layers_per_group: int
    _slots: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        slots = {
            layer: (g, i) for g, layers in enumerate(self.group_layers) for i, layer in enumerate(layers)
        }
        object.__setattr__(self, "_slots", slots)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_layers(self) -> int:
        return sum(len(layers) for layers in self.group_layers)

    @property
    def is_hybrid(self) -> bool:
        """More than one group (the manager then keeps a block table per group)."""
        return self.num_groups > 1

    def slot(self, layer: int) -> tuple[int, int]:
        """(group, tensor index) of ``layer``."""
        return self._slots[layer]

    def bytes_per_block(self, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        """Bytes one block holds in the caches (K and V of ``layers_per_group`` layers), whatever
        its group: the pool's unit of memory."""
        return 2 * self.layers_per_group * block_size * num_kv_heads * head_dim * itemsize

    def manager_groups(self) -> list[Any] | None:
        """``kv_groups`` for ``KvCacheManager`` (None: the default single full-attention group,
        which every build of the core accepts)."""
        if self.group_windows == (None,):
            return None
        import pagedkv

        return [
            pagedkv.FullAttention() if w is None else pagedkv.SlidingWindow(window=w)
            for w in self.group_windows
        ]


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), from a model config: Gemma 3's
    ``window(layer)``; a config without one (llama) is full attention everywhere."""
    window = getattr(config, "window", None)
    if window is None:
        return [None] * config.num_layers
    return [window(i) for i in range(config.num_layers)]


def kv_layout(windows: Sequence[int | None], *, hybrid: bool = True) -> KvLayout:
    """The group layout of layers with these windows (see the module docstring)."""
    if not windows:
        raise InvalidArgumentError("a model needs at least one layer")
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise InvalidArgumentError(f"a layer's window must be a positive int or None, got {w!r}")
    everything = tuple(range(len(windows)))
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full attention first
    if not hybrid:
        return KvLayout((None,), (everything,), len(windows))
    if len(kinds) == 1:
        return KvLayout((kinds[0],), (everything,), len(windows))
    layers_of = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    counts = [len(layers) for layers in layers_of.values()]
    size = max(counts) if max(counts) < _SAME_SIZE_RATIO * min(counts) else min(counts)
    group_windows: list[int | None] = []
    group_layers: list[tuple[int, ...]] = []
    for kind in kinds:
        layers = layers_of[kind]
        for start in range(0, len(layers), size):
            group_windows.append(kind)
            group_layers.append(tuple(layers[start : start + size]))
    return KvLayout(tuple(group_windows), tuple(group_layers), size)


def new_manager(layout: KvLayout, **options: Any) -> Any:
    """A ``KvCacheManager`` with one block table per group of ``layout`` (``options``: its other
    keywords); a one-full-group layout passes no ``kv_groups`` (the manager's default)."""
    import pagedkv

    groups = layout.manager_groups()
    if groups is not None:
        options["kv_groups"] = groups
    return pagedkv.KvCacheManager(**options)
