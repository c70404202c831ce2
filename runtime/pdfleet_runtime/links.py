"""Transfer backends, user-facing protocols, and how each backend maps a protocol to engine settings.

``spec.transfer.protocol`` names what the user wants; the table ``ENGINE_SETTINGS`` says, per
backend, which engine protocol and environment that becomes and which effective transports the
canary transfer accepts (shared/design.md section 3). A missing entry means the backend cannot
serve that protocol; the capability matrix turns that into a rule with a reason.

Pure data: no engine is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "ENGINE_SETTINGS",
    "UNSUPPORTED_PROTOCOLS",
    "Backend",
    "EngineSettings",
    "LinkProtocol",
    "engine_settings",
    "link_matches",
]


class Backend(StrEnum):
    """The transfer engine that moves request state from prefill to decode ranks."""

    MOONCAKE = "mooncake"
    NIXL = "nixl"
    MORI = "mori"


class LinkProtocol(StrEnum):
    """The link the user asks for; each backend maps it to its own engine settings."""

    RDMA = "rdma"
    TCP = "tcp"
    NVLINK = "nvlink"
    SHM = "shm"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What one (backend, protocol) pair becomes inside the engine.

    ``env`` is pinned from the protocol because not every engine reports the transport it picked
    (NIXL's Python API does not); the canary transfer's throughput catches a wrong path.
    """

    backend: Backend
    protocol: LinkProtocol
    engine_protocol: str
    env: Mapping[str, str] = field(default_factory=dict)
    accepted_transports: frozenset[str] = frozenset()
    same_host_only: bool = False
    needs_host_ipc: bool = False
    note: str = ""


def _settings(*items: EngineSettings) -> Mapping[tuple[Backend, LinkProtocol], EngineSettings]:
    return MappingProxyType({(s.backend, s.protocol): s for s in items})


ENGINE_SETTINGS: Mapping[tuple[Backend, LinkProtocol], EngineSettings] = _settings(
    EngineSettings(
        Backend.MOONCAKE,
        LinkProtocol.RDMA,
        "rdma",
        accepted_transports=frozenset({"rdma"}),
        note="device names from spec.transfer.rdmaDevices, else the engine's auto-discovery",
    ),
    EngineSettings(
        Backend.MOONCAKE,
        LinkProtocol.TCP,
        "tcp",
        # A batch of more than ~2,000 entries to one peer otherwise fails with "TCP lane queue-full"
        # and poisons every later transfer to that peer (shared/engines.md).
        env={"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192"},
        accepted_transports=frozenset({"tcp"}),
    ),
    EngineSettings(
        Backend.MOONCAKE,
        LinkProtocol.NVLINK,
        "nvlink_intra",
        # Without this variable the engine silently falls back to TCP (1.5 GB/s instead of 389 GB/s).
        env={"MC_INTRANODE_NVLINK": "1"},
        accepted_transports=frozenset({"nvlink_intra"}),
        same_host_only=True,
        needs_host_ipc=True,
    ),
    EngineSettings(
        Backend.NIXL,
        LinkProtocol.RDMA,
        "ucx",
        env={"UCX_TLS": "rc,ud,cuda_copy"},
        accepted_transports=frozenset({"rc", "rc_mlx5", "ud", "ud_mlx5", "dc_mlx5"}),
        note="UCX over verbs",
    ),
    EngineSettings(
        Backend.NIXL,
        LinkProtocol.TCP,
        "ucx",
        env={"UCX_TLS": "tcp"},
        accepted_transports=frozenset({"tcp"}),
    ),
    EngineSettings(
        Backend.NIXL,
        LinkProtocol.NVLINK,
        "ucx",
        # cuda_ipc moves the bytes; tcp is only the active-message lane NIXL's UCX backend needs:
        # with `cuda_ipc,cuda_copy` alone backend creation fails ("no active messages transport";
        # nixl-cu13 1.5.1 on an H200 pair, 2026-11-30). With tcp listed, 1 GiB moved at 327 GB/s.
        env={"UCX_TLS": "cuda_ipc,cuda_copy,tcp"},
        accepted_transports=frozenset({"cuda_ipc"}),
        same_host_only=True,
        needs_host_ipc=True,
    ),
    EngineSettings(
        Backend.NIXL,
        LinkProtocol.SHM,
        "ucx",
        # `UCX_TLS=sm,self` fails at backend creation; tcp stays listed for connection wire-up only.
        env={"UCX_TLS": "cma,tcp"},
        accepted_transports=frozenset({"cma", "sysv", "posix"}),
        same_host_only=True,
        needs_host_ipc=True,
        note="kernel copy between processes of one host (host memory)",
    ),
    EngineSettings(
        Backend.MORI,
        LinkProtocol.RDMA,
        "rdma",
        accepted_transports=frozenset({"rdma"}),
        note="needs the ROCm runtime; the backend fails with a clear error where it is absent",
    ),
)

UNSUPPORTED_PROTOCOLS: Mapping[tuple[Backend, LinkProtocol], str] = MappingProxyType(
    {
        (Backend.MOONCAKE, LinkProtocol.SHM): (
            "Mooncake's transfer engine has no host shared-memory transport between processes"
        ),
        (Backend.MORI, LinkProtocol.TCP): "MORI-IO moves data over RDMA only",
        (Backend.MORI, LinkProtocol.NVLINK): "NVLink is an NVIDIA link; MORI runs on AMD GPUs (XGMI)",
        (Backend.MORI, LinkProtocol.SHM): "MORI-IO has no host shared-memory transport",
    }
)


def engine_settings(backend: Backend | str, protocol: LinkProtocol | str) -> EngineSettings | None:
    """The engine settings for a pair, or None where the backend cannot serve the protocol."""
    try:
        return ENGINE_SETTINGS.get((Backend(backend), LinkProtocol(protocol)))
    except ValueError:
        return None


def link_matches(backend: str, requested: str, effective: str) -> bool | None:
    """Whether the transport an engine reports (``TransportReport.effective``: Mooncake's protocol, NIXL's
    ``ucx:<UCX_TLS>``) serves the protocol asked for: one of the protocol's accepted transports among them (NIXL
    lists tcp beside cma or cuda_ipc for wire-up only). None where it cannot be said (an unpinned engine, or a
    pair the table does not hold)."""
    settings = engine_settings(backend, requested)
    if settings is None or not effective or effective == "unpinned":
        return None
    used = set(effective.removeprefix("ucx:").split(","))
    return bool(used & settings.accepted_transports)
