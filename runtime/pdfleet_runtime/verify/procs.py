"""Spawned processes driven over a pipe: the parent's handle (``RankProcess``) and the child's command loop.

Processes use the ``spawn`` context, are daemons, are driven by commands (tuples) over pipes with
timeouts, and exit on EOF (their parent died). ``RankProcess`` is also the building block of the
fault tests (kill, restart, hold input, stall a write). No torch here: the bootstrap host uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["RankProcess", "WorkerError", "guard", "serve_commands"]


class WorkerError(RuntimeError):
    """A rank or bootstrap process failed, died or did not answer in time."""


class RankProcess:
    """One spawned process and its command pipe."""

    def __init__(self, name: str, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()

    def send(self, *msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(f"{self.name} is gone: {e}") from e

    def recv(self, timeout_s: float, *, expect: str | None = None) -> tuple[Any, ...]:
        """The next message (skipping none); ``WorkerError`` on death, error or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.name} did not answer{' ' + expect if expect else ''} in {timeout_s:.0f}s")
            try:
                if not self.conn.poll(min(left, 0.5)):
                    if not self.proc.is_alive():
                        raise WorkerError(f"{self.name} died (exit code {self.proc.exitcode})")
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError) as e:
                raise WorkerError(f"{self.name} closed its pipe (exit code {self.proc.exitcode})") from e
            if msg[0] == "error":
                raise WorkerError(f"{self.name} failed:\n{msg[1]}")
            if expect is not None and msg[0] != expect:
                raise WorkerError(f"{self.name} answered {msg[0]!r}, expected {expect!r}")
            return tuple(msg)

    def kill(self) -> None:
        """SIGKILL, as a crashed pod would die (no cleanup, no goodbye)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def stop(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(WorkerError):
            self.send("exit")
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def guard(conn: Connection, body: Callable[[], None]) -> None:
    try:
        body()
    except (KeyboardInterrupt, EOFError):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise


async def serve_commands(conn: Connection, handle: Callable[[tuple[Any, ...]], Any]) -> None:
    """Read commands until ``exit`` or EOF (the parent died): each is handled as a task."""
    tasks: set[asyncio.Task[Any]] = set()

    async def run(cmd: tuple[Any, ...]) -> None:
        try:
            await handle(cmd)
        except Exception:
            conn.send(("error", traceback.format_exc()))

    while True:
        if not await asyncio.to_thread(conn.poll, 0.5):
            continue
        try:
            cmd = conn.recv()
        except EOFError:
            os._exit(0)
        if cmd[0] == "exit":
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return
        task = asyncio.create_task(run(cmd))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
