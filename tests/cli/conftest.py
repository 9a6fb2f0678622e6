"""Shared helpers of the CLI tests: run `pagedkv` in-process, capture its output."""

import json

import pytest
from pagedkv import cli


class Run:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def run_cli(capsys):
    def run(*argv):
        code = cli.main([str(arg) for arg in argv])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run


@pytest.fixture
def read_json():
    def read(path):
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)

    return read
