"""The runtime's ``pdfleet.io/drained`` report (issue 26, item 2): reset to False when a drain starts and
when it is cancelled, and stamped with the drain (the operator's ``pdfleet.io/drain-started`` value) it
reports, so a report left from an earlier drain can never end a later one. The pod loop of a real
``PodServer`` against a recording gate writer (no cluster, no rank processes: a decode pod with nothing
in flight drains at once)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pdfleet_runtime.config import DRAIN_ANNOTATION, DRAINED_CONDITION
from pdfleet_runtime.pod.app import PodServer
from pdfleet_runtime.pod.options import ServeOptions
from tests.server.harness import config


class RecordingGate:
    """A gate writer whose pod annotations the test sets; it records every condition written."""

    def __init__(self) -> None:
        self.annotations_now: dict[str, str] = {}
        self.written: list[tuple[str, bool, str, str]] = []

    async def set(self, ready: bool, reason: str, message: str) -> None:
        return None

    async def annotations(self) -> dict[str, str] | None:
        return dict(self.annotations_now)

    async def set_condition(self, condition_type: str, ok: bool, reason: str, message: str) -> None:
        self.written.append((condition_type, ok, reason, message))

    def drained(self) -> list[tuple[bool, str]]:
        return [(ok, message) for kind, ok, _, message in self.written if kind == DRAINED_CONDITION]


async def _wait(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_drained_is_reset_on_start_and_cancel_and_stamped_with_its_drain(tmp_path: Path) -> None:
    gate = RecordingGate()
    server = PodServer(ServeOptions(config=config("decode"), pod_name="d-0", pod_namespace="ns"), gate=gate)

    async def scenario() -> list[tuple[bool, str]]:
        task = asyncio.get_running_loop().create_task(server._pod_loop())
        try:
            gate.annotations_now = {DRAIN_ANNOTATION: "100.000"}
            await _wait(lambda: any(ok for ok, _ in gate.drained()))
            gate.annotations_now = {}  # the operator cancels the drain
            await _wait(lambda: not gate.drained()[-1][0])
            gate.annotations_now = {DRAIN_ANNOTATION: "200.000"}  # a new drain
            await _wait(lambda: gate.drained()[-1][0] and "200.000" in gate.drained()[-1][1])
        finally:
            task.cancel()
        return gate.drained()

    seen = asyncio.run(scenario())
    first_true = next(i for i, (ok, _) in enumerate(seen) if ok)
    # Before its first report, the drain reset the condition, stamped with that drain.
    assert not seen[0][0] and "100.000" in seen[0][1], seen
    assert "100.000" in seen[first_true][1], seen
    cancel = next(i for i, (ok, _) in enumerate(seen) if i > first_true and not ok)
    assert "cancel" in seen[cancel][1].lower(), seen
    later = seen[cancel + 1:]
    assert not later[0][0] and "200.000" in later[0][1], seen  # reset at the new drain's start
    assert all("100.000" not in m for ok, m in later if ok), seen
