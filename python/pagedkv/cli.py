"""The ``pagedkv`` command line."""

from __future__ import annotations

import argparse
import sys

import pagedkv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pagedkv {pagedkv.__version__}")
    parser.add_subparsers(dest="command")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
