"""A fake KV connector for vLLM 0.33's scheduler (benches/vllm_scheduler.py's ``Workload.connector``):
deterministic, independent of the KV-cache manager, moving no data, so that two managers driven
with it see the same external hits and their traces compare.
"""

from __future__ import annotations

from typing import Any

FAKE_CONNECTOR = "PagedkvBenchFakeConnector"


def fake_kv_transfer_config(kind: str) -> Any:
    """vLLM's ``KVTransferConfig`` for a fake KV connector, deterministic and independent of the
    KV-cache manager: a request whose id is 0 mod 3 gets no external hit; the others an
    external hit up to the last full block before their last token (beyond the local hit),
    loaded synchronously, or, with ``kind="mixed"``, asynchronously for ids 1 mod 3. It moves
    no data (the fake model runner reports async loads finished). It supports vLLM's hybrid
    allocator (``SupportsHMA``), so the scheduler takes it with several KV-cache groups (a
    window group beside full attention) and hands it every group's blocks at the end."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )

    class FakeConnector(KVConnectorBase_V1, SupportsHMA):
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            n = int(request.request_id)
            if n % 3 == 0:
                return 0, False
            bs = self._vllm_config.cache_config.block_size
            target = (request.num_tokens - 1) // bs * bs
            extra = self._kv_transfer_config.kv_connector_extra_config
            external = max(target - num_computed_tokens, 0)
            return external, external > 0 and extra["kind"] == "mixed" and n % 3 == 1

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            pass

        def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
            return False, None  # nothing sent: the blocks are freed now

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            pass

        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            pass

        def wait_for_save(self) -> None:
            pass

    # The factory's lazy registry (register_connector needs an importable module path, which a
    # bench loaded by path does not have).
    KVConnectorFactory._registry.setdefault(FAKE_CONNECTOR, lambda: FakeConnector)
    return KVTransferConfig(
        kv_connector=FAKE_CONNECTOR, kv_role="kv_both", kv_connector_extra_config={"kind": kind}
    )
