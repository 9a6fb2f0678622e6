"""The prefill and decode engines in processes of their own, driven over pipes
(docs/transfer.md, The engine): ``DisaggWorkers`` starts both, ``prefill`` and ``decode`` serve one
request through each, ``stats`` reads their counters, ``kill`` ends one (what the failure tests do).

The pipes carry control only (a prompt, the prefill side's ``kv_transfer_params``, the tokens);
the K/V travel over NIXL, read by the decode process from the prefill process's caches.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from pagedkv.errors import PagedKvError, WorkerError

__all__ = ["DisaggWorkers", "WorkerError"]


def _serve(
    conn: Connection, role: str, model_name: str | None, options: dict[str, Any], lease_s: float
) -> None:
    """A worker's loop: take requests off the pipe, step the engine, send results back."""
    from pagedkv.disagg.decode_engine import DecodeEngine
    from pagedkv.disagg.prefill_engine import PrefillEngine
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.params import SamplingParams
    from pagedkv.models import load_model
    from pagedkv.models.blas_threads import limit_blas_threads

    limit_blas_threads(1)
    model = load_model(model_name)
    config = EngineConfig(kv_role=role, **options)  # type: ignore[arg-type]
    engine: PrefillEngine | DecodeEngine = (
        PrefillEngine(model, config, lease_s=lease_s) if role == "prefill" else DecodeEngine(model, config)
    )
    conn.send(("ready", os.getpid()))
    waiting: set[int] = set()
    try:
        while True:
            busy = engine.has_unfinished()
            if conn.poll(0 if busy else 0.002):
                message = conn.recv()
                kind = message[0]
                if kind == "stop":
                    break
                if kind == "stats":
                    conn.send(("stats", _stats(engine, float(message[1]))))
                    continue
                _, request_id, ids, sampling, params = message
                try:
                    sp = SamplingParams(**sampling)
                    if isinstance(engine, DecodeEngine):
                        engine.add_request(ids, sp, request_id, kv_transfer_params=params)
                    else:
                        engine.add_request(ids, sp, request_id)
                except PagedKvError as error:
                    conn.send(("error", request_id, f"{type(error).__name__}: {error}"))
                    continue
                waiting.add(request_id)
            if engine.has_unfinished():
                engine.step()
            elif isinstance(engine, PrefillEngine):
                engine.poll_transfers()
            for request_id in [r for r in waiting if engine.requests[r].finished]:
                waiting.discard(request_id)
                conn.send(("done", request_id, _result(engine, request_id)))
    finally:
        engine.close()


def _result(engine: Any, request_id: int) -> dict[str, Any]:
    output = engine.output(request_id)
    out: dict[str, Any] = {"tokens": output.outputs[0].token_ids, "error": output.error}
    if hasattr(engine, "offered"):
        out["kv_transfer_params"] = engine.offered.pop(request_id, None)
    if hasattr(engine, "transfers"):
        record = engine.transfers.get(request_id)
        out["transfer"] = None if record is None else asdict(record)
    return out


def _stats(engine: Any, drain_s: float) -> dict[str, Any]:
    """The engine's transfer counters; a prefill side first waits up to ``drain_s`` for its
    pending transfers to be released (read, abandoned or expired)."""
    if hasattr(engine, "source"):
        deadline = time.monotonic() + drain_s
        while engine.num_pending_transfers and time.monotonic() < deadline:
            engine.poll_transfers()
            time.sleep(0.002)
        pending = engine.source.pending
        return {
            "pending_transfers": engine.num_pending_transfers,
            "leaked_blocks": engine.leaked_blocks,
            "blocks_offered": engine.source.blocks_offered,
            "late_notifications": pending.late_notifications,
        }
    return {
        "blocks_sent": engine.blocks_sent,
        "blocks_skipped": engine.blocks_skipped,
        "blocks_failed": int(engine.sink.blocks_failed),
        "transfer_errors": [f"{type(e).__name__}: {e}" for e in engine.transfer_errors],
        "blocks_in_use": engine.kv.num_blocks - engine.kv.num_free_blocks,
    }


class DisaggWorkers:
    """A prefill and a decode process on this machine, one model, the same engine options.
    ``timeout_s`` bounds every answer; a dead or silent worker is a ``WorkerError``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        lease_s: float = 30.0,
        timeout_s: float = 120.0,
        **engine_options: Any,
    ) -> None:
        self.model, self.lease_s, self.timeout_s, self.options = model, lease_s, timeout_s, engine_options
        self._ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Connection] = {}
        try:
            for role in ("prefill", "decode"):
                self.start(role)
        except BaseException:
            self.close()
            raise

    def start(self, role: str) -> None:
        """(Re)start the ``role`` worker and wait until its engine is up."""
        ours, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_serve, args=(theirs, role, self.model, self.options, self.lease_s), daemon=True
        )
        proc.start()
        theirs.close()
        self.procs[role], self.conns[role] = proc, ours
        self._recv(role, "ready")

    def _recv(self, role: str, kind: str) -> Any:
        conn, proc = self.conns[role], self.procs[role]
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if conn.poll(0.05):
                    message = conn.recv()
                    if message[0] == "error":
                        return {"tokens": [], "error": message[2]}
                    if message[0] != kind:
                        raise WorkerError(f"the {role} worker answered {message[0]!r}, not {kind!r}")
                    return message[-1]
            except (EOFError, OSError) as error:
                raise WorkerError(f"the {role} worker is gone ({error})") from error
            if not proc.is_alive():
                raise WorkerError(f"the {role} worker died (exit code {proc.exitcode})")
        raise WorkerError(f"the {role} worker did not answer {kind!r} within {self.timeout_s} s")

    def prefill(self, request_id: int, ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        """Run the prompt on the prefill worker: its result carries ``kv_transfer_params``."""
        self.conns["prefill"].send(("request", request_id, list(ids), sampling, None))
        return dict(self._recv("prefill", "done"))

    def send_decode(
        self, request_id: int, ids: list[int], sampling: dict[str, Any], params: dict[str, Any] | None
    ) -> None:
        self.conns["decode"].send(("request", request_id, list(ids), sampling, params))

    def decode(
        self, request_id: int, ids: list[int], sampling: dict[str, Any], params: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Generate on the decode worker from the prefill side's params."""
        self.send_decode(request_id, ids, sampling, params)
        return dict(self._recv("decode", "done"))

    def stats(self, role: str, drain_s: float = 0.0) -> dict[str, Any]:
        self.conns[role].send(("stats", drain_s))
        return dict(self._recv(role, "stats"))

    def kill(self, role: str) -> None:
        """SIGKILL the ``role`` worker (no clean-up of any kind) and wait for it to go."""
        proc = self.procs[role]
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        for proc in self.procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns.values():
            conn.close()

    def __enter__(self) -> DisaggWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
