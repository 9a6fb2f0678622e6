"""Shared pieces of the offload tests: a realistic block shape, a real ``redis-server``."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from listen_ports import free_port

# A realistic block: SmolLM2-135M, 30 layers x (K, V) x 16 tokens x 3 KV heads x 64 dims, fp32.
SMOLLM2_BLOCK_SHAPE = (30, 2, 16, 3, 64)


class RedisServer:
    """A ``redis-server`` without persistence that a test may kill and start again (same port,
    empty data: what a restart of a cache server looks like)."""

    def __init__(self, binary: str, workdir: Path):
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(500):  # up to ~10 s on a loaded machine
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
