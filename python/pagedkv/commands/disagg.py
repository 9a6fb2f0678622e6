"""``pagedkv disagg``: prompts through a prefill and a decode process on this machine, their K/V
moved over NIXL, each request's tokens compared with one instance's (docs/transfer.md)."""

from __future__ import annotations

import json
import sys
from typing import Any

from pagedkv.commands import args as cli_args
from pagedkv.commands.args import CliError
from pagedkv.commands.output import check_json_path, write_json

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add ``disagg`` to the ``pagedkv`` subparsers."""
    p = subparsers.add_parser(
        "disagg",
        help="serve prompts through a prefill and a decode process (KV over NIXL), vs one instance",
    )
    p.add_argument(
        "--prompts", required=True, metavar="FILE.json", help='{"prompts": [text or token ids, ...]}'
    )
    p.add_argument("--model", default=None, help="a GGUF file or gemma3 (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=cli_args.positive_int, default=16, help="greedy tokens per prompt")
    p.add_argument("--num-blocks", type=cli_args.positive_int, default=512, help="blocks per instance")
    p.add_argument("--json", required=True, metavar="OUT", help="write the per-request report here")
    p.set_defaults(handler=_disagg)


def _disagg(args: Any) -> int:
    from pagedkv.disagg.serve import read_prompts, serve_prompts

    check_json_path(args.json)
    try:
        with open(args.prompts, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CliError(f"--prompts {args.prompts!r}: {error}") from error
    prompts = read_prompts(document)
    report = serve_prompts(prompts, model=args.model, max_tokens=args.max_tokens, num_blocks=args.num_blocks)
    write_json(args.json, report)
    equal = sum(r["equal"] for r in report["requests"])
    print(
        f"{equal}/{len(report['requests'])} requests equal to one instance; "
        f"{report['blocks_sent']} blocks sent, {report['blocks_skipped']} skipped (held already), "
        f"{report['leaked_blocks']} leaked",
        file=sys.stderr,
    )
    return 0 if report["all_equal"] and report["leaked_blocks"] == 0 else 1
