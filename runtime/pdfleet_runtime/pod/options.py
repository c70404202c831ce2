"""What ``pdfleet-runtime serve`` runs with: the operator's config plus this process's surroundings.

``RuntimeConfig`` is what the operator writes; ``ServeOptions`` adds what only the process can know
(its pod's name and IP from the downward API, ports moved for local runs, the readiness floors) and
is built once at start (``ServeOptions.build``), from the command line and the environment. Nothing
deeper in the server reads an environment variable.

Local runs (tests, benchmarks, the kwok pod runner) put many pods on 127.0.0.1, so three overrides
exist, each named as such:

- ``PDFLEET_PORT_OFFSET`` / ``--port-offset N``: adds N to the HTTP, admin, bootstrap and engine ports;
- ``PDFLEET_PREFILL_ADDRESSES`` / ``--prefill-addresses host:port,...``: the prefill pods' bootstrap
  addresses, instead of resolving the headless Service ``prefillService`` through DNS;
- ``PDFLEET_PREFILL_ADDRESSES_FILE`` / ``--prefill-addresses-file PATH``: the same list, as a JSON list of
  ``"host:port"`` re-read on every resolve (``discovery.FileResolver``), so a harness that rewrites it
  plays kube-dns for a fleet whose prefill pods come and go (the kwok pod runner);
- ``PDFLEET_GROUP_LEADER_ADDRESS`` (``host:port``): a group member reaches its leader's group port there,
  instead of ``<leader>.<group.service>.<namespace>.svc:<group.port>``.

A replica group's pods (``RuntimeConfig.group``) also read ``PDFLEET_GROUP_MEMBER`` (0 = the leader) and
``PDFLEET_GROUP_LEADER`` (the leader's pod name), which the operator sets per pod.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType

from pdfleet_runtime.config import GROUP_LEADER_ENV, GROUP_MEMBER_ENV, Role, RuntimeConfig
from pdfleet_runtime.links import LinkProtocol
from pdfleet_runtime.rank.pipe import FaultOptions

__all__ = [
    "CANARY_FLOORS_GBPS",
    "ENV_GROUP_LEADER_ADDRESS",
    "ENV_KV_CONNECTOR",
    "ENV_PORT_OFFSET",
    "ENV_PREFILL_ADDRESSES",
    "ENV_PREFILL_ADDRESSES_FILE",
    "KvConnector",
    "OptionsError",
    "ServeOptions",
    "parse_addresses",
]

ENV_PORT_OFFSET = "PDFLEET_PORT_OFFSET"
ENV_PREFILL_ADDRESSES = "PDFLEET_PREFILL_ADDRESSES"
ENV_PREFILL_ADDRESSES_FILE = "PDFLEET_PREFILL_ADDRESSES_FILE"
ENV_GROUP_LEADER_ADDRESS = "PDFLEET_GROUP_LEADER_ADDRESS"
ENV_KV_CONNECTOR = "PDFLEET_KV_CONNECTOR"


class KvConnector(StrEnum):
    """How a decode gets a request's state. ``none`` is an engine without its KV connector (SGLang without
    ``--disaggregation-mode decode``, vLLM without ``--kv-transfer-config``): it ignores the transfer fields
    and recomputes every prompt, answering as if nothing were wrong. It exists because users misconfigure
    engines so; pdfleet's doctor, alerts and the pod's silent-fallback condition must catch it."""

    PDFLEET = "pdfleet"
    NONE = "none"

CANARY_FLOORS_GBPS: Mapping[LinkProtocol, float] = MappingProxyType({
    # The lowest canary write throughput (engine write of the canary's bytes, GB/s) at which a pod is
    # still ready. Far below what each link does when it works (TCP loopback ~1-2 GB/s on a 2-core host,
    # RDMA 10-50, NVLink 100+), far above what the link does when it silently falls back to another path
    # (Mooncake nvlink without MC_INTRANODE_NVLINK ran at 1.5 GB/s, shared/engines.md).
    LinkProtocol.TCP: 0.05,
    LinkProtocol.SHM: 0.5,
    LinkProtocol.RDMA: 5.0,
    LinkProtocol.NVLINK: 20.0,
})


class OptionsError(ValueError):
    """A command-line flag or an environment override is malformed; the message names it."""


def parse_addresses(text: str, what: str = ENV_PREFILL_ADDRESSES) -> tuple[tuple[str, int], ...]:
    """``"127.0.0.1:18998,10.0.0.7:8998"`` -> ``(("127.0.0.1", 18998), ("10.0.0.7", 8998))``."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OptionsError(f"{what}: {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise OptionsError(f"{what} is set but names no address")
    return tuple(out)


@dataclass(frozen=True)
class ServeOptions:
    """Everything the pod server needs, read once at start. Defaults are the pod's."""

    config: RuntimeConfig
    config_path: Path = Path("/etc/pdfleet/runtime.yaml")
    pod_name: str = ""
    pod_namespace: str = ""
    pod_ip: str = ""
    bind_host: str = "0.0.0.0"
    port_offset: int = 0
    prefill_addresses: tuple[tuple[str, int], ...] = ()
    """Local-run override of prefill discovery (``PDFLEET_PREFILL_ADDRESSES``); empty: DNS."""
    prefill_addresses_file: Path | None = None
    """Local-run override of prefill discovery, re-read on every resolve (``PDFLEET_PREFILL_ADDRESSES_FILE``)."""
    canary_tokens: int = 64
    canary_period_s: float = 10.0
    """Re-check period while ready; while not ready the check runs every ``retry_period_s``."""
    retry_period_s: float = 1.0
    canary_timeout_s: float = 10.0
    floor_gbps: float | None = None
    """Overrides the protocol's row of ``CANARY_FLOORS_GBPS``."""
    failures_not_ready: int = 3
    """This many transfers failed in a row make the pod not ready until a canary passes again."""
    request_timeout_s: float = 60.0
    write_timeout_s: float = 30.0
    fence_timeout_s: float = 35.0
    room_ttl_s: float = 10.0
    """Prefill: how long a room (``bootstrap_room``) nobody claimed is held for its decode before it expires (the
    router sends both bodies at once: a claim comes within moments, so an unclaimed room frees its place soon)."""
    pin_engine_id: bool = False
    """vLLM's engine id (``GET /query``, NIXL answers): this pod's name when True, so a restarted container keeps
    the id a router cached (vllm-router 0.1.17 reads Mooncake ids once per worker); else a fresh id per start, as
    vLLM draws one unless ``kv_transfer_config.engine_id`` is set."""
    gate: bool = True
    """Patch the readiness-gate condition when running in a cluster (or with ``kubeconfig``)."""
    kubeconfig: Path | None = None
    log_level: str = "INFO"
    stand_in_for: str | None = None
    """Harness only: this process stands in for an engine (``sglang==0.5.23``); /server_info reports that
    engine's version and says it is a stand-in (devcluster.standin)."""
    faults: FaultOptions = field(default_factory=FaultOptions)
    kv_connector: KvConnector = KvConnector.PDFLEET
    """``PDFLEET_KV_CONNECTOR`` / ``--kv-connector``: ``none`` makes a decode recompute every prompt (seeded state
    only: the reference engine's decode ranks do not compute prompts)."""
    group_member: int = 0
    """This pod's place in its replica group (``PDFLEET_GROUP_MEMBER``); 0: the leader, or no group."""
    group_leader: str = ""
    """The leader's pod name (``PDFLEET_GROUP_LEADER``); a member reaches it through the group's Service."""
    group_leader_address: tuple[str, int] | None = None
    """Local-run override of where a member reaches its leader (``PDFLEET_GROUP_LEADER_ADDRESS``)."""
    group_join_timeout_s: float = 300.0
    """A member that cannot join its leader within this long exits non-zero (the group then restarts)."""

    @property
    def is_member(self) -> bool:
        """A group member that is not the leader: it runs its ranks only, for its leader."""
        return self.config.group is not None and self.group_member > 0

    @property
    def is_leader(self) -> bool:
        return self.config.group is not None and self.group_member == 0

    @property
    def group_port(self) -> int:
        assert self.config.group is not None
        return self.config.group.port + self.port_offset

    @property
    def leader_address(self) -> tuple[str, int]:
        """Where a member reaches its leader's group port."""
        group = self.config.group
        assert group is not None
        if self.group_leader_address is not None:
            return self.group_leader_address
        ns = self.pod_namespace or self.config.namespace
        return f"{self.group_leader}.{group.service}.{ns}.svc", group.port

    @property
    def http_port(self) -> int:
        return self.config.http_port + self.port_offset

    @property
    def metrics_port(self) -> int:
        return self.config.metrics_port + self.port_offset

    @property
    def admin_port(self) -> int:
        """Drain and cancel, on 127.0.0.1 only (``pod.admin``)."""
        return self.config.admin_port + self.port_offset

    @property
    def bootstrap_port(self) -> int:
        return self.config.bootstrap_port + self.port_offset

    @property
    def engine_port(self) -> int:
        return self.config.engine_port + self.port_offset

    @property
    def advertise_host(self) -> str:
        """The address peers reach this pod's engines at: the pod IP, or loopback outside a cluster."""
        return self.pod_ip or "127.0.0.1"

    @property
    def floor(self) -> float:
        return self.floor_gbps if self.floor_gbps is not None else CANARY_FLOORS_GBPS[self.config.protocol]

    @property
    def instance(self) -> str:
        """This pod's name in the protocol (decode instance, sender): the pod name, else a local one."""
        return self.pod_name or f"{self.config.deployment}-{self.config.role.value}-{os.getpid()}"

    @classmethod
    def build(cls, config: RuntimeConfig, environ: Mapping[str, str], **flags: object) -> ServeOptions:
        """Options from the config, the environment (downward API, local-run overrides) and flags.

        A flag given (not None) wins over its environment variable.
        """
        offset = flags.pop("port_offset", None)
        if offset is None:
            raw = environ.get(ENV_PORT_OFFSET, "0")
            if not raw.lstrip("-").isdigit():
                raise OptionsError(f"{ENV_PORT_OFFSET}={raw!r} is not an integer")
            offset = int(raw)
        addresses = flags.pop("prefill_addresses", None) or environ.get(ENV_PREFILL_ADDRESSES, "")
        addresses_file = flags.pop("prefill_addresses_file", None) or environ.get(ENV_PREFILL_ADDRESSES_FILE, "")
        if addresses and addresses_file:
            raise OptionsError(f"{ENV_PREFILL_ADDRESSES} and {ENV_PREFILL_ADDRESSES_FILE} are both set: use one")
        opts = cls(config=config, pod_name=environ.get("POD_NAME", ""),
                   pod_namespace=environ.get("POD_NAMESPACE", config.namespace), pod_ip=environ.get("POD_IP", ""),
                   port_offset=int(offset),  # type: ignore[call-overload]
                   prefill_addresses=parse_addresses(str(addresses)) if addresses else (),
                   prefill_addresses_file=Path(str(addresses_file)) if addresses_file else None)
        raw_connector = flags.pop("kv_connector", None) or environ.get(ENV_KV_CONNECTOR, "") or KvConnector.PDFLEET
        try:
            opts = replace(opts, kv_connector=KvConnector(str(raw_connector)))
        except ValueError:
            raise OptionsError(f"{ENV_KV_CONNECTOR}={raw_connector!r} is not one of "
                               f"{[k.value for k in KvConnector]}") from None
        if opts.kv_connector is KvConnector.NONE and (config.role is not Role.DECODE or config.model is not None):
            raise OptionsError(f"{ENV_KV_CONNECTOR}=none is a decode setting of seeded state (a decode that "
                               "recomputes prompts): unset it on this " + (config.role.value if config.model is None
                                                                            else "model pod"))
        if config.canary_period_seconds is not None:  # the deployment's period; a flag still wins
            opts = replace(opts, canary_period_s=config.canary_period_seconds)
        opts = replace(opts, **{k: v for k, v in flags.items() if v is not None})  # type: ignore[arg-type]
        if (place := _group_env(config, environ)) is not None:
            member, leader, leader_address = place
            opts = replace(opts, group_member=member, group_leader=leader, group_leader_address=leader_address)
        highest = max(opts.http_port, opts.metrics_port, opts.admin_port, opts.bootstrap_port,
                      opts.engine_port + config.shape.world - 1)
        if min(opts.http_port, opts.metrics_port, opts.admin_port, opts.bootstrap_port, opts.engine_port) < 1 \
                or highest > 65535:
            raise OptionsError(f"port offset {opts.port_offset} moves a port outside 1-65535")
        if opts.canary_tokens < 1 or opts.canary_period_s <= 0 or opts.retry_period_s <= 0:
            raise OptionsError("canary tokens and periods must be positive")
        if config.group is not None and not 1 <= opts.group_port <= 65535:
            raise OptionsError(f"port offset {opts.port_offset} moves group.port outside 1-65535")
        if not 0 < opts.room_ttl_s <= 3600:
            raise OptionsError(f"--room-ttl {opts.room_ttl_s} must be in (0, 3600] seconds")
        return opts


def _group_env(config: RuntimeConfig, environ: Mapping[str, str]) -> tuple[int, str, tuple[str, int] | None] | None:
    """The group fields from the pod's environment (member, leader, leader address; None without a group);
    ``OptionsError`` naming the variable and the fix."""
    raw = environ.get(GROUP_MEMBER_ENV, "")
    group = config.group
    if group is None:
        if raw not in ("", "0"):
            raise OptionsError(f"{GROUP_MEMBER_ENV}={raw} is set but the runtime config has no group: set group "
                               "(nodesPerReplica > 1) in the config, or leave the variable unset")
        return None
    if not raw.isdigit() or int(raw) >= group.nodes:
        raise OptionsError(f"{GROUP_MEMBER_ENV}={raw!r} must be this pod's place in its group, 0 to "
                           f"{group.nodes - 1} (group.nodes {group.nodes}; 0 = the leader)")
    member = int(raw)
    leader = environ.get(GROUP_LEADER_ENV, "")
    address = environ.get(ENV_GROUP_LEADER_ADDRESS, "")
    parsed = parse_addresses(address, ENV_GROUP_LEADER_ADDRESS)[0] if address else None
    if member > 0 and not leader and parsed is None:
        raise OptionsError(f"{GROUP_MEMBER_ENV}={member} needs {GROUP_LEADER_ENV} (the leader's pod name): "
                           f"the member reaches its leader at <leader>.{group.service}.<namespace>.svc")
    return member, leader, parsed
