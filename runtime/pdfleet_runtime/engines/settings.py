"""Engine settings: from ``spec.transfer.protocol`` to an engine's protocol and environment.

This is the one place that writes ``MC_*``, ``UCX_*`` and ``NIXL_*`` environment variables, and it
does so before the engine is imported or created (engines read them at start). The per-protocol
table lives in ``pdfleet_runtime.links.ENGINE_SETTINGS``; ``resolve`` adds what depends on the
runtime's configuration (log levels, loopback devices, RDMA device names, overrides) and the
adapters' own limits. The environment is process-wide, so ``EnvLedger`` refuses a second engine
in one process that needs different values (one engine per process is the runtime's model).

Reading order: ``EngineConfig`` (what the runtime's config says), ``resolve`` (pure, tested),
``EnvLedger.apply`` (the only writer).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from pdfleet_runtime.engines.errors import SettingsError
from pdfleet_runtime.links import UNSUPPORTED_PROTOCOLS, Backend, LinkProtocol, engine_settings

__all__ = [
    "LOCAL_BACKEND",
    "MOONCAKE_DEFAULT_QUEUE",
    "MOONCAKE_MAX_QUEUE",
    "MOONCAKE_QUEUE_VAR",
    "PROCESS_ENV",
    "EngineBackend",
    "EngineConfig",
    "EnvLedger",
    "LocalBackend",
    "ResolvedSettings",
    "engine_backend",
    "resolve",
]


class LocalBackend(StrEnum):
    """The in-process copy engine (tests, the parity harness, the memcpy baseline); not a spec ``Backend``."""

    LOCAL = "local"


LOCAL_BACKEND = LocalBackend.LOCAL
EngineBackend = Backend | LocalBackend
"""What an engine runs: the spec's ``Backend`` itself (no round trip through its name), or the local copy."""


def engine_backend(name: EngineBackend | str) -> EngineBackend:
    """The backend a name (the CLI's, a harness's) stands for; ``SettingsError`` naming the known ones."""
    if isinstance(name, Backend | LocalBackend):
        return name
    for kind in (Backend, LocalBackend):
        try:
            return kind(name)
        except ValueError:
            continue
    raise SettingsError(f"unknown backend {name!r}; known: {sorted([*Backend, LOCAL_BACKEND])}")

MOONCAKE_QUEUE_VAR = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
MOONCAKE_DEFAULT_QUEUE = 2048
"""Entries one Mooncake TCP peer queues when the variable is unset: 2,048 entries passed, 2,500 failed
with "TCP lane queue-full" and every later write to that peer failed (0.3.13.post1)."""
MOONCAKE_MAX_QUEUE = 32768
"""Largest value seen honoured: with 65536 a batch of 4,096 entries failed as if the limit were 2,048."""

_LOG_LEVELS = {
    # our level -> (Mooncake MC_LOG_LEVEL, NIXL_LOG_LEVEL, UCX_LOG_LEVEL)
    "DEBUG": ("INFO", "DEBUG", "debug"),
    "INFO": ("INFO", "INFO", "info"),
    "WARNING": ("WARNING", "WARN", "warn"),
    "ERROR": ("ERROR", "ERROR", "error"),
}


@dataclass(frozen=True)
class EngineConfig:
    """How the runtime wants one engine; read once at start. ``backend`` may be given by name (checked here).

    ``protocol`` None means the engine's own choice (NIXL's default path: UCX picks, and the
    adapter reports the transport as unpinned); Mooncake always needs one. ``env`` overrides the
    table: a value of None removes a variable the table would set (the tests use this to run
    Mooncake with its queue variable unset). ``max_batch_entries`` caps one engine call; the
    default is half the Mooncake per-peer queue, so a batch can never fill it.
    """

    backend: EngineBackend
    protocol: LinkProtocol | None = LinkProtocol.TCP
    host: str = "127.0.0.1"
    rdma_devices: tuple[str, ...] = ()
    net_devices: str | None = None
    log_level: str = "WARNING"
    env: Mapping[str, str | None] = field(default_factory=dict)
    max_batch_entries: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", engine_backend(self.backend))
        object.__setattr__(self, "env", dict(self.env))  # a copy; plain dict so configs pickle to spawned processes
        if self.log_level not in _LOG_LEVELS:
            raise SettingsError(f"log_level must be one of {sorted(_LOG_LEVELS)}, got {self.log_level!r}")
        if self.max_batch_entries is not None and self.max_batch_entries < 1:
            raise SettingsError(f"max_batch_entries must be at least 1, got {self.max_batch_entries}")


