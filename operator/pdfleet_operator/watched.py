"""Watched state: what the operator owns, as its watches last saw it, plus its own latest writes.

A reconcile pass reads no lists: kopf keeps one index per owned kind (each watch filtered on the
server by the deployment label), holding every object's latest body under ``(namespace,
deployment)``, plus the PDDeployments and the nodes (reduced to placement facts). kopf fills every
index from a full listing before any handler runs, and re-lists after a watch restart or an
unpause, so a pass never starts from a partial view; its cost follows the deployment's own objects,
not the cluster's.

What an index cannot know yet is the operator's own write of a moment ago: a pass that started two
drains must not be followed by one that, from an index a few milliseconds behind, sees those pods
routable and starts two more. So each write's response (the object at its new resourceVersion) is
kept as an overlay until the watch delivers that version or a newer one; a pass sees, per object,
the newer of the two. resourceVersions are compared as integers, which they are on an etcd-backed
apiserver (an unreadable one counts as older, so the watched copy wins).

Indexes are read on the event loop (kopf mutates them there); ``view`` copies one deployment's
objects out for the pass's worker thread. The overlay is shared with worker threads under a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdfleet_operator.placement import NodeFacts

__all__ = ["INDEX_NODES", "INDEX_PDDEPLOYMENTS", "OWNED_KINDS", "View", "WatchedState", "index_id", "newer"]

# (apiVersion, plural, kind) of everything the operator creates; each is watched and indexed.
OWNED_KINDS = (
    ("v1", "pods", "Pod"),
    ("v1", "services", "Service"),
    ("v1", "configmaps", "ConfigMap"),
    ("v1", "serviceaccounts", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "roles", "Role"),
    ("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    ("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy"),
    ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    ("apps/v1", "deployments", "Deployment"),
    ("apps/v1", "controllerrevisions", "ControllerRevision"),
    ("pdfleet.io/v1alpha1", "pdrolescales", "PDRoleScale"),  # a role's count for an HPA (scalingAdapter)
)
INDEX_PDDEPLOYMENTS = "pdfleet_idx_pddeployments"
INDEX_NODES = "pdfleet_idx_nodes"
OVERLAY_MAX_AGE_S = 60.0  # a write the watch never confirms (a lost event) stops shadowing it after this


def index_id(plural: str) -> str:
    """The kopf handler id of a kind's index (also the kwarg name kopf gives it to handlers)."""
    return f"pdfleet_idx_{plural}"


def _rv(obj: Mapping | None) -> int:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or -1)
    except (TypeError, ValueError):
        return -1


def newer(watched: Mapping | None, written: Mapping | None) -> bool:
    """Whether the written copy is newer than the watched one."""
    return _rv(written) > _rv(watched)


@dataclass
class _Written:
    deployment: str
    obj: dict
    deleted: bool  # a delete's response: once the watch has no such object, it is gone
    at: float


@dataclass(frozen=True)
class View:
    """One deployment as a pass sees it: its body, owned objects by kind (name -> body), the nodes."""

    body: dict | None
    objects: Mapping[str, Mapping[str, dict]] = field(default_factory=dict)
    nodes: tuple[NodeFacts, ...] = ()

    def of(self, kind: str) -> list[dict]:
        return list((self.objects.get(kind) or {}).values())


class WatchedState:
    def __init__(self) -> None:
        self._indices: Mapping[str, Any] = {}
        self._overlay: dict[tuple[str, str, str], _Written] = {}  # (kind, namespace, name)
        self._gone: set[str] = set()  # uids a fresh listing did not have (an index keeps what a re-list missed)
        self._lock = threading.Lock()

    def bind(self, indices: Mapping[str, Any]) -> None:
        """kopf's indices (the kwargs of a startup handler), kept by reference: kopf updates them."""
        self._indices = {k: v for k, v in indices.items() if k.startswith("pdfleet_idx_")}

    @property
    def bound(self) -> bool:
        return bool(self._indices)

    def wrote(self, kind: str, namespace: str, deployment: str, obj: Mapping | None, *, deleted: bool = False) -> None:
        """Overlay a write's response (any thread); a response that is not the object is ignored."""
        meta = (obj or {}).get("metadata") or {}
        if not meta.get("name") or _rv(obj) < 0:
            return
        with self._lock:
            key = (kind, namespace, meta["name"])
            held = self._overlay.get(key)
            if held is None or newer(held.obj, obj):
                self._overlay[key] = _Written(deployment, dict(obj or {}), deleted, time.monotonic())

    def _store(self, index: str, key: object) -> list:
        idx = self._indices.get(index)
        if idx is None or key not in idx:
            return []
        if not self._gone or index == INDEX_NODES:
            return list(idx[key])
        return [o for o in idx[key] if (o.get("metadata") or {}).get("uid") not in self._gone]

    def confirm(self, namespace: str, name: str, kind: str, listing: Mapping) -> None:
        """A fresh listing of one deployment's ``kind``: what the index holds beyond it, and older than it,
        was deleted while a watch was down (kopf re-lists after a restart but never drops such objects).
        Event loop only."""
        _, plural, _ = next(k for k in OWNED_KINDS if k[2] == kind)
        have = {(o.get("metadata") or {}).get("uid") for o in listing.get("items") or ()}
        as_of = _rv(listing)
        for obj in self._store(index_id(plural), (namespace, name)):
            uid = (obj.get("metadata") or {}).get("uid")
            if uid and uid not in have and _rv(obj) <= as_of:
                self._gone.add(uid)

    def view(self, namespace: str, name: str) -> View:
        """Copy one deployment's state out of the indexes, overlaid with newer writes (event loop only)."""
        bodies = self._store(INDEX_PDDEPLOYMENTS, (namespace, name))
        objects: dict[str, dict[str, dict]] = {}
        for _, plural, kind in OWNED_KINDS:
            objects[kind] = {o["metadata"]["name"]: o for o in self._store(index_id(plural), (namespace, name))}
        objects["PDDeployment"] = {name: bodies[0]} if bodies else {}
        now = time.monotonic()
        with self._lock:
            for key, w in list(self._overlay.items()):
                kind, ns, obj_name = key
                if now - w.at > OVERLAY_MAX_AGE_S:
                    del self._overlay[key]
                    continue
                if ns != namespace or w.deployment != name:
                    continue
                have = objects.setdefault(kind, {})
                watched = have.get(obj_name)
                if watched is not None and not newer(watched, w.obj):
                    del self._overlay[key]  # the watch caught up
                elif watched is None and w.deleted:
                    del self._overlay[key]  # deleted, and the watch saw it go
                else:
                    have[obj_name] = w.obj
        body = objects.pop("PDDeployment", {}).get(name)
        return View(body=body, objects=objects, nodes=tuple(self._store(INDEX_NODES, "nodes")))

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted deployment's overlay."""
        with self._lock:
            for key in [k for k, w in self._overlay.items() if k[1] == namespace and w.deployment == name]:
                del self._overlay[key]
