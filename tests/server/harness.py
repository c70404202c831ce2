"""The harness of the multi-process server tests: ``LocalPod`` with the tests' secret, and a config builder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdfleet_runtime.config import GroupConfig, RuntimeConfig
from pdfleet_runtime.layouts import LayoutRef
from pdfleet_runtime.records import ParallelShape
from pdfleet_runtime.testing.local import LocalPod, free_offset, http, metric

__all__ = ["Pod", "config", "free_offset", "http", "metric"]

SECRET = b"server-tests-secret-0123456789abcdef"
LAYOUT = "llama-dense"


def config(role: str, *, layout: str | dict[str, Any] = LAYOUT, tp: int = 1, peer_tp: int = 1, requests: int = 4,
           tokens: int = 512, drain_s: int = 20, backend: str = "mooncake", pp: int = 1, peer_pp: int = 1,
           group: GroupConfig | None = None) -> RuntimeConfig:
    ref = LayoutRef(preset=layout) if isinstance(layout, str) else LayoutRef(inline=layout)
    return RuntimeConfig(deployment="srv", namespace="default", role=role, runtime_version="0.1.0", layout=ref,
                         shape=ParallelShape(tp, pp), peer_shape=ParallelShape(peer_tp, peer_pp), group=group,
                         backend=backend,
                         protocol="tcp", max_concurrent_requests=requests, kv_tokens=tokens,
                         prefill_service="srv-prefill", secret_path=Path("/nonexistent"),
                         drain_timeout_seconds=drain_s, device="cpu")


class Pod(LocalPod):
    """A ``serve`` process with the tests' secret."""

    def __init__(self, workdir: Path, name: str, cfg: RuntimeConfig, **kw: Any) -> None:
        super().__init__(workdir, name, cfg, SECRET, **kw)
