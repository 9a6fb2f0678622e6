"""Fuzzing the GGUF loader: every truncation, bit flips, and crafted headers of a tiny model.

The tiny llama file of ``tiny_gguf`` (written with ``gguf.GGUFWriter``) is cut at every offset,
has a bit flipped in every byte of its header and tensor index and at random places in its data,
and is patched into the classic lies (huge counts, huge or "negative" string lengths, unknown
types, tensor offsets past the end, dimension products that overflow 64 bits, misaligned or
overlapping tensors, ...). Each case is loaded with ``load_model`` in child interpreters under a
timeout and an address-space limit (``gguf_isolated``), many cases per child; every case must
end in a successful load or the loader's typed error (``ModelLoadError``, or
``UnsupportedModelError`` for a valid file of an unsupported kind), with no memory growth.
``PAGEDKV_FUZZ_EXAMPLES`` scales the number of random data flips.
"""

from __future__ import annotations

import os
import random
import struct

import pytest
from gguf_isolated import TYPED, run_load_cases
from tiny_gguf import write_tiny_llama

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

DATA_FLIPS = 40 * int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "6"))
MAX_GROWTH_KIB = 64 << 10


def u32(v: int) -> str:
    return struct.pack("<I", v).hex()


def u64(v: int) -> str:
    return struct.pack("<Q", v).hex()


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


