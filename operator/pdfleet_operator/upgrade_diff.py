"""What this pdfleet's rendering would change in a running fleet: ``pdfleet render --diff`` (pure).

Before an operator upgrade, the new release's CLI compares what its code renders for a deployment's stored spec
with what the running pods and their runtime ConfigMaps hold (rendered by the operator now running): per role,
the revision its pods run and the one this code gives (``resources.revision``: a different one is a rollout of
that role once the new operator runs), and the fields that differ. A live object holds more than was rendered
(the API server's defaults, the kubelet's fields): only the rendered keys are compared, and named list items
(containers, env, volumes, ports, mounts) are matched by name, so an item the new rendering drops is reported.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from pdfleet_operator.api.constants import LABEL_DEPLOYMENT, Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.observe import pod_identity
from pdfleet_operator.resources.names import config_name
from pdfleet_operator.resources.pods import ANNOTATION_IDENTITY, runtime_pod
from pdfleet_operator.resources.revision import role_revision
from pdfleet_operator.resources.runtime_config import runtime_configmap

__all__ = ["FieldChange", "RoleDiff", "compare", "role_diffs"]

ABSENT = "<absent>"


class FieldChange(BaseModel):
    """One field that differs: its path, the running value and the rendered one (JSON text; ``<absent>``)."""

    model_config = ConfigDict(frozen=True)

    path: str
    running: str
    rendered: str

    def __str__(self) -> str:
        return f"{self.path}: {self.running} -> {self.rendered}"


class RoleDiff(BaseModel):
    """One role: its live pods' revisions, the revision this code renders, and what differs on one pod of a
    revision other than it (every pod of one revision renders alike, but for names and indexes)."""

    model_config = ConfigDict(frozen=True)

    role: Role
    pods: int
    running: tuple[str, ...]
    revision: str
    sample: str | None = None
    changes: tuple[FieldChange, ...] = ()

    @property
    def rolls(self) -> bool:
        return any(r != self.revision for r in self.running)


def _text(value: Any) -> str:
    return ABSENT if value is ABSENT else json.dumps(value, sort_keys=True)


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items)


def compare(rendered: Any, live: Any, path: str) -> list[FieldChange]:
    """The rendered keys whose live values differ (keys only the live object has are the server's)."""
    if isinstance(rendered, dict) and isinstance(live, dict):
        out: list[FieldChange] = []
        for k, v in rendered.items():
            out += compare(v, live[k], f"{path}.{k}") if k in live else [FieldChange(
                path=f"{path}.{k}", running=ABSENT, rendered=_text(v))]
        return out
    if isinstance(rendered, list) and isinstance(live, list) and (_named(rendered) or _named(live)):
        ours, theirs = {i["name"]: i for i in rendered}, {i["name"]: i for i in live}
        out = []
        for n, item in ours.items():
            out += compare(item, theirs[n], f"{path}[{n}]") if n in theirs else [FieldChange(
                path=f"{path}[{n}]", running=ABSENT, rendered=_text(item))]
        out += [FieldChange(path=f"{path}[{n}]", running=_text(item), rendered=ABSENT)
                for n, item in theirs.items() if n not in ours]
        return out
    if isinstance(rendered, list) and isinstance(live, list) and len(rendered) == len(live):
        return [c for i, (a, b) in enumerate(zip(rendered, live, strict=True)) for c in compare(a, b, f"{path}[{i}]")]
    if rendered != live:
        return [FieldChange(path=path, running=_text(live), rendered=_text(rendered))]
    return []


def _compare_data(rendered: dict[str, str], live: dict[str, str]) -> list[FieldChange]:
    """A ConfigMap's data, each YAML document compared field by field."""
    def load(text: str | None) -> Any:
        try:
            return ABSENT if text is None else yaml.safe_load(text)
        except yaml.YAMLError:
            return text

    out: list[FieldChange] = []
    for key in sorted({*rendered, *live}):
        a, b = load(rendered.get(key)), load(live.get(key))
        if a is ABSENT or b is ABSENT:
            out += [] if a == b else [FieldChange(path=f"configmap.data[{key}]", running=_text(b), rendered=_text(a))]
        else:
            out += compare(a, b, f"configmap.data[{key}]")
    return out


def role_diffs(name: str, namespace: str, spec: PDDeploymentSpec, pods: list[dict],
               configmaps: list[dict]) -> list[RoleDiff]:
    """Per role, what this code's rendering changes in the running fleet ``name`` (its pods and ConfigMaps as
    the API server returns them)."""
    maps = {(c.get("metadata") or {}).get("name"): c for c in configmaps}
    out = []
    for role in Role:
        live = []
        for pod in pods:
            meta = pod.get("metadata") or {}
            ident = pod_identity((meta.get("annotations") or {}).get(ANNOTATION_IDENTITY, ""))
            if (meta.get("labels") or {}).get(LABEL_DEPLOYMENT) == name and ident is not None and ident[0] is role \
                    and not meta.get("deletionTimestamp"):
                live.append((pod, ident))
        revision = role_revision(spec, role)
        running = tuple(sorted({ident[1] for _, ident in live}))
        stale = next(((p, i) for p, i in live if i[1] != revision), None)
        if stale is None:
            out.append(RoleDiff(role=role, pods=len(live), running=running, revision=revision))
            continue
        pod, (_, rev, index, member, _) = stale
        rendered = runtime_pod(name, namespace, spec, role, rev, index, member)
        changes = compare(rendered["spec"], pod.get("spec") or {}, "pod.spec")
        rendered_cm = runtime_configmap(name, namespace, spec, role, rev)
        live_cm = maps.get(config_name(name, role, rev))
        if live_cm is None:
            changes.append(FieldChange(path=f"configmap/{config_name(name, role, rev)}", running=ABSENT,
                                       rendered="(rendered)"))
        else:
            changes += _compare_data(rendered_cm["data"], live_cm.get("data") or {})
        out.append(RoleDiff(role=role, pods=len(live), running=running, revision=revision,
                            sample=(pod.get("metadata") or {}).get("name"), changes=tuple(changes)))
    return out
