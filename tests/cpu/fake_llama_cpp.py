"""A stand-in for ``llama_cpp``'s batch API (the functions ``llama_cpp_runner`` calls), so that the
runner's batching is tested where llama-cpp-python is not installed.

It checks each ``llama_decode`` as llama.cpp's KV cache would see it: one sequence id per token,
ids below ``n_seq_max``, each sequence's positions contiguous from 0, every token fed back after
the prefill the one the sampler gave that sequence, samples only from rows with logits on. Its
"model" answers ``(7 * token + seq + 1) % vocab`` after each token.

Run as the ``llama_cpp`` of a subprocess: a ``llama_cpp.py`` that does
``sys.modules[__name__] = FakeLlamaCpp()``.
"""

from __future__ import annotations

import ctypes
import types
from typing import Any


class _Batch(ctypes.Structure):
    _fields_ = [  # llama.h's struct llama_batch
        ("n_tokens", ctypes.c_int32),
        ("token", ctypes.POINTER(ctypes.c_int32)),
        ("embd", ctypes.POINTER(ctypes.c_float)),
        ("pos", ctypes.POINTER(ctypes.c_int32)),
        ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
        ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
        ("logits", ctypes.POINTER(ctypes.c_int8)),
    ]


class FakeContext:
    def __init__(self, params: Any, vocab: int) -> None:
        self.params = params
        self.vocab = vocab
        self.history: dict[int, list[int]] = {}  # seq -> its tokens, position i at index i
        self.expected: dict[int, int] = {}  # seq -> the token its next decode must feed back
        self.outputs: dict[int, int] = {}  # batch row -> the model's next token (logits on)
        self.decodes: list[list[int]] = []  # each llama_decode's sequence ids, in row order
        self.freed = False

    def decode(self, batch: _Batch) -> int:
        if not 0 < batch.n_tokens <= max(self.params.n_batch, 1):
            return -1
        self.outputs, seqs = {}, []
        for i in range(batch.n_tokens):
            seq, pos, token = batch.seq_id[i][0], batch.pos[i], batch.token[i]
            assert batch.n_seq_id[i] == 1 and 0 <= seq < self.params.n_seq_max, (i, seq)
            tokens = self.history.setdefault(seq, [])
            assert pos == len(tokens), f"sequence {seq}: position {pos} after {len(tokens)} tokens"
            assert 0 <= token < self.vocab
            if seq in self.expected:
                assert token == self.expected.pop(seq), f"sequence {seq}: not its sampled token"
            tokens.append(token)
            seqs.append(seq)
            if batch.logits[i]:
                self.outputs[i] = (7 * token + seq + 1) % self.vocab
        assert len(set(seqs)) in (1, len(seqs)), "a prefill of one sequence or one token per sequence"
        self.decodes.append(seqs)
        return 0

    def sample(self, idx: int) -> int:
        assert idx in self.outputs, f"row {idx} has no logits"
        token = self.outputs[idx]
        self.expected[self.decodes[-1][idx]] = token
        return token


class FakeLlama:
    """``llama_cpp.Llama`` for the single-stream mode: counts the tokens its stream gave."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.given = 0

    def generate(self, tokens: list[int], top_k: int, temp: float) -> Any:
        assert tokens and top_k == 1 and temp == 0.0
        while True:
            self.given += 1
            yield self.given


class FakeLlamaCpp(types.ModuleType):
    llama_log_callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)

    def __init__(self, vocab: int = 1000) -> None:
        super().__init__("llama_cpp")
        self.vocab = vocab
        self.contexts: list[FakeContext] = []
        self.batches_live = 0
        self.model_live = False
        self._keep: list[Any] = []  # the batches' arrays
        self.llms: list[FakeLlama] = []

    def Llama(self, **options: Any) -> FakeLlama:
        self.llms.append(FakeLlama(**options))
        return self.llms[-1]

    def llama_log_set(self, callback: Any, user_data: Any) -> None:
        assert isinstance(callback, self.llama_log_callback)

    def llama_backend_init(self) -> None:
        pass

    def llama_model_default_params(self) -> object:
        return object()

    def llama_model_load_from_file(self, path: bytes, params: object) -> str | None:
        assert isinstance(path, bytes)
        self.model_live = not path.endswith(b"missing.gguf")
        return "model" if self.model_live else None

    def llama_model_free(self, model: str) -> None:
        assert model == "model" and self.model_live
        self.model_live = False

    def llama_model_get_vocab(self, model: str) -> str:
        return "vocab"

    def llama_vocab_n_tokens(self, vocab: str) -> int:
        return self.vocab

    def llama_context_default_params(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            n_seq_max=1, n_ctx=512, n_batch=2048, n_ubatch=512, n_threads=4, n_threads_batch=4
        )

    def llama_init_from_model(self, model: str, params: types.SimpleNamespace) -> FakeContext:
        assert params.n_ubatch <= params.n_batch
        ctx = FakeContext(types.SimpleNamespace(**vars(params)), self.vocab)
        self.contexts.append(ctx)
        return ctx

    def llama_free(self, ctx: FakeContext) -> None:
        ctx.freed = True

    def llama_batch_init(self, n_tokens: int, embd: int, n_seq_max: int) -> _Batch:
        assert embd == 0 and n_seq_max >= 1
        arrays = [
            (ctypes.c_int32 * n_tokens)(),
            (ctypes.c_int32 * n_tokens)(),
            (ctypes.c_int32 * n_tokens)(),
            (ctypes.POINTER(ctypes.c_int32) * n_tokens)(),
            (ctypes.c_int8 * n_tokens)(),
        ]
        ids = [(ctypes.c_int32 * n_seq_max)() for _ in range(n_tokens)]
        for i, row in enumerate(ids):
            arrays[3][i] = ctypes.cast(row, ctypes.POINTER(ctypes.c_int32))
        self._keep.append((arrays, ids))
        self.batches_live += 1
        token, pos, n_seq_id, seq_id, logits = arrays
        return _Batch(0, token, None, pos, n_seq_id, seq_id, logits)

    def llama_batch_free(self, batch: _Batch) -> None:
        self.batches_live -= 1

    def llama_decode(self, ctx: FakeContext, batch: _Batch) -> int:
        assert not ctx.freed
        return ctx.decode(batch)

    def llama_sampler_init_greedy(self) -> str:
        return "greedy"

    def llama_sampler_sample(self, sampler: str, ctx: FakeContext, idx: int) -> int:
        return ctx.sample(idx)

    def llama_sampler_free(self, sampler: str) -> None:
        pass