class Layout:
    """Where the fields of the tiny file are, found from its bytes (independently of the reader
    under test): metadata entries by key, tensor-index entries by name."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.kv_count = struct.unpack_from("<Q", data, 16)[0]
        self.tensor_count = struct.unpack_from("<Q", data, 8)[0]

    def value_offset(self, key: str) -> int:
        """Offset of the u32 value type of metadata ``key``."""
        return self.data.index(gguf_string(key)) + 8 + len(key)

    def tensor_info(self, name: str) -> dict[str, int]:
        start = self.data.rindex(gguf_string(name))  # the index comes after the metadata
        at = start + 8 + len(name)
        n_dims = struct.unpack_from("<I", self.data, at)[0]
        dims_at = at + 4
        type_at = dims_at + 8 * n_dims
        return {
            "name_at": start,
            "n_dims_at": at,
            "dims_at": dims_at,
            "type_at": type_at,
            "offset_at": type_at + 4,
        }

    def tensor_offset(self, name: str) -> int:
        return struct.unpack_from("<Q", self.data, self.tensor_info(name)["offset_at"])[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def crafted_cases(data: bytes) -> dict[str, list]:
    """name -> [kind, *args] of hand-made lies, each a patch of the valid file."""
    lay = Layout(data)
    emb = lay.tensor_info("token_embd.weight")
    norm = lay.tensor_info("blk.0.attn_norm.weight")
    up = lay.tensor_info("blk.0.ffn_up.weight")
    attn_v = lay.tensor_info("blk.0.attn_v.weight")
    tokens = lay.value_offset("tokenizer.ggml.tokens")
    first_token = tokens + 4 + 4 + 8  # value type, element type, count
    name_len = lay.value_offset("general.architecture") - len("general.architecture") - 8
    return {
        "bad magic": ["patch", 0, b"GGUG".hex()],
        "version 1": ["patch", 4, u32(1)],
        "version 4": ["patch", 4, u32(4)],
        "big-endian version": ["patch", 4, struct.pack(">I", 3).hex()],
        "2**62 tensors": ["patch", 8, u64(1 << 62)],
        "tensor count + 1": ["patch", 8, u64(lay.tensor_count + 1)],
        "2**62 metadata entries": ["patch", 16, u64(1 << 62)],
        "metadata count + 1": ["patch", 16, u64(lay.kv_count + 1)],
        "key length 2**64-1 (-1)": ["patch", name_len, u64((1 << 64) - 1)],
        "key length 2**62": ["patch", name_len, u64(1 << 62)],
        "token length -1": ["patch", first_token, u64((1 << 64) - 1)],
        "token length 2**40": ["patch", first_token, u64(1 << 40)],
        "token count 2**62": ["patch", tokens + 8, u64(1 << 62)],
        "token count + 1": ["patch", tokens + 8, u64(10)],
        "unknown value type": ["patch", lay.value_offset("llama.block_count"), u32(99)],
        "block_count as a string": ["patch", lay.value_offset("llama.block_count"), u32(8)],
        "tokens as u8 array": ["patch", tokens + 4, u32(0)],
        "tokens as nested arrays": ["patch", tokens + 4, u32(9)],
        "unknown element type": ["patch", tokens + 4, u32(77)],
        "n_dims 0": ["patch", norm["n_dims_at"], u32(0)],
        "n_dims 5": ["patch", norm["n_dims_at"], u32(5)],
        "n_dims 2**32-1": ["patch", norm["n_dims_at"], u32((1 << 32) - 1)],
        "dim 0": ["patch", norm["dims_at"], u64(0)],
        "dims overflow 64 bits": ["patch", emb["dims_at"] + 8, u64((1 << 63) + 1)],
        "dims product 2**64": ["patch", emb["dims_at"], u64(1 << 32) + u64(1 << 32)],
        "row not a whole block": ["patch", emb["dims_at"], u64(33)],
        "unknown tensor type": ["patch", norm["type_at"], u32(99)],
        "tensor type Q2_K": ["patch", norm["type_at"], u32(10)],
        "tensor type F32 on a Q4_0 tensor": ["patch", up["type_at"], u32(0)],
        "tensor offset past the end": ["patch", norm["offset_at"], u64(1 << 40)],
        "tensor offset 2**64-32": ["patch", norm["offset_at"], u64((1 << 64) - 32)],
        "misaligned tensor": [
            "patch",
            norm["offset_at"],
            u64(lay.tensor_offset("blk.0.attn_norm.weight") + 4),
        ],
        "overlapping tensors": ["patch", up["offset_at"], u64(lay.tensor_offset("blk.0.ffn_gate.weight"))],
        "duplicate tensor name": ["patch", attn_v["name_at"] + 8 + len("blk.0.attn_"), b"k".hex()],
        "non-UTF-8 token": ["patch", first_token + 8, "ff"],
        "empty file": ["truncate", 0],
    }


def data_end(path) -> int:
    from pagedkv.models.gguf_reader import open_gguf

    with open_gguf(path) as f:
        return max(t.offset + t.n_bytes for t in f.tensors.values())


def test_loader_survives_truncations_flips_and_crafted_headers(tiny, tmp_path):
    data = tiny.read_bytes()
    with_tensors_end = data_end(tiny)
    header_end = Layout(data).tensor_info("output_norm.weight")["offset_at"] + 8
    rng = random.Random(28)
    cases: list[list] = [[f"cut {n}", "truncate", n] for n in range(len(data))]
    bits = [rng.randrange(8) for _ in range(header_end)]
    cases += [[f"flip {i}:{bit}", "flip", i, bit] for i, bit in enumerate(bits)]
    cases += [
        [f"data flip {i}", "flip", rng.randrange(header_end, len(data)), rng.randrange(8)]
        for i in range(DATA_FLIPS)
    ]
    crafted = crafted_cases(data)
    cases += [[name, *spec] for name, spec in crafted.items()]
    outcomes = run_load_cases(tiny, cases, tmp_path, workers=2, timeout_s=240)
    bad = {
        c[0]: outcomes[c[0]]
        for c in cases
        if outcomes[c[0]].outcome not in TYPED or outcomes[c[0]].peak_growth_kib > MAX_GROWTH_KIB
    }
    assert not bad, f"{len(bad)} cases ended badly, e.g. {list(bad.items())[:5]}"
    loaded_cuts = [n for n in range(with_tensors_end) if outcomes[f"cut {n}"].outcome == "OK"]
    assert not loaded_cuts, f"files cut inside the tensor data loaded: {loaded_cuts[:5]}"
    loaded_lies = [name for name in crafted if outcomes[name].outcome == "OK"]
    assert not loaded_lies, f"crafted lies loaded: {loaded_lies}"
