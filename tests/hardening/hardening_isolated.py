"""Runs attacker inputs in a child interpreter, so that an abort or a segfault fails one test
instead of killing pytest.

``run_cases(setup, cases)`` executes ``setup`` and then each ``name: expression`` case in one
child process; each case is an expression evaluated under the setup's names, and the child
prints one line per case: ``name<TAB>OK`` or ``name<TAB>ExceptionClassName``. A child that dies
(signal, abort) reports the case it died in. Cases run in one process to keep the tests fast
(one interpreter start, one NumPy import).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_DRIVER = """
import sys
_cases = {cases!r}
for _name, _expr in _cases:
    print("START\\t" + _name, flush=True)
    try:
        eval(_expr)
    except BaseException as _exc:  # noqa: BLE001 - the parent judges every outcome
        print(_name + "\\t" + type(_exc).__name__, flush=True)
    else:
        print(_name + "\\tOK", flush=True)
"""


class ChildDied(AssertionError):
    """The child interpreter died (abort, segfault, OOM kill) instead of raising."""


def run_cases(setup: str, cases: dict[str, str], *, timeout_s: float = 120.0) -> dict[str, str]:
    """Outcome per case name: ``"OK"`` or the exception class name. Raises ``ChildDied`` naming the
    case that killed the child."""
    script = textwrap.dedent(setup) + _DRIVER.format(cases=list(cases.items()))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    outcomes: dict[str, str] = {}
    current = None
    for line in proc.stdout.splitlines():
        head, _, tail = line.partition("\t")
        if head == "START":
            current = tail
        elif head in cases:
            outcomes[head] = tail
            current = None
    if proc.returncode != 0:
        raise ChildDied(
            f"child exited with status {proc.returncode} during case {current!r}; "
            f"stderr tail: {proc.stderr[-2000:]}"
        )
    return outcomes
