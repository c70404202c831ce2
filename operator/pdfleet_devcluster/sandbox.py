"""The cluster's private network: a network and mount namespace the cluster and its client live in.

Every local cluster (a test worker's, the demo's, ``dev up``'s) runs inside a namespace made after
the set-up that needs the network (pip, apt, the Go builds): only loopback and a bridge holding the
gateway of the cluster's pod range, and no default route, so nothing a test starts can reach any
address but 127.0.0.0/8 and the cluster's own ranges. The process that calls ``enter`` (the pytest
worker, ``pdfleet demo``, ``pdfleet dev up``) moves its calling thread into it, so every process and
thread it starts afterwards is inside too. ``/run/netns`` and ``/etc/netns`` get tmpfs mounts of the
namespace's own, so the per-pod network namespaces (``ip netns add``) and their resolv.conf stay
private to this cluster.

``Ranges`` is pure: distinct ranges per index, so parallel clusters never collide.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BRIDGE", "CONTROL_ADDRESS", "Ranges", "SandboxError", "current_index", "default_route", "enter", "inside",
           "routed"]

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
BRIDGE = "pdf0"
CONTROL_ADDRESS = "192.0.2.1"
"""TEST-NET-1 (RFC 5737): outside every range the cluster has; the positive control's target."""
_MARK = "/run/netns/.pdfleet-cluster"


class SandboxError(RuntimeError):
    """The private namespace could not be made or is not there; the message says what to do."""


@dataclass(frozen=True)
class Ranges:
    """A cluster's pod and Service ranges, and the addresses derived from them (index: 0..63)."""

    index: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.index < 64:
            raise SandboxError(f"sandbox index {self.index} out of range 0-63")

    @property
    def pod_cidr(self) -> str:
        return f"10.{64 + self.index}.0.0/16"

    @property
    def service_cidr(self) -> str:
        return f"10.{160 + self.index}.0.0/16"

    @property
    def gateway(self) -> str:
        """The bridge's address: the node's (and the apiserver's advertised) address, pods' default route."""
        return f"10.{64 + self.index}.0.1"

    @property
    def kubernetes_service_ip(self) -> str:
        return f"10.{160 + self.index}.0.1"

    @property
    def dns_service_ip(self) -> str:
        return f"10.{160 + self.index}.0.10"

    @property
    def prefix(self) -> int:
        return ipaddress.ip_network(self.pod_cidr).prefixlen


def _sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def routed(address: str, table: Path = Path("/proc/net/route")) -> bool:
    """Whether any IPv4 route of this namespace covers ``address`` (read from /proc/net/route; sends nothing)."""
    addr = int(ipaddress.IPv4Address(address))
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return True  # cannot tell: treat as routed
    for line in lines:
        f = line.split()
        if len(f) >= 8:  # destination and mask are little-endian hex
            dest, mask = (int.from_bytes(bytes.fromhex(x), "little") for x in (f[1], f[7]))
            if addr & mask == dest & mask:
                return True
    return False


def default_route() -> bool:
    """Whether this namespace has a default route (sends nothing)."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return True  # cannot tell: treat as outside
    return any(f[1] == "00000000" and f[7] == "00000000" for f in (line.split() for line in lines) if len(f) >= 8)


def inside() -> bool:
    """Whether this thread is in a cluster namespace ``enter`` made."""
    return Path(_MARK).exists() and not default_route()


def _mark() -> tuple[int, int] | None:
    """(ranges index, pid of the process that made it) of the namespace this thread is in."""
    try:
        index, pid = Path(_MARK).read_text().split()
        return int(index), int(pid)
    except (OSError, ValueError):
        return None


def current_index() -> int | None:
    """The ranges' index of the namespace this thread is in (None outside)."""
    mark = _mark()
    return mark[0] if mark else None


def enter(ranges: Ranges) -> None:
    """Move the calling thread into a new network and mount namespace and build the cluster network.

    Call it before starting any process or thread that must be inside: what runs already stays where
    it is (a thread of the process keeps its namespaces)."""
    mark = _mark()
    if inside() and mark is not None and mark[1] == os.getpid():
        if mark[0] != ranges.index:
            raise SandboxError(f"this namespace holds ranges {mark[0]}, not {ranges.index}: one per process")
        return
    # Outside, or inside one that another process made (a demo started by a test worker, whose own
    # cluster already holds that namespace's bridge and ranges): a new namespace of our own, nested.
    if threading.current_thread() is not threading.main_thread():
        raise SandboxError("enter the cluster namespace from the main thread")
    if os.geteuid() != 0:
        raise SandboxError("the cluster's private network namespace needs root (unshare, ip netns); run as root")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET | CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"unshare(CLONE_NEWNET|CLONE_NEWNS) failed: {os.strerror(err)}")
    _sh("mount", "--make-rprivate", "/")
    for d in ("/run/netns", "/etc/netns"):
        os.makedirs(d, exist_ok=True)
        _sh("mount", "-t", "tmpfs", "-o", "mode=0755,size=16m", "tmpfs", d)
    _sh("ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{ranges.gateway}/{ranges.prefix}", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    # The node reaches Service addresses as a real node does (a client here, `pdfleet dev chat`): a local
    # packet needs a route before kube-proxy's output DNAT rewrites it to an endpoint on the bridge.
    _sh("ip", "route", "add", ranges.service_cidr, "dev", BRIDGE)
    # The node routes between pods and Service addresses (kube-proxy's DNAT); nothing else is routed.
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    Path(_MARK).write_text(f"{ranges.index} {os.getpid()}\n")
    if default_route():
        raise SandboxError("a default route is visible right after unshare: not inside a private namespace")
