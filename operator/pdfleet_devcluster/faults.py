"""Faults injected into a running LocalCluster for tests: a control-plane component frozen for a while.

``paused(cluster, "kube-apiserver", 20)`` SIGSTOPs the process and SIGCONTs it after 20 s: its port
still accepts connections (the kernel's backlog) and nothing answers, which is what a hung apiserver or
a half-open connection looks like to clients. The pid comes from the cluster's pid file.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pdfleet_devcluster.cluster import PID_FILE, LocalCluster

__all__ = ["paused"]


@contextmanager
def paused(cluster: LocalCluster, component: str, seconds: float) -> Iterator[None]:
    """Freeze ``component`` for ``seconds`` (the body runs meanwhile), then let it continue."""
    pid = int(json.loads((cluster.state_dir / PID_FILE).read_text())[component])
    os.kill(pid, signal.SIGSTOP)
    until = time.monotonic() + seconds
    try:
        yield
        time.sleep(max(0.0, until - time.monotonic()))
    finally:
        os.kill(pid, signal.SIGCONT)
