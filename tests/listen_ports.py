"""A port for a test's listener that nothing else will take before the listener binds it.

Asking the kernel for port 0 and closing the socket hands back a port from the ephemeral range,
which the kernel also gives, unasked, to the outgoing connections the next lines open (NIXL's
UCX backend opens several while an agent starts). A listener started on such a port a moment
later can find it taken ("Failed to bind metadata listener socket"). A port below the ephemeral
range is never handed out that way, so the window between choosing and binding only matters
against another listener choosing the same random port.
"""

from __future__ import annotations

import random
import socket

_FALLBACK_EPHEMERAL_LOW = 32768
_LOWEST_PORT = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def free_port() -> int:
    """A port below the ephemeral range that is free on 127.0.0.1 now (bound and released)."""
    high = _ephemeral_low()
    low = min(_LOWEST_PORT, high // 2)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in [{low}, {high}) after 200 tries")
