"""The runtime config (``pdfleet_runtime.config.RuntimeConfig``) of a role, in a ConfigMap.

The operator writes the same model the runtime reads, so the file cannot drift from what
`pdfleet-runtime serve` accepts. The secret is mounted from a Secret; only its path is here.
"""

from __future__ import annotations

import re
from pathlib import Path

from pdfleet_operator.api.constants import LABEL_REVISION, LABEL_ROLE, Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.compat import model_identity
from pdfleet_operator.resources.names import (
    HUB_TOKEN_FILE,
    HUB_TOKEN_MOUNT,
    SECRET_FILE,
    WEIGHTS_MOUNT,
    WORKER_SECRET_MOUNT,
    config_name,
    group_service_name,
    owner_labels,
    service_name,
)
from pdfleet_operator.resources.plugins.registry import engine_plugin
from pdfleet_operator.resources.router import HEALTH_FAILURES, ROUTER_DROP_BOUND_S
from pdfleet_runtime.config import GROUP_PORT, GroupConfig, HubSourceConfig, ModelSourceConfig, RuntimeConfig
from pdfleet_runtime.model.hub_cache import snapshot_dir
from pdfleet_runtime.records import ParallelShape

__all__ = ["CONFIG_FILE", "CONFIG_MOUNT", "GROUP_SECRET_MOUNT", "SECRET_FILE", "SECRET_MOUNT", "WORKER_SECRET_MOUNT",
           "runtime_config", "runtime_configmap"]

CONFIG_MOUNT = "/etc/pdfleet"
CONFIG_FILE = "runtime.yaml"
SECRET_MOUNT = "/var/run/pdfleet/auth"
DEFAULT_HUB = "https://huggingface.co"
GROUP_SECRET_MOUNT = "/var/run/pdfleet/group-auth"  # the role's group key (multi-node replicas), this role only


def runtime_config(name: str, namespace: str, spec: PDDeploymentSpec, role: Role) -> RuntimeConfig:
    mine = spec.prefill if role is Role.PREFILL else spec.decode
    other = spec.decode if role is Role.PREFILL else spec.prefill
    return RuntimeConfig(
        deployment=name,
        namespace=namespace,
        role=role.value,
        runtime_version=mine.runtime_version,
        layout=spec.model.layout,
        model_identity=model_identity(spec) or None,
        shape=ParallelShape(mine.parallelism.tensor, mine.parallelism.pipeline),
        peer_shape=ParallelShape(other.parallelism.tensor, other.parallelism.pipeline),
        backend=spec.transfer.backend,
        protocol=spec.transfer.protocol,
        rdma_devices=tuple(spec.transfer.rdma_devices or ()),
        max_concurrent_requests=mine.pool.max_concurrent_requests,
        kv_tokens=mine.pool.kv_tokens_per_replica,
        prefill_service=service_name(name, Role.PREFILL),
        secret_path=f"{SECRET_MOUNT}/{SECRET_FILE}",
        worker_key_path=f"{WORKER_SECRET_MOUNT}/{SECRET_FILE}",
        drain_timeout_seconds=spec.rollout.drain_timeout_seconds,
        canary_period_seconds=spec.transfer.canary_period_seconds,  # unset: not written (older runtimes read it)
        # With routers, a drain answers /health 503 this long before it refuses work (docs/router.md).
        router_drop_seconds=ROUTER_DROP_BOUND_S if spec.router is not None else 0.0,
        # ... or until every router has failed that many checks, answered 503 by the pod (pod/router_checks.py).
        router_health_failures=HEALTH_FAILURES if spec.router is not None else 0,
        served_model_name=spec.model.served_name,  # unset: the runtime answers as the deployment's name
        group=_group(name, mine.parallelism.nodes_per_replica, role),
        model=_model(spec),
    )


def _model(spec: PDDeploymentSpec) -> ModelSourceConfig | None:
    """The built-in runtime computes the model at spec.model.source.path (mounted by ``pods.runtime_pod``), or
    the Hub commit it fetches into the node's weights cache first (``pods`` mounts the cache and the token); no
    source: seeded state; an engine beside the agent reads its own source."""
    src = spec.model.source
    if src is None or engine_plugin(spec).container is not None:
        return None
    hub = src.hugging_face
    if hub is None:
        return ModelSourceConfig(path=src.path, digest=src.digest) if src.path is not None else None
    if hub.revision is None or not re.fullmatch(r"[0-9a-f]{40}", hub.revision):  # admission: builtin-hub-source; model_ref
        raise ValueError(f"model.source.huggingFace.revision {hub.revision!r} is not a commit: the operator "
                         "renders a branch or tag as the commit it resolved it to (status.model)")
    cache = Path(WEIGHTS_MOUNT)
    token = Path(HUB_TOKEN_MOUNT) / HUB_TOKEN_FILE if hub.token_secret else None
    return ModelSourceConfig(path=snapshot_dir(cache, hub.id, hub.revision), hub=HubSourceConfig(
        id=hub.id, commit=hub.revision, endpoint=hub.endpoint or DEFAULT_HUB, token_path=token, cache=cache))


def _group(name: str, nodes: int, role: Role) -> GroupConfig | None:
    """A replica across ``nodes`` pods: every member reads this file and learns its own place from its env."""
    if nodes == 1:
        return None
    return GroupConfig(nodes=nodes, service=group_service_name(name, role), port=GROUP_PORT,
                       secret_path=f"{GROUP_SECRET_MOUNT}/{SECRET_FILE}")


def runtime_configmap(name: str, namespace: str, spec: PDDeploymentSpec, role: Role, revision: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_name(name, role, revision), "namespace": namespace,
                     "labels": {**owner_labels(name), LABEL_ROLE: role.value, LABEL_REVISION: revision}},
        "data": {CONFIG_FILE: runtime_config(name, namespace, spec, role).to_yaml()},
    }
