"""pagedkv's vLLM manager skips the core call of a decode step that stays inside one block
(``allocate_slots``' fast path: the watermark advance waits for the request's next core call,
docs/integrations/vllm.md, Speed). What the core must see still reaches it in time: each
scenario runs the same calls on vLLM's own manager and on pagedkv's, and after every call the
answers, the free blocks and the prefix-cache hit of a probe of the request's tokens so far must
agree (pagedkv's ``check_invariants`` also compares its record of the core's watermark with
the core's). The scheduler-level differentials probe after every call too
(test_vllm_scheduler_differential.py); these reach what vLLM's scheduler never calls alone:
rejected drafts without ``cache_blocks``, a late block hash at ``allocate_slots``, a free while
an advance waits. Runs in the vLLM stage (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_manager")

BS = 4


class _Run:
    """One manager driven by a scenario, noting after every call what both managers must agree
    on: (the call, its answer, free blocks, the probe's hit)."""

    def __init__(self, kind: str, lookahead_hasher: bool) -> None:
        import torch
        from pagedkv.integrations.vllm import KVCacheManager
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=24, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
        )
        args = dict(max_model_len=64, scheduler_block_size=BS, hash_block_size=BS)
        self.m = VllmKVCacheManager(config, **args) if kind == "vllm" else KVCacheManager(config, **args)
        # A lookahead hasher hashes a block once the token after it exists (multi-token
        # prediction): a hash then arrives after its block's ids.
        self.hasher = get_request_block_hasher(BS, sha256, 1 if lookahead_hasher else 0)
        self.seen: list[tuple[Any, ...]] = []

    def request(self, rid: str, prompt: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=self.hasher)

    def note(self, what: str, request: Any, answer: Any) -> None:
        probe = self.request("probe", [*request.all_token_ids, 0])
        hit = self.m.get_computed_blocks(probe)[1]
        self.seen.append((what, answer, self.m.block_pool.get_num_free_blocks(), hit))
        if hasattr(self.m, "check_invariants"):
            self.m.check_invariants()

    def admit(self, request: Any, lookahead: int = 0) -> None:
        from vllm.v1.request import RequestStatus

        blocks, hit = self.m.get_computed_blocks(request)[:2]
        got = self.m.allocate_slots(
            request,
            request.num_tokens - hit,
            hit,
            blocks,
            num_lookahead_tokens=lookahead,
            full_sequence_must_fit=True,
        )
        assert got is not None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_tokens
        self.note(f"admit {request.request_id} (hit {hit})", request, len(got.get_block_ids()[0]))

    def step(self, request: Any, drafts: int = 0, accepted: int = 0, lookahead: int = 0) -> None:
        """A decode step with ``drafts`` draft tokens of which ``accepted`` are accepted; the
        watermark rolls back by the rejected ones and the sampled tokens are appended (no
        ``cache_blocks``: the next ``allocate_slots`` must see all of it)."""
        got = self.m.allocate_slots(request, 1 + drafts, num_lookahead_tokens=lookahead)
        assert got is not None
        self.note(f"step {request.num_computed_tokens}+{1 + drafts}", request, len(got.get_block_ids()[0]))
        request.num_computed_tokens += 1 + accepted
        request.append_output_token_ids([100 + request.num_tokens + i for i in range(accepted + 1)])


def _same(scenario: Any, lookahead_hasher: bool = False) -> list[tuple[Any, ...]]:
    runs = {kind: _Run(kind, lookahead_hasher) for kind in ("vllm", "pagedkv")}
    for run in runs.values():
        scenario(run)
    assert runs["pagedkv"].seen == runs["vllm"].seen
    return runs["pagedkv"].seen


def test_rejected_drafts_then_a_block_fill() -> None:
    """Drafts inside one block (advances deferred), rejected without ``cache_blocks``: the next
    ``allocate_slots`` rolls back from the watermark the core would have had, and the block
    the decode then fills is indexed at that call."""

    def scenario(run: _Run) -> None:
        r = run.request("r", [1, 2, 3, 4, 5])  # blocks 0 and 1 (8 slots)
        run.admit(r)
        r.append_output_token_ids(6)
        run.step(r, drafts=1, accepted=0)  # 5 + 2 inside block 1; draft rejected: 6
        run.step(r, drafts=1, accepted=1)  # 6 + 2 fills block 1 (ids up to 8 known after)
        run.step(r)  # 8 + 1: block 2
        run.step(r, drafts=1, accepted=0)  # 9 + 2 deferred; rejected: 10
        run.step(r, drafts=1, accepted=1)  # rolls back to 10, 10 + 2 fills block 2
        run.step(r)

    seen = _same(scenario)
    # each decoded block hittable from the call after its last id arrived, as on vLLM's
    assert [hit for *_, hit in seen] == [4, 4, 4, 8, 8, 8, 12]


def test_a_late_hash_reaches_the_core_at_allocate_slots() -> None:
    """A lookahead hasher's hash of a computed block arrives with the next token: the next
    decode step (inside one block) must give it, so the block is indexed at that call as
    vLLM's manager caches it there."""

    def scenario(run: _Run) -> None:
        r = run.request("r", [1, 2, 3, 4])
        run.admit(r, lookahead=2)  # blocks 0 and 1; block 0 has no hash yet
        r.append_output_token_ids(5)  # block 0's hash now
        run.step(r)  # 4 + 1, inside block 1

    seen = _same(scenario, lookahead_hasher=True)
    assert seen[-1][-1] == BS


def test_free_and_readmission_while_an_advance_waits() -> None:
    """A request freed (preempted) with a deferred advance: freeing reads no watermark, and its
    readmission hits exactly the blocks it filled."""

    def scenario(run: _Run) -> None:
        r = run.request("r", [1, 2, 3, 4, 5, 6])
        run.admit(r)
        r.append_output_token_ids(7)
        for _ in range(3):  # 6 + 1, 7 + 1 (fills block 1), 8 + 1 (deferred)
            run.step(r)
        run.m.free(r)
        r.num_computed_tokens = 0
        run.note("free", r, None)
        run.admit(r)
        other = run.request("o", [*r.all_token_ids[:8], 9, 9])
        run.admit(other)

    seen = _same(scenario)
    assert seen[-2][0] == "admit r (hit 8)" and seen[-1][0] == "admit o (hit 8)"


def test_the_fast_path_skips_the_core_call() -> None:
    """The decode steps inside one block make no core call (what the fast path is for)."""
    run = _Run("pagedkv", lookahead_hasher=False)
    core = run.m._core
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(core, name)
            if callable(attr) and name in ("allocate_slots", "provide_token_ids"):

                def counted(*args: Any, **kwargs: Any) -> Any:
                    calls.append(name)
                    return attr(*args, **kwargs)

                return counted
            return attr

    run.m._core = Counting()
    r = run.request("r", [1, 2, 3, 4, 5])
    run.admit(r)
    r.append_output_token_ids(6)
    for _ in range(7):  # 5 + 1 ... 11 + 1: tokens 5, 6, 7 (block 1), 8 .. 11 (block 2)
        run.step(r)
    # the fills of blocks 1 (7 + 1) and 2 (11 + 1), each with its ids, and block 2's slots
    # (8 + 1); the four other steps make no core call (each made one allocate_slots before)
    fill = ["allocate_slots", "provide_token_ids"]
    assert calls == [*fill, "allocate_slots", *fill]
