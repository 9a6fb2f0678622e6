"""The command line on bad input: a one-line error naming the file:line, request or option,
exit code 2, never a traceback. Also every subcommand's --help."""

from __future__ import annotations

from pathlib import Path

import pytest
from pagedkv import cli

HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = b"2023-11-16 18:15:46.6805900,10,5\n"

# (file bytes, the text the error must contain); {name} is the file's name.
BAD_TRACES = {
    "not utf-8 in the header": (b"\xff\xfe\x00garbage", "{name}:1: not UTF-8"),
    "not utf-8 in a row": (HEADER + ROW + b"2023-11-16 18:15:47,1\xff0,5\n", "{name}:3: not UTF-8"),
    "huge length": (
        HEADER + b"2023-11-16 18:15:46,99999999999999999999999,5\n",
        "{name}:2: length out of range",
    ),
    "huge negative length": (
        HEADER + b"2023-11-16 18:15:46,5,-99999999999999999999999\n",
        "{name}:2: length out of range",
    ),
    "negative length": (HEADER + b"2023-11-16 18:15:46,-5,44\n", "{name}:2: negative length"),
    "not a number": (
        HEADER + ROW + b"2023-11-16 18:15:47,abc,44\n",
        "{name}:3: token counts must be integers",
    ),
    "float length": (HEADER + b"2023-11-16 18:15:46,1e3,5\n", "{name}:2: token counts must be integers"),
    "short row": (HEADER + b"2023-11-16 18:15:46,10\n", "{name}:2: expected 3"),
    "bad timestamp": (HEADER + b"notatime,10,5\n", "{name}:2: bad TIMESTAMP"),
    "empty": (b"", "{name}: empty file"),
    "wrong header": (b"a,b\n1,2\n", "{name}:1: expected the header"),
    "header only": (HEADER, "{name}: no requests"),
    "larger than the pool": (HEADER + b"2023-11-16 18:15:46,100000,44\n", "request 0"),
}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse errors and --help
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


@pytest.mark.parametrize("case", sorted(BAD_TRACES))
@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_bad_trace_files(case: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content, expected = BAD_TRACES[case]
    path = tmp_path / "trace.csv"
    path.write_bytes(content)
    code, err = run([command, "--workload", str(path), "--no-progress"], capsys)
    assert code == 2
    assert expected.format(name=path.name) in err, err


def test_utf8_bom_and_crlf_traces_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + ROW + ROW).replace(b"\n", b"\r\n"))
    code, _ = run(["simulate", "--workload", str(path), "--no-progress"], capsys)
    assert code == 0


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["simulate", "--workload", "missing.csv"], "does not exist"),
        (["simulate", "--workload", "nothing"], "--workload: expected one of synthetic"),
        (["simulate", "--arrival", "bogus"], "--arrival"),
        (["simulate", "--arrival", "poisson:"], "--arrival"),
        (["simulate", "--arrival", "poisson:-1"], "--arrival"),
        (["simulate", "--arrival", "poisson:inf"], "--arrival"),
        (["simulate", "--arrival", "poisson:nan"], "--arrival"),
        (["simulate", "--block-size", "0"], "--block-size"),
        (["simulate", "--num-slots", "-5"], "--num-slots"),
        (["simulate", "--num-slots", "10"], "num_slots 10"),
        (["simulate", "--max-model-len", "0"], "--max-model-len"),
        (["simulate", "--step-time", "inf"], "--step-time"),
        (["simulate", "--seed", "-1"], "--seed"),
        (["simulate", "--seed", str(2**64)], "--seed"),
        (["simulate", "--num-requests", str(10**20)], "--num-requests"),
        (["simulate", "--num-host-slots", "-5"], "--num-host-slots"),
        (["simulate", "--workload", "lognormal", "--prompt-sigma", "1e308"], "spreads"),
        (["simulate", "--workload", "lognormal", "--prompt-mean", "inf"], "--prompt-mean"),
        (["simulate", "--json", "/nonexistent/dir/x.json"], "does not exist"),
        (["sweep", "--block-size", "0"], "--block-size"),
        (["viz", "--seed", "-1"], "--seed"),
        (["viz", "--seeds", "1,x"], "--seeds"),
        (["demo", "--seed", "-1"], "--seed"),
    ],
)
def test_bad_options(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run([*argv, "--no-progress"] if argv[0] == "simulate" else argv, capsys)
    assert code == 2
    assert expected in err, err


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    assert {"demo", "simulate", "sweep", "compare", "viz"} <= set(commands)
    for command in [[], *([name] for name in commands)]:
        code, _ = run([*command, "--help"], capsys)
        assert code == 0, command
