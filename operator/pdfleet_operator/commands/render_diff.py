"""`pdfleet render --diff NAME`: the cluster edge of ``upgrade_diff`` (reads the deployment, its pods and its
runtime ConfigMaps; writes nothing)."""

from __future__ import annotations

import json

from pdfleet_operator import __version__
from pdfleet_operator.api.constants import GROUP, LABEL_DEPLOYMENT, PLURAL, VERSION
from pdfleet_operator.api.models import PDDeploymentSpec, PDDeploymentStatus
from pdfleet_operator.model_ref import pinned
from pdfleet_operator.upgrade_diff import RoleDiff, role_diffs
from pdfleet_runtime.kubeapi import api_client

__all__ = ["format_diffs", "run_diff"]


def format_diffs(name: str, namespace: str, diffs: list[RoleDiff]) -> str:
    lines = [f"pdd/{name} in {namespace}, against pdfleet {__version__}'s rendering:"]
    for d in diffs:
        running = ", ".join(d.running) or "none"
        head = f"{d.role.value}: {d.pods} pod(s) on revision {running}; this release renders revision {d.revision}"
        if not d.rolls:
            lines.append(f"{head}: unchanged")
            continue
        lines.append(f"{head}: its operator rolls {d.role.value} ({len(d.changes)} field(s) differ on {d.sample})")
        lines += [f"  {c}" for c in d.changes] or ["  (the spec itself changed since the pods were made)"]
    return "\n".join(lines)


def run_diff(name: str, namespace: str, output: str) -> int:
    from kubernetes.client import CoreV1Api, CustomObjectsApi

    from pdfleet_operator.commands.reads import read_failed

    try:
        api = api_client()
        obj = CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        body = obj if isinstance(obj, dict) else {}
        spec = PDDeploymentSpec.model_validate(body.get("spec") or {})
        # A Hub branch or tag renders as the commit the operator resolved it to (status.model), as the pods do.
        stored = PDDeploymentStatus.model_validate(body.get("status") or {})
        spec = pinned(spec, stored.model) or spec
        core = CoreV1Api(api)
        selector = f"{LABEL_DEPLOYMENT}={name}"
        pods = api.sanitize_for_serialization(core.list_namespaced_pod(namespace, label_selector=selector).items)
        maps = api.sanitize_for_serialization(
            core.list_namespaced_config_map(namespace, label_selector=selector).items)
    except Exception as exc:  # the apiserver's refusal, no kubeconfig, an unreadable spec: said, not a traceback
        return read_failed(name, namespace, exc)
    diffs = role_diffs(name, namespace, spec, pods, maps)
    if output == "json":
        print(json.dumps({"name": name, "namespace": namespace, "release": __version__,
                          "roles": [{**d.model_dump(mode="json"), "rolls": d.rolls} for d in diffs]}, indent=2))
    else:
        print(format_diffs(name, namespace, diffs))
    return 1 if any(d.rolls for d in diffs) else 0
