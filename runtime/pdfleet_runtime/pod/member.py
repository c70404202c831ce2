"""A replica group's member pod (``PDFLEET_GROUP_MEMBER`` m > 0): its ranks, for its leader.

The member joins its leader over the group channel (``protocol.group``, signed with the role's group
key), learns from the welcome what its ranks need (the replica's instance name; prefill: the leader's
bootstrap port and rank key), starts its rank processes (global ranks ``[m * local, (m + 1) * local)``)
and relays: each ``GroupCall`` becomes a call on its launcher's pipe and its typed result a
``GroupReply``; each rank's ready message and leg reports become ``GroupEvent``s. Prefill ranks
register and poll at the leader's bootstrap, signed with the leader's rank key; decode ranks register
with prefill pods as the leader's do, advertising this pod's own address for their engines.

It serves ``/healthz``, ``/readyz`` and ``/metrics`` only (the leader serves the worker API and the
bootstrap), and the admin port's ``/drain`` (the preStop hook), which answers drained at once: a
member admits nothing itself, its leader's drain covers its ranks. Its readiness-gate condition is True once its ranks are up and joined (``WaitingForGroup``
while not). Its leader going away (the connection closes, a frame is refused, nothing heard for the
lease) makes it exit non-zero (``EXIT_LEADER_LOST``): the operator restarts the group as a unit. On
SIGTERM it keeps serving its leader until the leader goes or the drain budget ends, then exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any

from aiohttp import web

from pdfleet_runtime.config import Role
from pdfleet_runtime.protocol.auth import Codec, ProtocolError
from pdfleet_runtime.protocol.group import (
    GroupBeat,
    GroupCall,
    GroupClosed,
    GroupEvent,
    GroupJoin,
    GroupLink,
    GroupReply,
    GroupWelcome,
    group_codec,
    unmask_rank_key,
)
from pdfleet_runtime.protocol.keys import load_secret, mounted_keys
from pdfleet_runtime.protocol.messages import WIRE, Recipient, Refusal, RefusalCode
from pdfleet_runtime.rank.pipe import CallFailed, LegReport

from .admin import start_admin
from .app import GATE_REASSERT_S
from .gate import GateWriter, NoGate
from .group import OPS, config_digest, dump, load
from .launcher import LaunchError, RankCallError, RankLauncher, rank_specs
from .metrics import CONTENT_TYPE, ServerMetrics
from .metrics_port import start_metrics
from .options import ServeOptions
from .readiness import Problem

__all__ = ["EXIT_LEADER_LOST", "MemberServer"]

EXIT_LEADER_LOST = 3
log = logging.getLogger("pdfleet_runtime.server.member")


class LeaderLost(RuntimeError):
    """The leader went away, refused this member, or could not be reached in time."""


class MemberServer:
    """One group member pod: join, start the ranks, relay, until the leader goes."""

    def __init__(self, opts: ServeOptions, *, gate: GateWriter | None = None) -> None:
        assert opts.is_member and opts.config.group is not None
        self.opts, self.cfg = opts, opts.config
        self.gate: GateWriter = gate or NoGate()
        self.metrics = ServerMetrics(self.cfg.role.value)
        self.launcher: RankLauncher | None = None
        self.link: GroupLink | None = None
        self.leader = ""
        self.joined = False
        self._heard = time.monotonic()
        self._lease_s, self._beat_s = 6.0, 1.0
        self._sent_died: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None
        self._admin: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.first = opts.group_member * self.cfg.local_world

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
        group = self.cfg.group
        assert group is not None
        secret = load_secret(self.cfg.secret_path)
        keys = mounted_keys(group.secret_path, load_secret(group.secret_path))
        codec = group_codec(keys, self.opts.instance)
        gate = loop.create_task(self._gate_loop())
        code = 0
        try:
            await self._start_http()
            welcome, boot = await self._join(codec)
            assert self.link is not None
            host = self.opts.leader_address[0] if self.opts.group_leader_address else self.link.remote
            rank_key = unmask_rank_key(keys.accepted, welcome, boot) if self.cfg.role is Role.PREFILL else None
            specs = rank_specs(self.opts, secret, member=self.opts.group_member, instance=welcome.instance,
                               bootstrap=(host, welcome.bootstrap_port or self.opts.bootstrap_port), rank_key=rank_key)
            self.launcher = RankLauncher(specs, on_report=self._relay_report)
            reader = loop.create_task(self._read())
            beat = loop.create_task(self._beat())
            await self.launcher.start()
            for h in self.launcher.handles:
                assert h.info is not None
                await self._send_event(self.first + h.spec.local_index, h.info)
            self.joined = True
            log.info("group member %d: %d ranks up, joined to %s", self.opts.group_member, len(specs), self.leader)
            stopped = loop.create_task(stop.wait())
            self._tasks.update((reader, beat, stopped))
            done, _ = await asyncio.wait([reader, beat, stopped], return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                log.info("stopping: serving the leader until it goes (budget %ds)", self.cfg.drain_timeout_seconds)
                with contextlib.suppress(TimeoutError, LeaderLost):
                    await asyncio.wait_for(asyncio.shield(reader), self.cfg.drain_timeout_seconds)
                log.info("stopped: the leader went, or the budget ran out")
            else:
                for t in done:
                    t.result()  # raises LeaderLost
        except LeaderLost as e:
            log.error("leader lost: %s; exiting %d (the group restarts as a unit)", e, EXIT_LEADER_LOST)
            code = EXIT_LEADER_LOST
        except (LaunchError, OSError, ProtocolError) as e:
            log.error("cannot serve as group member %d: %s", self.opts.group_member, e)
            code = EXIT_LEADER_LOST if isinstance(e, ProtocolError) else 1
        finally:
            gate.cancel()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(gate, *self._tasks, return_exceptions=True)
            if self.link is not None:
                self.link.close()
            for runner in (self._admin, self._metrics_runner, self._runner):
                if runner is not None:
                    await runner.cleanup()
            if self.launcher is not None:
                await self.launcher.stop(10.0)
        return code

    async def _join(self, codec: Codec) -> tuple[GroupWelcome, str]:
        """Connect to the leader (retried until ``group_join_timeout_s``: it may start later) and join."""
        host, port = self.opts.leader_address
        deadline = time.monotonic() + self.opts.group_join_timeout_s
        join = GroupJoin(member=self.opts.group_member, role=self.cfg.role, ranks=self.cfg.local_world,
                         config_digest=config_digest(self.cfg), wire=str(WIRE))
        last = ""
        while time.monotonic() < deadline:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 16), 5.0)
            except (OSError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.5)
                continue
            link = GroupLink(reader, writer, codec)
            try:
                nonce = await link.send(join)
                # The leader answers a join at once, or closes the link; a loaded host can take longer than any fixed
                # wait, and a member that gave up and joined again found itself "joined already" (its first join
                # was admitted): so it waits on a live link until the join's deadline.
                async with asyncio.timeout(max(10.0, deadline - time.monotonic())):
                    opened = await link.recv()
            except (GroupClosed, TimeoutError) as e:
                link.close()
                last = f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.5)
                continue
            body = opened.body
            if isinstance(body, Refusal):
                link.close()
                raise LeaderLost(f"the leader at {host}:{port} refused this member: {body.code.value}: {body.reason}")
            if not isinstance(body, GroupWelcome) or opened.envelope.reply_to != nonce:
                link.close()
                raise LeaderLost(f"the leader at {host}:{port} answered the join with {body.type}")
            link.peer = Recipient(name=opened.envelope.sender, boot=opened.envelope.boot)
            self.link, self.leader = link, opened.envelope.sender
            self._lease_s = body.lease_s
            self._beat_s = body.beat_s
            self._heard = time.monotonic()
            log.info("joined group leader %s at %s:%d as member %d", self.leader, host, port, self.opts.group_member)
            return body, opened.envelope.boot
        raise LeaderLost(f"could not join the leader at {host}:{port} within {self.opts.group_join_timeout_s:g}s "
                         f"(last: {last})")

    # ------------------------------------------------------------------ relay

    async def _read(self) -> None:
        assert self.link is not None
        try:
            while True:
                opened = await self.link.recv()
                self._heard = time.monotonic()
                body = opened.body
                if isinstance(body, GroupCall):
                    task = asyncio.get_running_loop().create_task(self._call(body))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif not isinstance(body, GroupBeat):
                    raise ProtocolError(RefusalCode.UNEXPECTED, f"a leader does not send {body.type}")
        except ProtocolError as e:
            await self.link.refuse(e)
            raise LeaderLost(f"the leader sent a frame this member refused: {e}") from None
        except GroupClosed as e:
            raise LeaderLost(str(e)) from None

    async def _call(self, call: GroupCall) -> None:
        assert self.launcher is not None and self.link is not None
        try:
            local = call.rank - self.first
            if not 0 <= local < self.cfg.local_world:
                raise ProtocolError(RefusalCode.CONFLICT, f"rank {call.rank} is not on member {self.opts.group_member}")
            result = await self.launcher.call(local, load(call.op, call.args, OPS), timeout_s=call.timeout_s)
        except (RankCallError, ProtocolError) as e:
            result = CallFailed(str(e))
        kind, data = dump(result)
        with contextlib.suppress(GroupClosed):
            await self.link.send(GroupReply(call_id=call.call_id, kind=kind, data=data))

    async def _send_event(self, rank: int, msg: object) -> None:
        assert self.link is not None
        kind, data = dump(msg)
        await self.link.send(GroupEvent(rank=rank, kind=kind, data=data))

    def _relay_report(self, local: int, rep: LegReport) -> None:
        self.metrics.transfer(rep.kind, rep.ok, rep.bytes, rep.write_s, rep.failure)
        task = asyncio.get_running_loop().create_task(self._send_event(self.first + local, rep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _beat(self) -> None:
        assert self.link is not None
        while True:
            await asyncio.sleep(self._beat_s)
            if time.monotonic() - self._heard > self._lease_s:
                raise LeaderLost(f"nothing heard from the leader for more than {self._lease_s:g}s")
            try:
                await self.link.send(GroupBeat(), timeout_s=self._lease_s)
                for line in self.launcher.died if self.launcher is not None else []:
                    if line not in self._sent_died:
                        self._sent_died.add(line)
                        await self.link.send(GroupEvent(rank=self.first, kind="RankDied", data={"line": line}))
            except GroupClosed as e:
                raise LeaderLost(str(e)) from None

    # ------------------------------------------------------------------ HTTP and the gate

    def verdict(self) -> tuple[bool, Problem, str]:
        died = self.launcher.died if self.launcher is not None else []
        if died:
            return False, Problem.RANK_DIED, "; ".join(died)
        if not self.joined:
            up = self.launcher.up if self.launcher is not None else 0
            return False, Problem.WAITING_FOR_GROUP, (f"group member {self.opts.group_member}: {up} of "
                                                      f"{self.cfg.local_world} ranks up, joining leader "
                                                      f"{self.leader or self.opts.leader_address[0]}")
        return True, Problem.NONE, (f"group member {self.opts.group_member}: {self.cfg.local_world} ranks up, joined "
                                    f"to leader {self.leader}")

    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.opts.bind_host, self.opts.http_port, reuse_address=True).start()
        self._admin = await start_admin(self._drain, self._drain, self.opts.admin_port)
        self._metrics_runner = await start_metrics(self._metrics, self.opts.bind_host, self.opts.metrics_port)

    async def _drain(self, _: web.Request) -> web.Response:
        return web.json_response({"phase": "drained", "drained": True, "forced": False, "inFlight": 0,
                                  "member": self.opts.group_member,
                                  "note": "a group member admits nothing: its leader's drain covers its ranks"})

    async def _healthz(self, _: web.Request) -> web.Response:
        died = self.launcher.died if self.launcher else []
        return web.json_response({"alive": not died, "role": self.cfg.role.value, "member": self.opts.group_member,
                                  "leader": self.leader, "joined": self.joined,
                                  "ranksUp": self.launcher.up if self.launcher else 0, "ranks": self.cfg.local_world,
                                  "died": died}, status=503 if died else 200)

    async def _readyz(self, _: web.Request) -> web.Response:
        ready, problem, reason = self.verdict()
        return web.json_response({"ready": ready, "problem": problem.value, "reason": reason,
                                  "role": self.cfg.role.value, "member": self.opts.group_member},
                                 status=200 if ready else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        self.metrics.ready.set(int(self.verdict()[0]))
        self.metrics.ranks_up.set(self.launcher.up if self.launcher else 0)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _gate_loop(self) -> None:
        """The verdict into the pod's gate condition: on every change, and again every ``GATE_REASSERT_S``."""
        last: tuple[bool, str] | None = None
        written_at = 0.0
        while True:
            ready, problem, reason = self.verdict()
            if (ready, problem.value) != last or time.monotonic() - written_at >= GATE_REASSERT_S:
                try:
                    await self.gate.set(ready, problem.value, reason)
                    if (ready, problem.value) != last:
                        log.info("readiness: %s (%s): %s", "ready" if ready else "not ready", problem.value, reason)
                    last, written_at = (ready, problem.value), time.monotonic()
                except Exception as e:  # the API may be briefly unavailable: retried next tick
                    log.warning("cannot write the readiness gate: %s", e)
            await asyncio.sleep(0.25)
