"""Every CLI command with standard output closed (``pagedkv demo >&-``).

Python starts with ``sys.stdout = None`` then; every ``print`` silently did nothing, the command
ran to the end and died on ``sys.stdout.flush()`` with an AttributeError traceback (exit 1). Now:
one line on stderr and exit status 2, before any work.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from pagedkv import cli

CLOSED = "pagedkv: error: standard output is closed"


def command_names() -> list[str]:
    parser = cli.build_parser()
    choices = next(a.choices for a in parser._actions if getattr(a, "choices", None))
    return sorted(choices)


def test_every_command_refuses_a_closed_stdout_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdout", None)
    names = command_names()
    assert {"demo", "costmodel", "simulate", "cluster", "generate", "bench-engine"} <= set(names)
    for argv in [[name] for name in names] + [["--version"], ["--help"], []]:
        assert cli.main(argv) == 2, argv
        assert capsys.readouterr().err == CLOSED + "\n", argv


@pytest.mark.parametrize("argv", [["demo"], ["costmodel"], ["simulate", "--max-steps", "5"], ["--version"]])
def test_closed_stdout_gives_one_line_and_a_nonzero_exit(argv: list[str]) -> None:
    shell = 'exec "$0" -m pagedkv "$@" >&-'  # fd 1 closed in the child, as the shell does
    process = subprocess.run(
        ["/bin/sh", "-c", shell, sys.executable, *argv], capture_output=True, text=True, timeout=120
    )
    assert process.returncode == 2
    assert process.stderr == CLOSED + "\n"  # one line, no traceback
