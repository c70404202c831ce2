"""The spawned rank process's entry point, the launcher's child side (``pod.launcher`` names it as the target).

Torch-free on purpose: the pod process imports this module to name the target, and only the child, once
spawned, imports ``process`` (torch and the engine).
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from .pipe import RankSpec

__all__ = ["rank_entry"]


def rank_entry(conn: Connection, spec: RankSpec) -> None:
    """Run rank ``spec`` over its end of the pipe until told to exit (the child process only)."""
    from .process import rank_main  # torch and the engine are imported in the child only

    rank_main(conn, spec)
