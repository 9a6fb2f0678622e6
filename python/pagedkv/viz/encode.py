"""Compact delta encoding of simulator frames, so dozens of runs fit in one HTML page.

A recording from ``pagedkv.sim.engine.record_frames`` repeats the whole pool and every block
table at every step, although one engine step changes only a few cells: each running request
writes one token. Embedding it verbatim would make the page tens of megabytes, so each run is
stored as

* ``c``: the per-step counters, one column (list over frames) per counter name (the
  ``INT_COUNTER_KEYS`` and ``FLOAT_COUNTER_KEYS``, plus ``OPTIONAL_INT_COUNTER_KEYS`` when every
  frame has them);
* ``p``: per frame, the pool cells that changed since the previous frame (the first frame is
  compared with an all-free pool), as a flat list ``[gap, owner, tokens, reserved, ...]`` where
  ``gap`` is the cell index minus the previous listed cell index (the first one minus -1);
* ``pi``: per frame, cells whose only change is "one more token held, one fewer slot reserved,
  same owner" (the common case of a decode step), as a gap-encoded list of cell indices;
* ``t``: per frame, block-table entries that changed in another way than "``td`` more tokens,
  same blocks", as a flat list ``[request_id, sample, num_tokens, num_kept, num_appended,
  *appended]``: the new block list is the first ``num_kept`` blocks of the previous one plus
  ``appended``. A table belongs to one sequence: ``sample`` is its index in the request's group
  (0 for a request without parallel samples or beams);
* ``td``: per frame, the token increment applied to every unlisted sequence that stays;
* ``tg``: per frame, the sequences whose table disappeared, as flat ``[request_id, sample, ...]``;
* ``sh``: per frame, the blocks shared by several sequences as flat ``[block_id, refcount, ...]``,
  or ``None`` when the list equals the previous frame's (copy-on-write sharing changes rarely).

The viewer (``viz.js``) decodes this format; :func:`decode_run` is the reference decoder.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError

#: Integer counters every frame carries (names from ``pagedkv.sim.engine.record_frames``).
INT_COUNTER_KEYS = (
    "step",
    "running",
    "waiting",
    "finished",
    "preemptions",
    "used_blocks",
    "token_slots",
    "reserved_slots",
    "internal_frag_slots",
)
#: Integer counters recorded beyond the documented list of ``record_frames``; kept when present.
OPTIONAL_INT_COUNTER_KEYS = ("external_frag_slots", "free_slots")
#: Float counters; stored rounded to ``WASTE_PCT_DECIMALS`` decimals.
FLOAT_COUNTER_KEYS = ("waste_pct",)
WASTE_PCT_DECIMALS = 4

#: A cell nobody owns: owner -1, no tokens, nothing reserved.
FREE_CELL = (-1, 0, 0)


def _gaps(indices: np.ndarray) -> list[int]:
    """Sorted cell indices -> differences to the previous index (the first against -1)."""
    if indices.size == 0:
        return []
    return np.diff(indices, prepend=-1).tolist()


def _pool_array(pool: Any, num_blocks: int, frame_index: int) -> np.ndarray:
    """One frame's pool (list of [owner, tokens, reserved] or an array) -> int64 [num_blocks, 3]."""
    cells = np.asarray(pool, dtype=np.int64)
    if cells.shape != (num_blocks, 3):
        raise InvalidArgumentError(
            f"frame {frame_index}: pool has shape {cells.shape}, expected ({num_blocks}, 3)"
        )
    return cells


#: A table's key: (request id, index of the sequence in the request's group).
SeqKey = tuple[int, int]


def _tables_dict(tables: Mapping[Any, Mapping[str, Any]]) -> dict[SeqKey, tuple[int, tuple[int, ...]]]:
    """Frame tables -> {(request_id, sample): (num_tokens, physical block ids)}, one entry per
    sequence: a group's ``sequences`` list when present, else the request's own table."""
    out: dict[SeqKey, tuple[int, tuple[int, ...]]] = {}
    for rid, entry in tables.items():
        sequences = entry.get("sequences") or [entry]
        for sample, seq in enumerate(sequences):
            out[(int(rid), sample)] = (int(seq["num_tokens"]), tuple(map(int, seq["blocks"])))
    return out


