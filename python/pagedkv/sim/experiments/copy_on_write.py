"""Copy-on-write in one picture: samples forked from one prompt share its blocks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedkv.sim.reports import Percent, format_table


def copy_on_write(
    *, prompt_tokens: int = 1000, num_samples: int = 4, generated_tokens: int = 100, block_size: int = 16
) -> dict:
    """``num_samples`` samples forked from one prompt hold the prompt's blocks once; decoding
    copies only the shared, partly filled last block (once per sample but the last)."""
    import pagedkv

    blocks_per_prompt = -(-prompt_tokens // block_size)
    manager = pagedkv.KvCacheManager(
        num_blocks=num_samples * (blocks_per_prompt + generated_tokens // block_size + 2),
        block_size=block_size,
    )
    manager.add_sequence(0, num_tokens=prompt_tokens)
    for sample in range(1, num_samples):
        manager.fork(0, sample)
    manager.check_invariants()
    samples = list(range(num_samples))
    after_fork = manager.stats()["num_blocks_in_use"]
    shared_refcount = manager.refcount(int(manager.block_table(0)[0]))
    for _ in range(generated_tokens):
        manager.append_tokens_batch(samples, num_tokens=1)
    manager.check_invariants()
    copies = manager.take_copy_ops()
    after_decode = manager.stats()["num_blocks_in_use"]
    unshared_after_decode = sum(-(-manager.num_tokens(sample) // block_size) for sample in samples)
    stages = [
        {
            "stage": f"prompt forked into {num_samples} samples",
            "tokens_per_sample": prompt_tokens,
            "blocks_in_use": after_fork,
            "cache_token_slots": after_fork * block_size,
            "unshared_blocks": num_samples * blocks_per_prompt,
        },
        {
            "stage": f"after {generated_tokens} tokens per sample",
            "tokens_per_sample": prompt_tokens + generated_tokens,
            "blocks_in_use": after_decode,
            "cache_token_slots": after_decode * block_size,
            "unshared_blocks": unshared_after_decode,
        },
    ]
    return {
        "prompt_tokens": prompt_tokens,
        "num_samples": num_samples,
        "block_size": block_size,
        "first_block_refcount_after_fork": shared_refcount,
        "copy_ops": copies.tolist(),
        "stages": stages,
    }


def render_copy_on_write(data: Mapping[str, Any]) -> str:
    rows = [
        [
            stage["stage"],
            stage["tokens_per_sample"],
            stage["blocks_in_use"],
            stage["cache_token_slots"],
            stage["unshared_blocks"] * data["block_size"],
            Percent(1 - stage["blocks_in_use"] / stage["unshared_blocks"]),
        ]
        for stage in data["stages"]
    ]
    return format_table(
        ["stage", "tokens/sample", "blocks in use", "cache slots", "slots if unshared", "saved"],
        rows,
        title=(
            f"Copy-on-write: {data['num_samples']} samples of a {data['prompt_tokens']}-token prompt "
            f"(block size {data['block_size']}, real KvCacheManager)"
        ),
        note=(
            f"Prompt blocks have refcount {data['first_block_refcount_after_fork']}; decoding copied "
            f"{len(data['copy_ops'])} shared partial block(s) (src, dst): {data['copy_ops']}"
        ),
    )
