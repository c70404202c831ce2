"""A pod's rank processes as ``serve`` starts them: forked by a fork server that imported torch once, torch in the
ranks and never in the pod process, and nothing left once the pod process is killed (the ranks see their pipe
close, the fork server its parent go)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.server.harness import Pod, config, free_offset

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_come_from_the_fork_server_and_go_with_the_pod(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{config('prefill').bootstrap_port + free_offset()}"  # no prefill: the ranks start alone
    pod = Pod(tmp_path, "dec", config("decode", tp=2), env={"PDFLEET_PREFILL_ADDRESSES": dead}).start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert pod.proc is not None and pod.proc.poll() is None, pod.log()[-3000:]
            try:
                _, health = pod.get("/healthz")
            except OSError:  # not listening yet
                health = None
            if isinstance(health, dict) and health.get("ranksUp") == 2:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the pod's 2 ranks never came up: {pod.log()[-3000:]}")
        assert pod.proc is not None
        servers = [c for c in _children(pod.proc.pid) if "multiprocessing.forkserver" in _cmdline(c)]
        assert len(servers) == 1, [(c, _cmdline(c)) for c in _children(pod.proc.pid)]
        ranks = _children(servers[0])
        assert len(ranks) == 2, ranks
        assert not _maps_torch(pod.proc.pid), "the pod process mapped torch"
        assert all(_maps_torch(r) for r in (servers[0], *ranks)), "the fork server and its ranks map torch"
        pod.proc.send_signal(signal.SIGKILL)  # the pod process dies as an OOM kill takes it
        pod.proc.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in (servers[0], *ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p, _cmdline(p)) for p in (servers[0], *ranks) if _alive(p)]
        assert not left, f"left running 30 s after the pod process was killed: {left}"
    finally:
        pod.stop()