def _shared_flat(shared: Any) -> list[int]:
    """Frame ``shared`` ([[block_id, refcount], ...]) -> flat [block_id, refcount, ...] sorted by block."""
    return [int(v) for pair in sorted((int(b), int(r)) for b, r in shared) for v in pair]


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def encode_run(recording: Mapping[str, Any], **labels: Any) -> dict[str, Any]:
    """Encode one ``record_frames`` result; ``labels`` (allocator, block_size, seed) are kept.

    ``recording["frames"][i]["pool"]`` is an int sequence ``[num_blocks, 3]`` of
    (owner request id or -1, tokens held, slots reserved but not yet holding tokens).
    """
    num_blocks = int(recording["num_blocks"])
    block_size = int(recording["block_size"])
    frames = recording["frames"]
    if num_blocks <= 0 or block_size <= 0:
        raise InvalidArgumentError(
            f"recording has num_blocks={num_blocks}, block_size={block_size}; both must be > 0"
        )
    if not frames:
        raise InvalidArgumentError("recording has no frames")

    int_keys = INT_COUNTER_KEYS + tuple(
        key for key in OPTIONAL_INT_COUNTER_KEYS if all(key in frame for frame in frames)
    )
    counters: dict[str, list[Any]] = {k: [] for k in int_keys + FLOAT_COUNTER_KEYS}
    pool_sets: list[list[int]] = []
    pool_incs: list[list[int]] = []
    table_changes: list[list[int]] = []
    table_deltas: list[int] = []
    table_gone: list[list[int]] = []
    shared_lists: list[list[int] | None] = []
    prev_shared: list[int] | None = None

    prev_pool = np.tile(np.array(FREE_CELL, dtype=np.int64), (num_blocks, 1))
    prev_tables: dict[SeqKey, tuple[int, tuple[int, ...]]] = {}
    for index, frame in enumerate(frames):
        for key in int_keys:
            counters[key].append(int(frame[key]))
        for key in FLOAT_COUNTER_KEYS:
            counters[key].append(round(float(frame[key]), WASTE_PCT_DECIMALS))

        pool = _pool_array(frame["pool"], num_blocks, index)
        changed = np.any(pool != prev_pool, axis=1)
        incremented = (
            changed
            & (pool[:, 0] == prev_pool[:, 0])
            & (pool[:, 0] != -1)
            & (pool[:, 1] == prev_pool[:, 1] + 1)
            & (pool[:, 2] == prev_pool[:, 2] - 1)
        )
        set_cells = np.flatnonzero(changed & ~incremented)
        inc_cells = np.flatnonzero(incremented)
        flat_sets = np.empty((set_cells.size, 4), dtype=np.int64)
        flat_sets[:, 0] = _gaps(set_cells)
        flat_sets[:, 1:] = pool[set_cells]
        pool_sets.append(flat_sets.ravel().tolist())
        pool_incs.append(_gaps(inc_cells))
        prev_pool = pool

        tables = _tables_dict(frame["tables"])
        deltas = Counter(
            tables[rid][0] - old[0]
            for rid, old in prev_tables.items()
            if rid in tables and tables[rid][1] == old[1]
        )
        delta = deltas.most_common(1)[0][0] if deltas else 0
        changes: list[int] = []
        for table_key in sorted(tables):
            num_tokens, blocks = tables[table_key]
            old = prev_tables.get(table_key)
            if old is not None and old[1] == blocks and num_tokens - old[0] == delta:
                continue
            kept = _common_prefix_len(old[1], blocks) if old is not None else 0
            appended = blocks[kept:]
            changes.extend((*table_key, num_tokens, kept, len(appended)))
            changes.extend(appended)
        table_changes.append(changes)
        table_deltas.append(delta)
        table_gone.append([v for key in sorted(k for k in prev_tables if k not in tables) for v in key])
        shared = _shared_flat(frame.get("shared", ()))
        shared_lists.append(None if shared == prev_shared else shared)
        prev_shared = shared
        prev_tables = tables

    encoded: dict[str, Any] = {key: value for key, value in labels.items()}
    encoded.update(
        {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "config": dict(recording.get("config", {})),
            # The run's end-of-recording metrics, scalars only (per-request arrays stay out).
            "summary": {
                key: value
                for key, value in dict(recording.get("summary", {})).items()
                if isinstance(value, (int, float, str, bool))
            },
            "n": len(frames),
            "c": counters,
            "p": pool_sets,
            "pi": pool_incs,
            "t": table_changes,
            "td": table_deltas,
            "tg": table_gone,
            "sh": shared_lists,
        }
    )
    return encoded


def decode_run(encoded: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Inverse of :func:`encode_run`: one dict per frame with counters, ``pool`` (int64
    [num_blocks, 3]), ``tables`` ({request_id: {"blocks": [...], "num_tokens": n}}, plus
    ``"sequences"`` listing every sequence when a request has several, as ``record_frames``
    gives them) and ``shared`` ([[block_id, refcount], ...] sorted by block id)."""
    num_blocks = int(encoded["num_blocks"])
    pool = np.tile(np.array(FREE_CELL, dtype=np.int64), (num_blocks, 1))
    tables: dict[SeqKey, tuple[int, list[int]]] = {}
    shared: list[int] = []
    frames: list[dict[str, Any]] = []
    for index in range(int(encoded["n"])):
        pool = pool.copy()
        cell = -1
        sets = encoded["p"][index]
        for k in range(0, len(sets), 4):
            cell += sets[k]
            pool[cell] = sets[k + 1 : k + 4]
        cell = -1
        for gap in encoded["pi"][index]:
            cell += gap
            pool[cell, 1] += 1
            pool[cell, 2] -= 1

        gone = encoded["tg"][index]
        for k in range(0, len(gone), 2):
            del tables[(gone[k], gone[k + 1])]
        delta = encoded["td"][index]
        tables = {key: (num_tokens + delta, blocks) for key, (num_tokens, blocks) in tables.items()}
        changes = encoded["t"][index]
        k = 0
        while k < len(changes):
            rid, sample, num_tokens, kept, num_appended = changes[k : k + 5]
            old_blocks = tables[(rid, sample)][1] if kept else []
            tables[(rid, sample)] = (
                num_tokens,
                old_blocks[:kept] + list(changes[k + 5 : k + 5 + num_appended]),
            )
            k += 5 + num_appended
        if encoded["sh"][index] is not None:
            shared = list(encoded["sh"][index])

        frame: dict[str, Any] = {key: encoded["c"][key][index] for key in encoded["c"]}
        frame["pool"] = pool
        by_request: dict[int, list[dict[str, Any]]] = {}
        for (rid, _sample), (num_tokens, blocks) in sorted(tables.items()):
            by_request.setdefault(rid, []).append({"blocks": list(blocks), "num_tokens": num_tokens})
        frame["tables"] = {}
        for rid, sequences in by_request.items():
            entry = dict(sequences[0])
            if len(sequences) > 1:
                entry["sequences"] = sequences
            frame["tables"][rid] = entry
        frame["shared"] = [[shared[k], shared[k + 1]] for k in range(0, len(shared), 2)]
        frames.append(frame)
    return frames
