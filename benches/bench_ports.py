"""A free local TCP port for a bench's own listener (a Redis server, a transfer peer's NIXL
metadata listener): one helper for every bench.

The kernel picks it (bind to port 0, then close), so it comes from the ephemeral range, which
the kernel also hands to outgoing connections: one opened between this call and the listener's
bind can take it, and the bench then fails to start its listener (run it again). The test
suite cannot afford that and picks ports below the ephemeral range instead
(tests/listen_ports.py); a bench is run by hand, one at a time.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no socket on 127.0.0.1 is bound to now (it may be taken before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
