"""What the commands that read a running deployment (``render --diff``, ``doctor``) share: how a failed read
is said. Exit status 2, one line naming the deployment, never a traceback."""

from __future__ import annotations

import sys

__all__ = ["read_failed"]


def read_failed(name: str, namespace: str, exc: Exception) -> int:
    """Say why ``pdd/name`` could not be read (the apiserver's status and reason, or the error) and return 2."""
    from kubernetes.client.exceptions import ApiException

    why = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else f"{type(exc).__name__}: {exc}"
    print(f"error: pdd/{name} in {namespace}: {why}", file=sys.stderr)
    return 2
