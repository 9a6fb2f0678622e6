"""The notifications a decode side sends a prefill side over NIXL (docs/transfer.md, The
protocol): ``done`` (the blocks were read, or none were needed: free them), ``abandon`` (the read
failed or was given up: free them too) and ``renew`` (a heartbeat: extend the leases). One JSON
object each, versioned; a message that does not parse is ignored and counted by the receiver,
never raised: any agent that can reach the listener can send one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.transfer.params import TRANSFER_VERSION

__all__ = ["KINDS", "Notification", "decode_notification", "encode_notification"]

KINDS = ("done", "abandon", "renew")
_MAX_IDS = 4096
_MAX_MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class Notification:
    kind: str
    request_ids: tuple[str, ...]


def encode_notification(kind: str, request_ids: Sequence[str]) -> bytes:
    assert kind in KINDS and 0 < len(request_ids) <= _MAX_IDS, (kind, len(request_ids))
    return json.dumps(
        {"v": TRANSFER_VERSION, "k": kind, "r": list(request_ids)}, separators=(",", ":")
    ).encode()


def decode_notification(message: bytes) -> Notification | None:
    """The notification ``message`` carries, or None if it is not one of ours."""
    if not isinstance(message, bytes) or len(message) > _MAX_MESSAGE_BYTES:
        return None
    try:
        doc: Any = json.loads(message)
    except ValueError:  # not JSON, not UTF-8
        return None
    if not isinstance(doc, dict) or doc.get("v") != TRANSFER_VERSION or doc.get("k") not in KINDS:
        return None
    ids = doc.get("r")
    if not isinstance(ids, list) or not 0 < len(ids) <= _MAX_IDS:
        return None
    if not all(isinstance(r, str) and r for r in ids):
        return None
    return Notification(doc["k"], tuple(ids))
