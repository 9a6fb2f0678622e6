"""A sampled token's effect on its sequence: the newly decodable text and whether it stops.

A sequence stops at an end-of-generation token (unless ``ignore_eos``), when its text contains a
stop string (the text is cut before it), after ``max_tokens``, or when the context is full.
"""

from __future__ import annotations

from pagedkv.engine.sequence import Sequence
from pagedkv.models import Gemma3Tokenizer, GgufTokenizer

__all__ = ["record_token"]


def record_token(
    seq: Sequence, token: int, tokenizer: GgufTokenizer | Gemma3Tokenizer, max_model_len: int
) -> tuple[str, str | None]:
    """Append ``token`` to ``seq``'s output; (the new text, the finish reason or None). A sequence
    that goes on also gets the token in ``token_ids``, for the next step's append."""
    params = seq.request.params
    seq.output_ids.append(token)
    reason = None
    if not params.ignore_eos and token in tokenizer.stop_token_ids:
        reason = "stop"
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    if text.endswith("\ufffd") and reason is None:
        text = seq.text  # an incomplete UTF-8 sequence: wait for the next token
    for stop in params.stop or ():
        at = text.find(stop)
        if at >= 0:
            text, reason = text[:at], "stop"
    delta = text[len(seq.text) :] if text.startswith(seq.text) else text
    seq.text = text
    if reason is None and (
        len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) + 1 >= max_model_len
    ):
        reason = "length"
    if reason is None:
        seq.token_ids.append(token)
    return delta, reason
