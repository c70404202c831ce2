"""What a kubelet derives from a pod object before it starts a container: pure functions on the pod's dict.

- ``expand``: ``$(VAR)`` references in env values, command and args, by the kubelet's rules
  (``$$`` escapes, an undefined reference stays as written);
- ``container_env``: the container's env list resolved (values, downward-API fieldRefs, ConfigMap and
  Secret keys through a lookup the caller supplies), each entry expanded against the ones before it;
- ``hook``: a preStop/postStart handler as an ``Exec``, ``HttpGet`` (its named port resolved) or ``Sleep``;
- ``resolv_conf`` and ``hosts``: the pod's /etc/resolv.conf (ClusterFirst) and /etc/hosts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CLUSTER_DOMAIN", "Exec", "HttpGet", "PodSpecError", "Sleep", "container_env", "expand", "field_value", "hook",
           "hosts", "port_number", "resolv_conf"]

CLUSTER_DOMAIN = "cluster.local"
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodSpecError(ValueError):
    """A pod uses something the harness's kubelet does not implement; the message names the field."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` -> its value when defined, ``$$`` -> ``$``, anything else as written (the kubelet's rule)."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, text)


def field_value(pod: dict, path: str) -> str:
    """A downward-API ``fieldRef.fieldPath`` of the pod."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path not in simple:
        raise PodSpecError(f"fieldRef.fieldPath {path!r} is not supported by the harness's kubelet")
    return str(simple[path] or "")


def container_env(pod: dict, container: dict, lookup: Callable[[str, str, str], str | None],
                  base: Mapping[str, str] = ()) -> dict[str, str]:
    """The container's environment: ``base`` (the kubelet's own variables) then ``env`` in order.

    ``lookup(kind, name, key)`` reads a ConfigMap or Secret key (kind ``configMap``/``secret``)."""
    env = dict(base)
    for item in container.get("env") or ():
        name = item["name"]
        src = item.get("valueFrom")
        if src is None:
            env[name] = expand(item.get("value") or "", env)
        elif "fieldRef" in src:
            env[name] = field_value(pod, src["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in src or "secretKeyRef" in src:
            kind = "configMap" if "configMapKeyRef" in src else "secret"
            ref = src[f"{kind}KeyRef"]
            value = lookup(kind, ref["name"], ref["key"])
            if value is None and not ref.get("optional"):
                raise PodSpecError(f"env {name}: {kind} {ref['name']!r} has no key {ref['key']!r}")
            if value is not None:
                env[name] = value
        else:
            raise PodSpecError(f"env {name}: valueFrom {sorted(src)} is not supported by the harness's kubelet")
    return env


def port_number(container: dict, port: int | str) -> int:
    """A probe's or hook's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or ():
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"container {container['name']!r} has no port named {port!r}")


@dataclass(frozen=True)
class Exec:
    command: tuple[str, ...]


@dataclass(frozen=True)
class HttpGet:
    path: str
    port: int
    scheme: str = "HTTP"
    host: str = ""  # empty: the pod's IP


@dataclass(frozen=True)
class Sleep:
    seconds: int


def hook(container: dict, which: str) -> Exec | HttpGet | Sleep | None:
    """``lifecycle.<which>`` of the container (``preStop``, ``postStart``), or None."""
    handler: Any = (container.get("lifecycle") or {}).get(which)
    if not handler:
        return None
    if "sleep" in handler:
        return Sleep(int(handler["sleep"]["seconds"]))
    if "exec" in handler:
        return Exec(tuple(handler["exec"].get("command") or ()))
    if "httpGet" in handler:
        h = handler["httpGet"]
        return HttpGet(h.get("path") or "/", port_number(container, h["port"]), h.get("scheme") or "HTTP",
                       h.get("host") or "")
    raise PodSpecError(f"container {container['name']!r}: lifecycle.{which} {sorted(handler)} is not supported")


def resolv_conf(namespace: str, nameserver: str) -> str:
    """ClusterFirst DNS, as the kubelet writes it."""
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"search {search}\nnameserver {nameserver}\noptions ndots:5\n"


def hosts(pod: dict) -> str:
    """/etc/hosts: loopback, and the pod's hostname (with its subdomain's FQDN when it has one)."""
    meta, spec = pod["metadata"], pod["spec"]
    hostname = spec.get("hostname") or meta["name"]
    names = [hostname]
    if spec.get("subdomain"):
        names.insert(0, f"{hostname}.{spec['subdomain']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}")
    ip = (pod.get("status") or {}).get("podIP", "")
    return f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{ip}\t{' '.join(names)}\n"
