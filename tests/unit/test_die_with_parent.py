"""Processes a test starts die with it (issue 26, item 5): a runtime pod started through the test
harness (``LocalPod``), with its rank processes, is gone within seconds of its parent being SIGKILLed,
as a killed pytest run is. The operator's case (``LocalOperator``) is in tests/cluster/test_orphans.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PARENT = """
import sys, time
from pathlib import Path
from tests.server.harness import Pod, config
pod = Pod(Path(sys.argv[1]), "orphan", config("decode")).start()
print(pod.proc.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def test_a_harness_runtime_and_its_ranks_die_with_their_parent(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert parent.stdout is not None
    server = int(parent.stdout.readline())
    procs: set[int] = set()
    deadline = time.monotonic() + 60
    while len(procs) < 2 and time.monotonic() < deadline:  # the pod server and its rank process
        procs = {p for p in descendants(server) if alive(p)}
        time.sleep(0.2)
    try:
        assert len(procs) >= 2, f"the runtime's rank process did not start: {procs}"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(p for p in procs if alive(p))
        assert not left, f"left running after their parent was killed: {left}"
    finally:
        for p in procs:
            if alive(p):
                os.kill(p, signal.SIGKILL)
