"""A pod's rank processes as ``serve`` starts them: forked by a fork server that imported torch once, torch in the
ranks and never in the pod process, and nothing left once the pod process is killed (the ranks see their pipe
close, the fork server its parent go)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from pdfleet_devcluster.procs import children
from tests.server.harness import Pod, config, free_offset

pytestmark = pytest.mark.slow


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


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
        servers = [c for c in children(pod.proc.pid) if "multiprocessing.forkserver" in c.cmd]
        assert len(servers) == 1, [str(c) for c in children(pod.proc.pid)]
        ranks = children(servers[0].pid)
        assert len(ranks) == 2, [str(r) for r in ranks]
        assert not _maps_torch(pod.proc.pid), "the pod process mapped torch"
        assert all(_maps_torch(p.pid) for p in (*servers, *ranks)), "the fork server and its ranks map torch"
        pod.proc.send_signal(signal.SIGKILL)  # the pod process dies as an OOM kill takes it
        pod.proc.wait(10)
        deadline = time.monotonic() + 30
        while any(p.alive() for p in (*servers, *ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [str(p) for p in (*servers, *ranks) if p.alive()]
        assert not left, f"left running 30 s after the pod process was killed: {left}"
    finally:
        pod.stop()
