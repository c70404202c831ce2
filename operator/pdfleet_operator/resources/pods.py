"""The runtime pod of one replica: tp x pp GPUs, fixed ports, a transfer-path readiness gate.

The operator manages these pods itself rather than through a Deployment or StatefulSet
(see docs/design-operator.md): a rollout must choose which pod drains, count draining pods
against the surge budget and delete a pod only after its in-flight transfers finish, which
neither controller lets another writer do.
"""

from __future__ import annotations

import copy

from pdfleet_operator.api.constants import GROUP, Role
from pdfleet_operator.api.models import HuggingFaceSource, PDDeploymentSpec, RoleSpec
from pdfleet_operator.resources.compat import compat_key
from pdfleet_operator.resources.engine import (
    HF_TOKEN_KEY,
    MODEL_VOLUME,
    STARTUP_FAILURES,
    STARTUP_PERIOD_S,
    with_engine,
)
from pdfleet_operator.resources.gang import gang_metadata, with_topology
from pdfleet_operator.resources.names import (
    HUB_TOKEN_FILE,
    HUB_TOKEN_MOUNT,
    LABEL_COMPAT,
    LABEL_GROUP,
    WEIGHTS_MOUNT,
    WEIGHTS_VOLUME,
    config_name,
    group_pod_name,
    group_secret_name,
    group_service_name,
    pod_labels,
    secret_name,
    service_account_name,
    service_name,
    worker_secret_name,
)
from pdfleet_operator.resources.plugins.contract import EnginePlugin
from pdfleet_operator.resources.plugins.registry import engine_plugin, router_plugin
from pdfleet_operator.resources.runtime_config import (
    CONFIG_FILE,
    CONFIG_MOUNT,
    GROUP_SECRET_MOUNT,
    SECRET_MOUNT,
    WORKER_SECRET_MOUNT,
)
from pdfleet_runtime.config import (
    BOOTSTRAP_PORT,
    ENGINE_PORT,
    GROUP_LEADER_ENV,
    GROUP_MEMBER_ENV,
    HTTP_PORT,
    METRICS_PORT,
    READINESS_GATE,
)
from pdfleet_runtime.links import LinkProtocol

__all__ = ["ANNOTATION_IDENTITY", "GPU_RESOURCE", "HOSTNAME_TOPOLOGY", "PRESTOP_DRAIN", "identity", "role_spec",
           "runtime_pod"]

GPU_RESOURCE = "nvidia.com/gpu"
ANNOTATION_IDENTITY = f"{GROUP}/identity"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
RUNTIME_UID = 1000
PRESTOP_DRAIN = ["pdfleet-runtime", "drain", "--wait", "--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}"]
# Time past the drain budget for the process to flush logs and exit after the drain.
EXIT_GRACE_SECONDS = 30
# The root filesystem is read-only; these memory/disk-backed mounts are the only writable places.
# /dev/shm (engine and NCCL shared-memory segments) counts against the pod's memory: the limit keeps
# a leak from taking the node's. /tmp holds scratch files (TMPDIR, HOME).
SHM_SIZE_LIMIT = "2Gi"
TMP_SIZE_LIMIT = "1Gi"


def role_spec(spec: PDDeploymentSpec, role: Role) -> RoleSpec:
    return spec.prefill if role is Role.PREFILL else spec.decode


def _extended(spec: PDDeploymentSpec, rs: RoleSpec) -> dict[str, str]:
    extended = {GPU_RESOURCE: str(rs.parallelism.gpus_per_pod)}
    if spec.transfer.protocol is LinkProtocol.RDMA:
        extended[spec.transfer.rdma_resource] = "1"  # the RDMA device plugin's share of the NIC
    return extended


def _resources(spec: PDDeploymentSpec, rs: RoleSpec) -> dict:
    res = rs.resources.model_dump(mode="json", by_alias=True, exclude_none=True)
    extended = _extended(spec, rs)
    for kind in ("limits", "requests"):
        res.setdefault(kind, {}).update(extended)
    return res


def identity(role: Role, revision: str, index: int, member: int = 0, nodes: int = 1) -> str:
    """``role/revision/index``; a pod of a multi-node group adds ``/member/nodes`` (its group's size)."""
    base = f"{role.value}/{revision}/{index}"
    return base if nodes == 1 else f"{base}/{member}/{nodes}"


