"""Finding prefill pods: DNS of the headless Service in a cluster; static or file lists on loopback in tests.

Decode ranks address each prefill pod directly (each pod's registry is its own), never through a
load-balanced Service. A headless Service's DNS name resolves to one A record per ready pod, so
re-resolving notices a prefill pod that restarted with a new address; a pod that restarted at the
same address is noticed by its new ``boot`` id in the next reply (``decode.PrefillLink``).

Resolvers are synchronous and fast (one ``getaddrinfo`` or one small file read); callers run them
off the event loop.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["DnsResolver", "Endpoint", "FileResolver", "ResolveError", "Resolver", "StaticResolver"]


class ResolveError(OSError):
    """The name did not resolve (or the list is empty)."""


@dataclass(frozen=True, order=True)
class Endpoint:
    host: str
    port: int

    def url(self, path: str = "") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class Resolver(Protocol):
    def resolve(self) -> list[Endpoint]:
        """Every prefill pod's bootstrap endpoint, sorted; ``ResolveError`` when there is none."""
        ...


class DnsResolver:
    """A headless Service: ``<service>.<namespace>.svc`` resolves to every ready prefill pod's address."""

    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port

    def resolve(self) -> list[Endpoint]:
        try:
            infos = socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise ResolveError(f"cannot resolve prefill service {self.name}: {e}") from e
        eps = sorted({Endpoint(str(info[4][0]), self.port) for info in infos})
        if not eps:
            raise ResolveError(f"prefill service {self.name} has no addresses")
        return eps


class StaticResolver:
    """Tests and single-host runs on 127.0.0.1: a fixed list (``set`` replaces it, as a restart would)."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self._endpoints = sorted(endpoints)

    def set(self, endpoints: list[Endpoint]) -> None:
        self._endpoints = sorted(endpoints)

    def resolve(self) -> list[Endpoint]:
        if not self._endpoints:
            raise ResolveError("static resolver holds no prefill endpoint")
        return list(self._endpoints)


class FileResolver:
    """Tests on loopback across processes: a JSON list of ``"host:port"`` re-read on every resolve.

    The test harness rewrites the file (atomically) when it restarts a prefill pod on a new port,
    as kube-dns would answer with the new pod's address.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @staticmethod
    def write(path: Path, endpoints: list[Endpoint]) -> None:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps([str(e) for e in endpoints]))
        tmp.replace(path)

    def resolve(self) -> list[Endpoint]:
        try:
            items = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise ResolveError(f"cannot read prefill endpoints from {self.path}: {e}") from e
        eps = []
        for item in items if isinstance(items, list) else []:
            host, _, port = str(item).rpartition(":")
            if host and port.isdigit():
                eps.append(Endpoint(host, int(port)))
        if not eps:
            raise ResolveError(f"{self.path} lists no prefill endpoint")
        return sorted(eps)
