"""``pdfleet-runtime router-front-wait``: the router container's preStop hook, waiting for the front to stop.

The front drains for as long as clients still reach it (``Front.drain``: 5 s to ``FRONT_DRAIN_MAX_S``), and the
router behind it must outlive that. A fixed preStop sleep long enough for the longest drain held every router
pod for that long; this hook returns once nothing listens on the front's port in the pod's network namespace
(read from ``/proc/net/tcp``: connecting would count as a client and prolong the drain), or at its bound.
"""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["listening", "wait_stopped"]

_LISTEN = "0A"


def listening(port: int, tables: tuple[Path, ...] = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))) -> bool:
    """Whether a socket of this network namespace listens on TCP ``port`` (any address)."""
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def wait_stopped(port: int, within_s: float, poll_s: float = 0.2) -> bool:
    """Until nothing listens on ``port``, at most ``within_s``; True when it stopped in time."""
    deadline = time.monotonic() + within_s
    while listening(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