def _group_env(leader: str, member: int) -> list[dict]:
    return [{"name": GROUP_MEMBER_ENV, "value": str(member)}, {"name": GROUP_LEADER_ENV, "value": leader}]


def _with_group(pod_spec: dict, container: dict, plugin: EnginePlugin, name: str, role: Role, leader: str,
                member: int) -> None:
    """A member of a multi-node group: DNS under the group's Service, the contract's env, one member per
    node (required anti-affinity against its own group), the role's group key, and where the runtime
    container is the engine its group port (an engine container's ranks meet over the engine's own)."""
    pod_spec["subdomain"] = group_service_name(name, role)
    container["env"][:0] = _group_env(leader, member)
    term = {"labelSelector": {"matchLabels": {LABEL_GROUP: leader}}, "topologyKey": HOSTNAME_TOPOLOGY}
    affinity = pod_spec.setdefault("affinity", {})
    anti = affinity.setdefault("podAntiAffinity", {})
    anti["requiredDuringSchedulingIgnoredDuringExecution"] = [
        *anti.get("requiredDuringSchedulingIgnoredDuringExecution", []), term]
    container["volumeMounts"].append({"name": "group-auth", "mountPath": GROUP_SECRET_MOUNT, "readOnly": True})
    pod_spec["volumes"].append(
        {"name": "group-auth", "secret": {"secretName": group_secret_name(name, role), "defaultMode": 0o400}})
    if plugin.container is None:
        port = plugin.group_port
        container["ports"].append({"name": port.name, "containerPort": port.port, "protocol": "TCP"})


