"""The one stderr progress bar of the simulator, the experiments and the CLI (no dependency).

It stays silent for the first second, so quick runs print nothing, and draws only when stderr is
a terminal (or ``PAGEDKV_PROGRESS=1``), so logs and captured output stay clean.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Counts ``total`` units of work: ``update(n)`` after each, ``close()`` (or ``with``) at the end."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        delay_s: float = 1.0,
        width_chars: int = 30,
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        forced = os.environ.get("PAGEDKV_PROGRESS") == "1"
        is_tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._enabled = enabled and (forced or is_tty)
        self._delay_s = delay_s
        self._width_chars = width_chars
        self._start_s = time.perf_counter()
        self._drawn = False
        self._last_draw_s = 0.0

    def update(self, units: int = 1, note: str = "") -> None:
        """Count ``units`` more done; ``note`` says what (shown after the bar)."""
        self.update_to(self.done + units, note)

    def update_to(self, done: int, note: str = "") -> None:
        """Set the count of units done to ``done``."""
        self.done = min(self.total, max(0, int(done)))
        if not self._enabled:
            return
        now_s = time.perf_counter()
        elapsed_s = now_s - self._start_s
        # Redraw at most 10 times a second: a bar is for humans, not a benchmark of the terminal.
        if elapsed_s < self._delay_s or (now_s - self._last_draw_s < 0.1 and self.done < self.total):
            return
        self._last_draw_s = now_s
        filled = int(self._width_chars * self.done / self.total)
        bar = "#" * filled + "." * (self._width_chars - filled)
        suffix = f" {note}" if note else ""
        self._stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed_s:5.1f}s{suffix}\x1b[K")
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
