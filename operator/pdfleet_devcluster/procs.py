"""The processes of a run, found by the namespaces they are in, and stopped.

Every process a local cluster starts lives in its private network namespace (``sandbox``) or in the
network namespace of one of its pods (``podsandbox``); a process that left its parent's process group
or was re-parented to PID 1 is still in that namespace. So "what did this run leave behind" is: the
processes whose ``/proc/<pid>/ns/net`` is one of the run's namespaces. A namespace is named by its
inode only while something holds it, and the kernel hands a freed inode to the next namespace made,
so callers take the inodes from live holders (the cluster's processes, the pods' ``/run/netns`` names),
never from a record of an earlier run. Signals go through a pidfd opened after the process's start
time was checked, so a reused pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Proc", "ancestors", "children", "in_namespaces", "net_ns", "pod_namespaces", "stop"]


@dataclass(frozen=True)
class Proc:
    """One process: its pid and start time (together, its identity), parent, and command line."""

    pid: int
    start: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    ppid: int
    cmd: str

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}): {self.cmd[:160]}"

    def alive(self) -> bool:
        """Still this process (not a reused pid), and not a zombie."""
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start and stat[2] != "Z"


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) from /proc/<pid>/stat, None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # after the command, which may hold spaces and parentheses
    return int(fields[1]), int(fields[19]), fields[0]


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def net_ns(pid: int | str) -> int | None:
    """The inode of the network namespace ``pid`` is in (``self`` for this process), None when gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def pod_namespaces(holder: int) -> dict[str, int]:
    """The pods' network namespaces (``ip netns`` names ``pod-*``) of the cluster whose mount namespace
    ``holder`` is in (read through ``/proc/<holder>/root``): name -> inode."""
    out: dict[str, int] = {}
    root = Path(f"/proc/{holder}/root/run/netns")
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if entry.name.startswith("pod-"):
                with contextlib.suppress(OSError):
                    out[entry.name] = entry.stat().st_ino
    return out


def ancestors(pid: int | None = None) -> set[int]:
    """``pid`` (default: this process) and every process above it."""
    out, cur = set(), pid or os.getpid()
    while cur > 1 and cur not in out:
        out.add(cur)
        stat = _stat(cur)
        if stat is None:
            break
        cur = stat[0]
    return out


def children(pid: int) -> list[Proc]:
    """Every live process whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] == pid and stat[2] != "Z":
                out.append(Proc(int(entry.name), stat[1], stat[0], _cmd(int(entry.name))))
    return sorted(out, key=lambda p: p.pid)


def in_namespaces(inodes: Iterable[int], exclude: Iterable[int] = ()) -> list[Proc]:
    """Every live process whose network namespace is one of ``inodes``, less the pids in ``exclude``."""
    wanted, skip = set(inodes), set(exclude)
    out = []
    if not wanted:
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        pid = int(entry.name)
        if net_ns(pid) not in wanted:
            continue
        stat = _stat(pid)
        if stat is not None and stat[2] != "Z":
            out.append(Proc(pid, stat[1], stat[0], _cmd(pid)))
    return sorted(out, key=lambda p: p.pid)


def _signal(proc: Proc, sig: signal.Signals) -> None:
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        return  # gone
    try:
        if proc.alive():  # checked after the pidfd pins the process: a reused pid is never signalled
            signal.pidfd_send_signal(fd, sig)
    except OSError:
        pass
    finally:
        os.close(fd)


def stop(procs: Iterable[Proc], timeout: float = 10.0) -> tuple[list[Proc], list[Proc]]:
    """SIGTERM each, SIGKILL what is left after ``timeout``: (the ones stopped, the ones still alive).
    A zombie counts as stopped (``Proc.alive``): reaping is its parent's job, and reaping children here
    would take exit codes from the ``Popen`` objects that own them."""
    procs = [p for p in procs if p.alive()]
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.alive():
            _signal(p, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in procs if p.alive()]
    return [p for p in procs if p not in left], left

