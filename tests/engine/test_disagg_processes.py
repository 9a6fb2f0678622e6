"""Disaggregated serving across processes (docs/transfer.md, The engine): ``pagedkv disagg`` and
``DisaggWorkers`` run a prefill and a decode process on this machine, the K/V read over NIXL
from one process's caches into the other's. SmolLM2 and hybrid Gemma 3: every request's tokens
equal a single instance's, the blocks the decode side held are skipped and counted; the prefill
process killed once it has offered its blocks, and the decode process killed once it has the
request: no leaked block, no wrong token, typed errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("xxhash")
pytest.importorskip("nixl")

from pagedkv.disagg.serve import serve_prompts  # noqa: E402
from pagedkv.disagg.workers import DisaggWorkers  # noqa: E402

SAMPLING = {"max_tokens": 4}
BASE = list(range(100, 160))  # 60 tokens: 3 full blocks of 16 and a partial one


def single(model, prompt):
    from pagedkv.engine import LLM, SamplingParams

    with LLM(model, num_blocks=64) as llm:
        return llm.generate([prompt], SamplingParams(**SAMPLING))[0].outputs[0].token_ids


def test_the_disagg_command_smollm2(tmp_path, smollm):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps({"prompts": ["The capital of France is", BASE, BASE + list(range(300, 330))]})
    )
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "pagedkv", "disagg", "--prompts", str(prompts), "--max-tokens", "4"]
    done = subprocess.run(
        [*cmd, "--num-blocks", "64", "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    requests = report["requests"]
    assert [r["tokens"] == r["single_instance_tokens"] for r in requests] == [True] * 3
    assert all(len(r["tokens"]) == 4 for r in requests)
    # The third prompt's first 3 blocks are the second's: held by the decode side, not sent.
    assert [(r["blocks_sent"], r["blocks_skipped"]) for r in requests] == [(1, 0), (4, 0), (3, 3)]
    assert report["blocks_sent"] == 8 and report["blocks_skipped"] == 3
    assert report["leaked_blocks"] == 0 and report["pending_transfers"] == 0
    assert report["decode_blocks_in_use"] == 0 and report["transfer_errors"] == []


def test_hybrid_gemma3_two_processes(gemma3):
    prompts = ["The tallest mountain on Earth is", "The tallest mountain on Earth is Everest, and the"]
    report = serve_prompts(prompts, model="gemma3", max_tokens=3, num_blocks=96)
    assert [r["equal"] for r in report["requests"]] == [True, True]
    assert report["requests"][0]["blocks_sent"] > 0
    assert report["leaked_blocks"] == 0 and report["transfer_errors"] == []


def test_the_prefill_process_killed_after_offering(smollm):
    with DisaggWorkers(None, lease_s=30.0, num_blocks=64) as workers:
        warm = workers.prefill(0, BASE, SAMPLING)  # the decode side handshakes with this peer
        workers.decode(0, BASE, SAMPLING, warm["kv_transfer_params"])
        prompt = list(range(400, 470))
        offered = workers.prefill(1, prompt, SAMPLING)
        workers.kill("prefill")
        decoded = workers.decode(1, prompt, SAMPLING, offered["kv_transfer_params"])
        assert decoded["tokens"] == single(smollm, prompt)
        transfer = decoded["transfer"]
        assert transfer["blocks_read"] == 0 and transfer["tokens_received"] == 0
        assert transfer["error"].startswith("TransferError")
        stats = workers.stats("decode")
        assert stats["blocks_in_use"] == 0 and len(stats["transfer_errors"]) == 1


def test_the_decode_process_killed_with_the_request(smollm):
    with DisaggWorkers(None, lease_s=1.0, num_blocks=64) as workers:
        prompt = list(range(400, 470))
        offered = workers.prefill(0, prompt, SAMPLING)
        workers.send_decode(0, prompt, SAMPLING, offered["kv_transfer_params"])
        workers.kill("decode")
        stats = workers.stats("prefill", drain_s=3.0)  # read and done, or the lease: freed either way
        assert stats["pending_transfers"] == 0 and stats["leaked_blocks"] == 0
        workers.start("decode")  # a new decode process serves on
        again = workers.prefill(1, prompt, SAMPLING)
        decoded = workers.decode(1, prompt, SAMPLING, again["kv_transfer_params"])
        assert decoded["tokens"] == single(smollm, prompt) and decoded["transfer"]["error"] is None
        assert workers.stats("prefill", drain_s=3.0)["leaked_blocks"] == 0


def test_a_prompts_file_that_is_not_prompts_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    for document in ({"prompt": []}, {"prompts": []}, {"prompts": [1]}, {"prompts": [[1, "a"]]}):
        bad.write_text(json.dumps(document))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedkv",
                "disagg",
                "--prompts",
                str(bad),
                "--json",
                str(tmp_path / "out.json"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
