"""``pagedkv._core`` loads on first use: the kernels and their launchers import without it.

A prebuilt extension carried to a GPU machine with an older C library fails to load; the kernel
tests and benchmarks there need none of it, so ``import pagedkv`` and ``import pagedkv.attention``
must not load it, while the public names stay the same objects wherever it does load.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pagedkv
import pytest

CORE_NAMES = [
    "__version__",
    "BlockHandle",
    "BlockPool",
    "KvCacheManager",
    "FullAttention",
    "SlidingWindow",
    "MambaState",
]


def test_public_names_are_the_extensions_own() -> None:
    from pagedkv import _core

    for name in CORE_NAMES:
        assert getattr(pagedkv, name) is getattr(_core, name)
        assert name in pagedkv.__all__ and name in dir(pagedkv)
    namespace: dict[str, object] = {}
    exec("from pagedkv import *", namespace)
    assert set(pagedkv.__all__) <= set(namespace)
    kv = pagedkv.KvCacheManager(num_blocks=4, block_size=2)
    kv.add_sequence(0, [1, 2, 3])
    assert kv.num_tokens(0) == 3
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        _ = pagedkv.NoSuchThing  # type: ignore[attr-defined]


# Run in a fresh interpreter where importing the extension fails as a glibc mismatch would.
WITHOUT_CORE = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.modules["pagedkv._core"] = None  # "import pagedkv._core" now raises ImportError

    import pagedkv
    import pagedkv.attention as attention
    import pagedkv.kernels.precompile, pagedkv.kernels.nvrtc, pagedkv.kernels.emulation
    import pagedkv.attention.runners, pagedkv.attention.workspace

    assert "pagedkv._core" not in {k for k, v in sys.modules.items() if v is not None}
    assert issubclass(pagedkv.InvalidArgumentError, ValueError)
    q = np.ones((1, 2, 64), np.float32)
    k = np.ones((1, 4, 2, 64), np.float32)
    tables, lens = np.zeros((1, 1), np.int32), np.array([3], np.int32)
    out = attention.paged_attention(q, k, k, tables, lens)  # the NumPy reference
    assert out.shape == (1, 2, 64)
    uses = (
        lambda: pagedkv.KvCacheManager,
        lambda: attention.paged_attention(q, k, k, tables, lens, backend="cpu"),
    )
    for use in uses:
        try:
            use()
        except ImportError as error:
            print("refused:", error)
        else:
            raise AssertionError("used the extension that does not load")
    print("ok")
    """
)


def test_the_package_imports_where_the_extension_does_not_load() -> None:
    run = subprocess.run([sys.executable, "-c", WITHOUT_CORE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "ok"
    assert "refused: pagedkv.KvCacheManager needs the compiled extension pagedkv._core" in lines[0]
    assert lines[1].startswith("refused:")
