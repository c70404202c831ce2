"""Child processes that die with their parent: ``preexec_fn=die_with_parent`` for ``subprocess.Popen``.

Used where a test or the demo starts a long-running process (the operator, a runtime pod server): a
killed test run (SIGKILL, an OOM kill, a CI timeout) must not leave them running. Linux's
``PR_SET_PDEATHSIG`` makes the kernel send SIGKILL to the child when the thread that started it
exits, so start such children from the main thread (pytest fixtures do).
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL me when my parent goes (and now, if it already went)."""
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died between fork and prctl
        os._exit(1)
