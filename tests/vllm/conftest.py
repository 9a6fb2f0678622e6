"""Shared setup of the tests that drive vLLM 0.33 (the vLLM stage, scripts/vllm/stage.sh).

The differentials live in ``benches/`` as scripts (they also run by hand at benchmark scale);
the tests load them by path, so they import from an installed pagedkv without the checkout on
``sys.path``. ``vllm_scheduler`` is ``benches/vllm_scheduler.py`` once vLLM's scheduler and
pagedkv's drop-in manager both import; elsewhere the test that asks for it is skipped with a
reason the suite's skip rule allows (tests/conftest.py, ALLOWED_SKIPS).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"

# The folder's shared helpers (vllm_test_inputs.py) import by name whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))


def _load_bench(name: str) -> ModuleType:
    """``benches/<name>.py`` as a module (registered in ``sys.modules``: dataclasses resolve
    their annotations through it)."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(BENCHES / f"{name}.py"):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _importable(names: tuple[str, ...]) -> bool:
    try:
        for name in names:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 (a broken partial install skips as well)
        return False
    return True


def _scheduler_importable() -> bool:
    return _importable(("pagedkv.integrations.vllm", "vllm.v1.core.sched.scheduler"))


VLLM_SCHEDULER_MISSING = (
    "vLLM 0.33's scheduler (and torch) not importable: runs in the vLLM stage (scripts/vllm/stage.sh)"
)


@pytest.fixture(scope="session")
def load_bench() -> Callable[[str], ModuleType]:
    """Loads a script of ``benches/`` by name (its module-level code needs only pagedkv)."""
    return _load_bench


@pytest.fixture(scope="session")
def vllm_scheduler() -> ModuleType:
    """``benches/vllm_scheduler.py``, with vLLM's scheduler and pagedkv's drop-in importable."""
    if not _scheduler_importable():
        pytest.skip(VLLM_SCHEDULER_MISSING)
    return _load_bench("vllm_scheduler")


@pytest.fixture(autouse=True)
def _needs_vllm(request: pytest.FixtureRequest) -> None:
    """Skips every test of a module whose ``NEEDS_VLLM`` names modules (vLLM's, pagedkv's
    drop-in) that do not import here: its tests import them inside, and run in the vLLM stage."""
    needed = getattr(request.module, "NEEDS_VLLM", ())
    if needed and not _importable(tuple(needed)):
        pytest.skip(VLLM_SCHEDULER_MISSING)
