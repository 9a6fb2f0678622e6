"""`pagedkv._core.CacheAwareQueue`, the cache-aware waiting queue for a Python engine, against the
manager it follows: predicted hits equal `match_prefix` through random admissions, frees and
evictions; the choice is the longest prefix; the aging bound holds; bad input is refused."""

import random

import pytest
from pagedkv import KvCacheManager
from pagedkv._core import CacheAwareQueue, PromptHashes
from pagedkv.errors import InvalidArgumentError

BS = 4


def _prompt(rng: random.Random, request_id: int) -> list[int]:
    system = rng.randrange(3)
    shared = [1_000 * system + j for j in range(BS * rng.randrange(1, 4))]
    return shared + [10_000 + 100 * request_id + j for j in range(rng.randrange(1, 6))]


@pytest.mark.parametrize("feed", ["objects", "manager", "prompt", "held"])
@pytest.mark.parametrize("policy", ["lpm", "dfs"])
def test_queue_follows_the_manager(policy, feed):
    """``feed``: the events as objects (``apply_events(kv.take_events())``) or drained in Rust
    (``apply_manager_events(kv)``, the engine's path); ``prompt``: drained in Rust and each
    arrival pushed with its token ids (``push_prompt``, hashed in Rust); ``held``: drained in Rust,
    each arrival hashed once (``kv.prompt_hashes``) and its admission given the same hashes,
    whole-prompt or per chunk (``add_sequence(..., prompt_hashes=...)``)."""
    rng = random.Random(44)
    kv = KvCacheManager(num_blocks=24, block_size=BS, enable_prefix_caching=True, enable_kv_events=True)
    queue = CacheAwareQueue(policy, aging_bound=6)
    prompts: dict[int, list[int]] = {}
    held: dict[int, PromptHashes] = {}
    running: list[int] = []
    for request_id in range(300):
        prompt = _prompt(rng, request_id)
        if feed == "prompt":
            assert queue.push_prompt(request_id, kv, prompt) == request_id
        elif feed == "held":
            held[request_id] = kv.prompt_hashes(prompt)
            assert held[request_id].to_list() == kv.prefix_block_hashes(prompt)
            assert queue.push(request_id, held[request_id], (len(prompt) - 1) // BS) == request_id
        else:
            queue.push(request_id, kv.prefix_block_hashes(prompt), (len(prompt) - 1) // BS)
        prompts[request_id] = prompt
        choice = queue.peek()
        assert choice is not None
        if policy == "lpm":  # the longest cached prefix, unless the oldest request is due
            best = max(kv.match_prefix(p) for p in prompts.values())
            oldest = min(prompts, key=lambda i: queue.rank(i) or 0)
            assert kv.match_prefix(prompts[choice]) == best or choice == oldest
        while len(running) > 2 or (running and rng.random() < 0.3):
            kv.free(running.pop(rng.randrange(len(running))))
        if feed == "held":
            per_chunk = rng.random() < 0.5
            scheduled = rng.randrange(1, len(prompts[choice]) + 1) if per_chunk else None
            hit = kv.add_sequence(
                choice,
                prompts[choice],
                num_scheduled=scheduled,
                reserve_prompt=not per_chunk,
                prompt_hashes=held.pop(choice),
            )
            left = len(prompts[choice]) - kv.num_computed_tokens(choice)
            if left:
                assert kv.allocate_slots(choice, left)
            kv.check_invariants()
        else:
            hit = kv.add_sequence(choice, prompts[choice])
        assert hit == queue.hit_blocks(choice) * BS
        queue.admitted(choice)
        del prompts[choice]
        running.append(choice)
        if feed == "objects":
            queue.apply_events(kv.take_events())
        else:
            queue.apply_manager_events(kv)
            assert kv.take_events() == []
        queue.check_invariants()
        for i, p in prompts.items():
            assert queue.hit_blocks(i) * BS == kv.match_prefix(p)
    assert len(queue) == len(prompts)
    assert queue.stats()["max_passed_over"] <= 6 and queue.stats()["admissions"] == 300


def test_bad_input_is_refused():
    with pytest.raises(InvalidArgumentError, match="unknown scheduling"):
        CacheAwareQueue("random")
    queue = CacheAwareQueue("dfs", aging_bound=0)
    assert (queue.policy, queue.aging_bound, len(queue)) == ("dfs", 0, 0)
    with pytest.raises(InvalidArgumentError, match="block hashes"):
        queue.push(1, ["a"], 0)
    with pytest.raises(InvalidArgumentError, match="block hashes"):
        queue.push(1, [-1], 0)
    assert queue.push(1, [5, 6], 1) == 0
    with pytest.raises(InvalidArgumentError, match="already waiting"):
        queue.push(1, [5], 0)
    with pytest.raises(InvalidArgumentError, match="not waiting"):
        queue.admitted(2)
    with pytest.raises(InvalidArgumentError, match="expected pagedkv KV events"):
        queue.apply_events([object()])
    with pytest.raises(InvalidArgumentError, match="events must be a list"):
        queue.apply_events(None)
    assert queue.peek() == 1 and queue.remove(1) and not queue.remove(1)
    assert "CacheAwareQueue" in repr(queue)
    with pytest.raises(InvalidArgumentError, match="KvCacheManager"):
        queue.apply_manager_events([])
    with pytest.raises(InvalidArgumentError, match="KvCacheManager"):
        queue.push_prompt(7, [], [1, 2])
    kv = KvCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        queue.push_prompt(7, kv, ["x"])
    assert len(queue) == 0 and queue.push_prompt(7, kv, []) == 1 and queue.hit_blocks(7) == 0
    with pytest.raises(InvalidArgumentError, match="already waiting"):
        queue.push_prompt(7, kv, [1, 2, 3])


def test_prompt_hashes_are_checked():
    """``prompt_hashes``: a ``PromptHashes`` or a list of ints, no more than the prompt's full
    blocks, not with the caller's own ``block_hashes``; a refusal changes nothing."""
    kv = KvCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    held = kv.prompt_hashes([1, 2, 3, 4, 5])
    assert len(held) == 2 and "2 blocks" in repr(held)
    for bad in (kv.prompt_hashes([1, 2, 3, 4, 5, 6, 7]), [1, 2, 3]):
        for reserve in (True, False):
            with pytest.raises(InvalidArgumentError, match="prompt_hashes"):
                kv.add_sequence(1, [1, 2, 3, 4, 5], reserve_prompt=reserve, prompt_hashes=bad)
    with pytest.raises(InvalidArgumentError, match="prompt_hashes"):
        kv.add_sequence(1, [1, 2, 3, 4, 5], prompt_hashes="ab")
    with pytest.raises(InvalidArgumentError, match="prompt_hashes"):
        kv.add_sequence(1, [1, 2, 3, 4, 5], prompt_hashes=held, block_hashes=[1, 2])
    assert kv.num_sequences == 0
    kv.check_invariants()
    assert kv.add_sequence(1, [1, 2, 3, 4, 5], prompt_hashes=held) == 0
    assert kv.match_prefix([1, 2, 3, 4, 9], prompt_hashes=held) == 4
    assert (
        kv.add_sequence(
            2, [1, 2, 3, 4, 5], reserve_prompt=False, num_scheduled=1, prompt_hashes=held.to_list()
        )
        == 4
    )
    kv.check_invariants()