def _env(rs: RoleSpec, role: Role) -> list[dict]:
    def field_ref(path: str) -> dict:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        {"name": "POD_NAME", **field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": "POD_IP", **field_ref("status.podIP")},
        {"name": "PDFLEET_ROLE", "value": role.value},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    env += [e.model_dump(mode="json", by_alias=True, exclude_none=True) for e in rs.env or ()]
    return env


def _security(spec: PDDeploymentSpec) -> dict:
    caps: dict = {"drop": ["ALL"]}
    if spec.transfer.protocol is LinkProtocol.RDMA:
        caps["add"] = ["IPC_LOCK"]  # pinning RDMA memory registrations
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": caps,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _with_weights_cache(pod_spec: dict, container: dict, hub: HuggingFaceSource) -> None:
    """The node's weights cache, read-write (the node's first pod fills a commit, the others read it), and the Hub
    token as a file the runtime reads (``RuntimeConfig.model.hub``), never in its environment."""
    pod_spec["volumes"].append({"name": WEIGHTS_VOLUME, **copy.deepcopy(hub.cache or {})})
    container["volumeMounts"].append({"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT})
    if hub.token_secret:
        pod_spec["volumes"].append({"name": "hub-token", "secret": {
            "secretName": hub.token_secret, "defaultMode": 0o400,
            "items": [{"key": HF_TOKEN_KEY, "path": HUB_TOKEN_FILE}]}})
        container["volumeMounts"].append({"name": "hub-token", "mountPath": HUB_TOKEN_MOUNT, "readOnly": True})


def runtime_pod(name: str, namespace: str, spec: PDDeploymentSpec, role: Role, revision: str, index: int,
                member: int = 0) -> dict:
    """Replica ``index``'s pod; with nodesPerReplica N > 1, member ``member`` (0 = the leader) of its group
    of N pods, each with its share of the replica's ranks (``RuntimeConfig.local_world``)."""
    rs = role_spec(spec, role)
    plugin = engine_plugin(spec)
    nodes = rs.parallelism.nodes_per_replica
    ranks = rs.parallelism.tensor * rs.parallelism.pipeline // nodes
    pod = group_pod_name(name, role, revision, index, member)
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
             {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]  # the PodMonitor's port
    if role is Role.PREFILL:
        ports.append({"name": "bootstrap", "containerPort": BOOTSTRAP_PORT, "protocol": "TCP"})
    ports += [{"name": f"engine-{r}", "containerPort": ENGINE_PORT + r, "protocol": "TCP"} for r in range(ranks)]
    container: dict = {
        "name": "runtime",
        "image": rs.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["pdfleet-runtime", "serve", "--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}",
                    *(router_plugin(spec).worker_args(role) if spec.router is not None else ())],
        "ports": ports,
        "env": _env(rs, role),
        "resources": _resources(spec, rs),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "auth", "mountPath": SECRET_MOUNT, "readOnly": True},
            {"name": "worker-auth", "mountPath": WORKER_SECRET_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # The server listens once the model is in place: a Hub commit's first fill on a node and the load can
        # take minutes, so liveness waits for the startup probe (the engines' budget) instead of killing the
        # pod after a minute and starting the fill over.
        "startupProbe": {"httpGet": {"path": "/healthz", "port": HTTP_PORT}, "periodSeconds": STARTUP_PERIOD_S,
                         "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": HTTP_PORT}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": HTTP_PORT}, "periodSeconds": 10,
                          "failureThreshold": 6},
        # The pod's drain: stop admitting, finish in-flight transfers, then return. An exec hook (run in
        # the container) reaches the admin port on loopback; an httpGet hook would need it on the pod IP,
        # where anyone the NetworkPolicy lets in could drain the pod (docs/security.md).
        "lifecycle": {"preStop": {"exec": {"command": PRESTOP_DRAIN}}},
        "securityContext": _security(spec),
    }
    pod_spec: dict = {
        # Non-root with a fixed uid (the runtime image's user); /dev/nvidia* come from the device plugin.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "hostname": pod,
        "subdomain": service_name(name, role),
        "serviceAccountName": service_account_name(name),
        "automountServiceAccountToken": True,  # to patch its readiness-gate condition
        "enableServiceLinks": False,
        "restartPolicy": "Always",
        "readinessGates": [{"conditionType": READINESS_GATE}],
        "terminationGracePeriodSeconds": spec.rollout.drain_timeout_seconds + EXIT_GRACE_SECONDS,
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_name(name, role, revision)}},
            {"name": "auth", "secret": {"secretName": secret_name(name), "defaultMode": 0o400}},
            {"name": "worker-auth", "secret": {"secretName": worker_secret_name(name), "defaultMode": 0o400}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}},
            {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
        ],
    }
    src = spec.model.source
    builtin = plugin.container is None  # the runtime container is the engine
    if builtin and src is not None and src.path is not None and src.volume is not None:  # the reference engine's model
        volumes: list[dict] = pod_spec["volumes"]
        volumes.append({"name": MODEL_VOLUME, **src.volume})
        container["volumeMounts"].append({"name": MODEL_VOLUME, "mountPath": src.path, "readOnly": True})
    if builtin and src is not None and src.hugging_face is not None:
        _with_weights_cache(pod_spec, container, src.hugging_face)
    if spec.transfer.protocol is LinkProtocol.NVLINK:
        pod_spec["hostIPC"] = True  # CUDA IPC between pods on one node needs a shared IPC namespace
    if rs.node_selector:
        pod_spec["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        pod_spec["tolerations"] = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in rs.tolerations]
    if rs.affinity:
        pod_spec["affinity"] = copy.deepcopy(rs.affinity)
    labels = {**pod_labels(name, role, revision, index, member), LABEL_COMPAT: compat_key(spec, role)}
    leader = group_pod_name(name, role, revision, index, 0)
    if nodes > 1:
        labels[LABEL_GROUP] = leader
        _with_group(pod_spec, container, plugin, name, role, leader, member)
        with_topology(pod_spec, leader, spec.scheduling.topology_key)
    gang_labels, gang_annotations = gang_metadata(spec, leader, nodes)
    obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod,
            "namespace": namespace,
            "labels": {**labels, **gang_labels},
            # Identity survives a user editing the labels away; observe restores them from it.
            "annotations": {ANNOTATION_IDENTITY: identity(role, revision, index, member, nodes), **gang_annotations,
                            # what the router's discovery reads on a built-in runtime pod (an engine's: its own)
                            **(router_plugin(spec).worker_annotations(role)
                               if spec.router is not None and plugin.container is None else {})},
        },
        "spec": pod_spec,
    }
    if plugin.container is not None:
        return with_engine(obj, name, spec, role, {k: _extended(spec, rs) for k in ("limits", "requests")}, plugin)
    return obj
