"""The runtime re-asserts its readiness gate periodically (issue 26, item 1): a value forged or reset by
someone else is overwritten within the period, not kept until the runtime's own verdict changes. The
gate loop of a real ``PodServer`` against a recording gate writer."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pdfleet_runtime.pod import app
from pdfleet_runtime.pod.app import PodServer
from pdfleet_runtime.pod.options import ServeOptions
from tests.server.harness import config


class RecordingGate:
    def __init__(self) -> None:
        self.sets: list[tuple[bool, str]] = []

    async def set(self, ready: bool, reason: str, message: str) -> None:
        self.sets.append((ready, reason))

    async def annotations(self) -> dict[str, str] | None:
        return {}

    async def set_condition(self, condition_type: str, ok: bool, reason: str, message: str) -> None:
        return None


def test_the_gate_is_rewritten_while_the_verdict_stays_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app, "GATE_REASSERT_S", 0.3, raising=False)
    gate = RecordingGate()
    server = PodServer(ServeOptions(config=config("decode"), pod_name="d-0", pod_namespace="ns"), gate=gate)

    async def run_for(seconds: float) -> None:
        task = asyncio.get_running_loop().create_task(server._gate_loop())
        await asyncio.sleep(seconds)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run_for(1.6))
    assert len(set(gate.sets)) == 1, gate.sets  # one verdict throughout (no rank is up: Starting)
    assert len(gate.sets) >= 3, f"the unchanged verdict was written {len(gate.sets)} time(s) in 1.6 s"