@dataclass(frozen=True)
class ResolvedSettings:
    """What an adapter starts with: the engine protocol, the environment and the accepted transports.

    ``env`` values of None are removed from the environment. ``pinned`` is False only where the
    user asked for no protocol and the engine chooses.
    """

    backend: EngineBackend
    protocol: LinkProtocol | None
    engine_protocol: str
    env: Mapping[str, str | None]
    accepted_transports: frozenset[str]
    pinned: bool
    max_batch_entries: int | None
    device_names: str = ""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _queue_limit(env: Mapping[str, str | None]) -> int:
    raw = env.get(MOONCAKE_QUEUE_VAR)
    if raw is None:
        return MOONCAKE_DEFAULT_QUEUE
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{MOONCAKE_QUEUE_VAR} must be an integer, got {raw!r}") from None
    if not 1 <= value <= MOONCAKE_MAX_QUEUE:
        raise SettingsError(f"{MOONCAKE_QUEUE_VAR}={value} is outside [1, {MOONCAKE_MAX_QUEUE}]; larger values "
                            f"were seen ignored by the engine (the limit stayed {MOONCAKE_DEFAULT_QUEUE})")
    return value


def _merge(*layers: Mapping[str, str | None]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for layer in layers:
        out.update(layer)
    return out


def resolve(config: EngineConfig) -> ResolvedSettings:
    """The settings of one engine (pure). Raises ``SettingsError`` for a protocol the backend cannot serve."""
    mc_log, nixl_log, ucx_log = _LOG_LEVELS[config.log_level]
    backend = config.backend
    if isinstance(backend, LocalBackend):
        return ResolvedSettings(backend, config.protocol, "memcpy", {}, frozenset({"memcpy"}), True,
                                config.max_batch_entries)
    if backend is Backend.NIXL and config.protocol is None:
        # UCX picks the transport; make sure an inherited UCX_TLS does not silently pick for it.
        env = _merge({"UCX_TLS": None, "UCX_NET_DEVICES": None, "NIXL_LOG_LEVEL": nixl_log,
                      "UCX_LOG_LEVEL": ucx_log}, config.env)
        return ResolvedSettings(backend, None, "ucx", env, frozenset(), False, config.max_batch_entries)
    if config.protocol is None:
        raise SettingsError(f"{backend.value} needs an explicit protocol (one of {[p.value for p in LinkProtocol]})")
    table = engine_settings(backend, config.protocol)
    if table is None:
        reason = UNSUPPORTED_PROTOCOLS.get((backend, config.protocol), "no entry in the protocol table")
        raise SettingsError(f"{backend.value} cannot serve protocol {config.protocol.value}: {reason}")
    extra: dict[str, str | None] = {}
    device_names = ""
    max_batch = config.max_batch_entries
    if backend is Backend.MOONCAKE:
        extra["MC_LOG_LEVEL"] = mc_log
        if config.protocol is LinkProtocol.RDMA:
            device_names = ",".join(config.rdma_devices)
    elif backend is Backend.NIXL:
        extra.update(NIXL_LOG_LEVEL=nixl_log, UCX_LOG_LEVEL=ucx_log)
        if config.protocol is LinkProtocol.TCP:
            # Without a device UCX splits traffic over lo and the host's interface.
            devices = config.net_devices or ("lo" if _is_loopback(config.host) else None)
            if devices:
                extra["UCX_NET_DEVICES"] = devices
        elif config.net_devices:
            extra["UCX_NET_DEVICES"] = config.net_devices
    env = _merge(table.env, extra, config.env)
    if backend is Backend.MOONCAKE and config.protocol is LinkProtocol.TCP:
        queue = _queue_limit(env)
        max_batch = min(max_batch or queue, max(1, queue // 2))
    if backend is Backend.MOONCAKE and config.protocol is LinkProtocol.NVLINK and env.get("MC_INTRANODE_NVLINK") != "1":
        raise SettingsError("mooncake nvlink needs MC_INTRANODE_NVLINK=1: without it the engine silently uses TCP")
    return ResolvedSettings(backend, config.protocol, table.engine_protocol, env,
                            table.accepted_transports, True, max_batch, device_names)


class EnvLedger:
    """Applies engine environments to one process and remembers them, refusing conflicting values.

    One ledger per process (``PROCESS_ENV``) because the environment itself is per process; tests
    pass their own ledger and mapping.
    """

    def __init__(self) -> None:
        self._applied: dict[str, str | None] = {}

    @property
    def applied(self) -> Mapping[str, str | None]:
        return MappingProxyType(self._applied)

    def apply(self, env: Mapping[str, str | None], environ: MutableMapping[str, str] | None = None) -> None:
        """Set (or remove, for None) every variable; ``SettingsError`` if an earlier engine set another value."""
        target = os.environ if environ is None else environ
        clashes = {k: (self._applied[k], v) for k, v in env.items() if k in self._applied and self._applied[k] != v}
        if clashes:
            raise SettingsError("an engine already started in this process with other settings: " +
                                ", ".join(f"{k} is {a!r}, wanted {b!r}" for k, (a, b) in sorted(clashes.items())))
        for key, value in env.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
            self._applied[key] = value


PROCESS_ENV = EnvLedger()
"""The ledger of this process's environment; only adapters' ``start`` calls it."""
