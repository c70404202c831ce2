"""The bootstrap host of a parity group: one ``BootstrapServer`` per case, each a fresh "prefill pod" (no torch)."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection
from typing import Any

from pdfleet_runtime.protocol.auth import Codec
from pdfleet_runtime.protocol.bootstrap import BootstrapLimits, BootstrapServer, BootstrapState

from .cases import GroupSpec
from .procs import guard, serve_commands

__all__ = ["bootstrap_main"]


def bootstrap_main(conn: Connection, spec: GroupSpec) -> None:
    async def main() -> None:
        servers: dict[int, BootstrapServer] = {}

        async def handle(cmd: tuple[Any, ...]) -> None:
            if cmd[0] == "start":
                state = BootstrapState(cmd[1], limits=BootstrapLimits(lease_s=spec.lease_s))
                server = BootstrapServer(state, Codec(spec.secret, "prefill-pod", rank_key=spec.rank_key))
                ep = await server.start()
                servers[ep.port] = server
                conn.send(("started", ep.host, ep.port))
            elif cmd[0] == "stop":
                server = servers.pop(cmd[1], None)
                if server is not None:
                    await server.stop()
                conn.send(("stopped",))

        conn.send(("ready",))
        await serve_commands(conn, handle)
        for s in servers.values():
            await s.stop()

    guard(conn, lambda: asyncio.run(main()))
