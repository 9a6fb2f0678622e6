"""Child process of the GGUF loader tests: loads many corrupted copies of a GGUF file under an
address-space limit and reports each outcome, so that a hang or a memory bomb fails one test
(the parent's timeout, the limit) instead of hanging or killing CI.

``python gguf_load_child.py SPEC.json``; the spec holds ``base`` (a GGUF file), ``scratch`` (a
path to write each case to), ``extra_bytes`` (address space allowed above what the warmed-up
child already maps) and ``cases``: ``[name, kind, *args]`` with kind ``truncate`` (length),
``flip`` (byte offset, bit), ``patch`` (byte offset, hex bytes) or ``bytes`` (hex of the whole
file). One line per case: ``START<TAB>name`` before it, then
``name<TAB>outcome<TAB>cause<TAB>kib`` where outcome is ``OK`` or the exception class, cause the
class of its ``__cause__`` (or ``-``) and kib the growth of the peak resident size so far.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path


def _mutate(base: bytes, kind: str, args: list) -> bytes:
    if kind == "truncate":
        return base[: args[0]]
    if kind == "flip":
        offset, bit = args
        return base[:offset] + bytes([base[offset] ^ (1 << bit)]) + base[offset + 1 :]
    if kind == "patch":
        offset, raw = args[0], bytes.fromhex(args[1])
        return base[:offset] + raw + base[offset + len(raw) :]
    if kind == "bytes":
        return bytes.fromhex(args[0])
    raise ValueError(f"unknown case kind {kind!r}")


def _mapped_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from pagedkv.models import load_model

    base = Path(spec["base"]).read_bytes()
    load_model(spec["base"])  # warm up: the first load imports gguf, tokenizers, jinja2
    if _mapped_bytes():
        limit = _mapped_bytes() + int(spec["extra_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scratch = Path(spec["scratch"])
    for name, kind, *args in spec["cases"]:
        scratch.write_bytes(_mutate(base, kind, args))
        print(f"START\t{name}", flush=True)
        try:
            load_model(scratch)
            outcome, cause = "OK", "-"
        except BaseException as error:  # noqa: BLE001 - the parent judges every outcome
            outcome = type(error).__name__
            cause = type(error.__cause__).__name__ if error.__cause__ is not None else "-"
            if not isinstance(error, Exception):
                raise
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0
        print(f"{name}\t{outcome}\t{cause}\t{growth}", flush=True)


if __name__ == "__main__":
    main()
