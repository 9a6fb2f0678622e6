"""``evict_blocks`` (vLLM's manager and ``block_pool``): blocks dropped from the prefix cache
by id, as vLLM's scheduler does after a KV connector's failed sync load under the "fail"
policy (python/pagedkv/integrations/vllm/evict.py). Each scenario runs the same calls on
vLLM's own manager and on pagedkv's, with KV events on, and after every call the answers, the
events handed over, the free blocks and the prefix-cache hits of probes must agree (pagedkv's
``check_invariants`` after every call too). Hostile ids: pagedkv raises a typed error and
changes nothing. Runs in the vLLM stage (scripts/vllm/stage.sh); skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest

# Imported inside the tests; the folder's conftest.py skips them where these do not import.
NEEDS_VLLM = ("pagedkv.integrations.vllm", "vllm.v1.core.kv_cache_manager")

BS = 4
NUM_BLOCKS = 24


class _Run:
    """One manager driven by a scenario, noting after every call what both must agree on."""

    def __init__(self, kind: str) -> None:
        import torch
        from pagedkv.integrations.vllm import KVCacheManager
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
        )
        args: dict[str, Any] = dict(
            max_model_len=64, scheduler_block_size=BS, hash_block_size=BS, enable_kv_cache_events=True
        )
        cls = VllmKVCacheManager if kind == "vllm" else KVCacheManager
        self.m = cls(config, enable_caching=True, **args)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.seen: list[tuple[Any, ...]] = []
        self.requests: dict[str, Any] = {}

    def request(self, rid: str, prompt: list[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=self.hasher)

    def note(self, what: str, answer: Any = None) -> None:
        hits = [self.m.get_computed_blocks(self.request("probe", p))[1] for p in _PROBES]
        events = [_event(e) for e in self.m.take_events()]
        self.seen.append((what, answer, self.m.block_pool.get_num_free_blocks(), hits, events))
        if hasattr(self.m, "check_invariants"):
            self.m.check_invariants()

    def admit(self, rid: str, prompt: list[int]) -> None:
        from vllm.v1.request import RequestStatus

        r = self.request(rid, prompt)
        blocks, hit = self.m.get_computed_blocks(r)[:2]
        got = self.m.allocate_slots(r, r.num_tokens - hit, hit, blocks, full_sequence_must_fit=True)
        assert got is not None
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = r.num_tokens
        self.requests[rid] = r
        self.note(f"admit {rid}", hit)

    def free(self, rid: str) -> None:
        self.m.free(self.requests.pop(rid))
        self.note(f"free {rid}")

    def ids(self, rid: str) -> list[int]:
        return list(self.m.get_block_ids(rid)[0])

    def evict(self, what: str, block_ids: set[int], through_pool: bool = False) -> None:
        """``what`` names the blocks by position: the two pools number them alike only until
        blocks are freed (their free lists are ordered differently)."""
        target = self.m.block_pool if through_pool else self.m
        self.note(f"evict {what}", target.evict_blocks(block_ids))


def _event(e: Any) -> tuple[Any, ...]:
    return (type(e).__name__, tuple(getattr(e, "block_hashes", ())), getattr(e, "group_idx", None))


PROMPT_A = list(range(1, 4 * BS + 3))  # 4 full blocks and a partial one
PROMPT_B = [*PROMPT_A[: 2 * BS], *range(500, 500 + 2 * BS + 1)]  # shares A's first 2 blocks
_PROBES = [[*PROMPT_A, 0], [*PROMPT_B, 0]]


def _same(scenario: Any) -> list[tuple[Any, ...]]:
    runs = {kind: _Run(kind) for kind in ("vllm", "pagedkv")}
    for run in runs.values():
        scenario(run)
    assert runs["pagedkv"].seen == runs["vllm"].seen
    return runs["pagedkv"].seen


def test_held_blocks_stay_with_their_holders_and_leave_the_index() -> None:
    """Blocks two running requests hold (one by a hit): dropped from the index, with one
    ``BlockRemoved`` each, in the set's order; their holders keep them; once freed they are
    free blocks, never a hit; a later admission of the same prompt computes them again."""

    def scenario(run: _Run) -> None:
        run.admit("a", PROMPT_A)
        run.admit("b", PROMPT_B)  # hits A's first two blocks
        a = run.ids("a")
        run.evict("a 1-3", {a[1], a[2], a[3]})  # block 1 shared with b, 2 and 3 a's alone
        assert run.ids("a") == a
        run.free("a")
        run.free("b")
        run.admit("c", PROMPT_A)  # hits block 0 only; its blocks 1.. are indexed anew
        run.evict("c 1", {run.ids("c")[1]}, through_pool=True)
        run.free("c")

    seen = _same(scenario)
    evicts = [s for s in seen if s[0].startswith("evict")]
    assert [len(s[-1]) for s in evicts] == [3, 1]  # one BlockRemoved per block
    assert evicts[0][3] == [BS, BS]  # both probes stop after block 0


def test_cached_blocks_become_free_and_others_are_left_alone() -> None:
    """Cached-evictable blocks (a freed request's) become free blocks (the free count stays:
    vLLM counts cached blocks free); blocks without a hash (the null block, a never used one,
    a partial block, one named twice in two calls) change nothing and report nothing."""

    def scenario(run: _Run) -> None:
        run.admit("a", PROMPT_A)
        a = run.ids("a")
        run.free("a")
        # a[4] is the partial block: no hash. (Evicting a[2] alone would leave a[3]'s copy
        # indexed, and b below would index a second copy in vLLM: the explained difference of
        # docs/conformance.md, Duplicate copies. vLLM's scheduler evicts every block after
        # the first invalid one.)
        run.evict("a 2-4", {a[2], a[3], a[4]})
        # Nothing indexed among them: the null block, one dropped already, one never used.
        run.evict("null, a 2, last", {0, a[2], NUM_BLOCKS - 1}, through_pool=True)
        run.evict("none", set())
        run.admit("b", PROMPT_A)  # hits blocks 0 and 1, computes the rest
        run.free("b")

    seen = _same(scenario)
    assert [len(s[-1]) for s in seen if s[0].startswith("evict")] == [2, 0, 0]


def test_bad_ids_are_typed_errors_that_change_nothing() -> None:
    """vLLM asserts an id is below its pool (and would read a negative id from the end of its
    block list); pagedkv refuses both, and a non-integer, by ``InvalidArgumentError`` before
    any block leaves the index."""
    from pagedkv.errors import InvalidArgumentError

    run = _Run("pagedkv")
    run.admit("a", PROMPT_A)
    a = run.ids("a")
    before = run.seen[-1][2:]
    for bad in ({a[1], NUM_BLOCKS}, {a[1], -1}, {a[1], 2**40}, [a[1], "x"], "ab", {a[1], 1.5}):
        with pytest.raises(InvalidArgumentError):
            run.m.evict_blocks(bad)
        run.note(f"refused {bad!r}")
        assert run.seen[-1][2:4] == before[:2] and run.seen[-1][4] == []
    vllm = _Run("vllm")
    with pytest.raises(AssertionError):
        vllm.m.evict_blocks({NUM_BLOCKS})
