"""The pod readiness gate: the ``pdfleet.io/transfer-path`` condition, written through pods/status.

A gate writer is injected into the server, so tests run without a cluster (``NoGate``, or a
recording fake) or against the real test apiserver (``KubeGate.from_kubeconfig``). In a pod,
``KubeGate.in_cluster`` uses the ServiceAccount token the operator mounts (its Role allows get
pods and get/patch pods/status, nothing else). A strategic-merge patch merges conditions by
``type``, so the kubelet's own conditions are left alone. The blocking client runs off the event loop,
with the deadlines of ``pdfleet_runtime.kubeapi`` on every call.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pdfleet_runtime.kubeapi import api_client

__all__ = ["SERVICE_ACCOUNT_TOKEN", "GateWriter", "KubeGate", "NoGate", "make_gate"]

log = logging.getLogger("pdfleet_runtime.server.gate")  # the name log readers know

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_PATCH = "application/strategic-merge-patch+json"


class GateWriter(Protocol):
    async def set(self, ready: bool, reason: str, message: str) -> None:
        """Write the condition; raise on failure (the server retries on its next tick)."""
        ...

    async def annotations(self) -> dict[str, str] | None:
        """The pod's annotations (the operator's drain request lives there); None outside a cluster."""
        ...

    async def set_condition(self, condition_type: str, ok: bool, reason: str, message: str) -> None:
        """Write another pod condition (``pdfleet.io/drained``)."""
        ...


class NoGate:
    """Outside a cluster: nothing to write or read."""

    async def set(self, ready: bool, reason: str, message: str) -> None:
        return None

    async def annotations(self) -> dict[str, str] | None:
        return None

    async def set_condition(self, condition_type: str, ok: bool, reason: str, message: str) -> None:
        return None


class KubeGate:
    """Patches one pod's condition ``condition_type`` through the Kubernetes API."""

    def __init__(self, api: Any, namespace: str, pod: str, condition_type: str) -> None:
        self.api, self.namespace, self.pod, self.condition_type = api, namespace, pod, condition_type

    @classmethod
    def in_cluster(cls, namespace: str, pod: str, condition_type: str) -> KubeGate:
        from kubernetes import client

        return cls(client.CoreV1Api(api_client(in_cluster=True)), namespace, pod, condition_type)

    @classmethod
    def from_kubeconfig(cls, path: Path, namespace: str, pod: str, condition_type: str) -> KubeGate:
        from kubernetes import client

        return cls(client.CoreV1Api(api_client(path)), namespace, pod, condition_type)

    def body(self, ready: bool, reason: str, message: str, condition_type: str | None = None) -> dict[str, Any]:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"status": {"conditions": [{
            "type": condition_type or self.condition_type, "status": "True" if ready else "False", "reason": reason,
            "message": message[:1000], "lastTransitionTime": now, "lastProbeTime": now}]}}

    async def set(self, ready: bool, reason: str, message: str) -> None:
        await self.set_condition(self.condition_type, ready, reason, message)

    async def set_condition(self, condition_type: str, ok: bool, reason: str, message: str) -> None:
        body = self.body(ok, reason, message, condition_type)
        await asyncio.to_thread(self.api.patch_namespaced_pod_status, self.pod, self.namespace, body,
                                _content_type=_PATCH)

    async def annotations(self) -> dict[str, str] | None:
        pod = await asyncio.to_thread(self.api.read_namespaced_pod, self.pod, self.namespace)
        return dict(pod.metadata.annotations or {})


def make_gate(enabled: bool, namespace: str, pod: str, condition_type: str, kubeconfig: Path | None = None,
              token: Path = SERVICE_ACCOUNT_TOKEN) -> GateWriter:
    """The writer for this process: a kubeconfig if given, in-cluster if a token is mounted, else none.

    ``enabled`` is the caller's decision (``serve`` passes: gating on and in a cluster or a kubeconfig given).
    """
    if not enabled or not pod:
        return NoGate()
    if kubeconfig is not None:
        return KubeGate.from_kubeconfig(kubeconfig, namespace, pod, condition_type)
    if token.exists():
        return KubeGate.in_cluster(namespace, pod, condition_type)
    log.info("not in a cluster (no service account token): the readiness gate is not written")
    return NoGate()
