"""``serve_prompts``: prompts through a prefill and a decode process, compared with one instance
(what ``pagedkv disagg`` runs and writes; docs/transfer.md, The engine)."""

from __future__ import annotations

from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["read_prompts", "serve_prompts"]

MAX_PROMPTS = 10_000


def read_prompts(document: object) -> list[str | list[int]]:
    """The ``prompts`` of ``{"prompts": [...]}``: texts, or lists of token ids."""
    if not isinstance(document, dict) or not isinstance(document.get("prompts"), list):
        raise InvalidArgumentError('the prompts file must hold {"prompts": [...]}')
    prompts = document["prompts"]
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise InvalidArgumentError(
            f"the prompts file must hold 1 to {MAX_PROMPTS} prompts, got {len(prompts)}"
        )
    for i, prompt in enumerate(prompts):
        ok = (isinstance(prompt, str) and prompt) or (
            isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        )
        if not ok:
            raise InvalidArgumentError(f"prompt {i} must be a non-empty text or list of token ids")
    return list(prompts)


def serve_prompts(
    prompts: list[str | list[int]],
    *,
    model: str | None = None,
    max_tokens: int = 16,
    lease_s: float = 30.0,
    **engine_options: Any,
) -> dict[str, Any]:
    """Serve each prompt (in order) through a prefill and a decode process, greedy, and on one
    instance; per request its ``tokens`` and ``single_instance_tokens``, and the transfer's
    ``blocks_sent``, ``blocks_skipped`` (held by the decode side already) and the prefill
    side's ``leaked_blocks`` once everything is released."""
    from pagedkv.disagg.workers import DisaggWorkers
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.prompts import prompt_token_ids
    from pagedkv.models import load_model

    sampling: dict[str, Any] = {"max_tokens": max_tokens}
    params = SamplingParams(**sampling)  # checked before anything starts
    loaded = load_model(model)
    ids = [
        loaded.tokenizer.encode(p) if isinstance(p, str) else prompt_token_ids(p, loaded.config.vocab_size)
        for p in prompts
    ]
    requests: list[dict[str, Any]] = []
    with DisaggWorkers(model, lease_s=lease_s, **engine_options) as workers:
        for i, tokens in enumerate(ids):
            offered = workers.prefill(i, tokens, sampling)
            decoded = workers.decode(i, tokens, sampling, offered.get("kv_transfer_params"))
            transfer = decoded.get("transfer") or {}
            requests.append(
                {
                    "prompt": prompts[i] if isinstance(prompts[i], str) else None,
                    "prompt_tokens": len(tokens),
                    "tokens": decoded["tokens"],
                    "blocks_sent": transfer.get("blocks_read", 0),
                    "blocks_skipped": transfer.get("blocks_skipped", 0),
                    "blocks_failed": transfer.get("blocks_failed", 0),
                    "tokens_received": transfer.get("tokens_received", 0),
                    "error": decoded.get("error") or offered.get("error") or transfer.get("error"),
                }
            )
        decode_stats = workers.stats("decode")
        prefill_stats = workers.stats("prefill", drain_s=lease_s + 1.0)
    with LLM(loaded, **engine_options) as single:
        for request, tokens in zip(requests, ids, strict=True):
            request["single_instance_tokens"] = single.generate([tokens], params)[0].outputs[0].token_ids
            request["equal"] = request["tokens"] == request["single_instance_tokens"]
    return {
        "model": model or "SmolLM2-135M-Instruct",
        "max_tokens": max_tokens,
        "requests": requests,
        "all_equal": all(r["equal"] for r in requests),
        "blocks_sent": decode_stats["blocks_sent"],
        "blocks_skipped": decode_stats["blocks_skipped"],
        "blocks_failed": decode_stats["blocks_failed"],
        "leaked_blocks": prefill_stats["leaked_blocks"],
        "pending_transfers": prefill_stats["pending_transfers"],
        "decode_blocks_in_use": decode_stats["blocks_in_use"],
        "transfer_errors": decode_stats["transfer_errors"],
    }
