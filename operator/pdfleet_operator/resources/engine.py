"""The engine pod: an engine in the ``engine`` container beside the pdfleet agent, rendered from the spec.

``runtime_pod`` builds the pod of the built-in runtime; for an engine kind with its own container
(``EnginePlugin.container``) it hands the pod to ``with_engine``, which moves GPUs, the RDMA
resource and its capability to a container named ``engine`` running the kind's command, and turns the
runtime container into the agent beside it. What differs by kind (command, transfer environment, the
prefill's bootstrap port and annotation, host IPC) comes from the plug-in (``resources.plugins``); the
pod around it, its probes on the kind's worker contract, and the agent are the same for every kind.
"""

from __future__ import annotations

import copy
from typing import Any

from pdfleet_operator.api.constants import LABEL_REVISION, Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.engine import role_engine
from pdfleet_operator.resources.names import (
    LABEL_INDEX,
    LABEL_MEMBER,
    WEIGHTS_VOLUME,
    group_pod_name,
    group_service_name,
)
from pdfleet_operator.resources.plugins.contract import EnginePlugin, GroupMember
from pdfleet_operator.resources.plugins.registry import engine_plugin
from pdfleet_operator.resources.router import ROUTER_DROP_BOUND_S
from pdfleet_operator.resources.runtime_config import CONFIG_FILE, CONFIG_MOUNT
from pdfleet_runtime.config import ADMIN_PORT
from pdfleet_runtime.links import LinkProtocol

__all__ = [
    "ENGINE_CONTAINER",
    "HF_TOKEN_KEY",
    "MODEL_VOLUME",
    "GroupMember",
    "agent_command",
    "engine_container",
    "group_member",
    "group_service",
    "launch_command",
    "with_engine",
]

ENGINE_CONTAINER = "engine"
HF_TOKEN_KEY = "token"  # the key of model.source.huggingFace.tokenSecret holding the Hub token
CACHE_MOUNT = "/cache"  # HOME of the engine (non-root): Hub downloads, Triton and kernel caches
MODEL_VOLUME = "model"
HUB_CACHE = f"{CACHE_MOUNT}/huggingface/hub"  # HF_HOME/hub, the Hub client's default cache: the node's, when named
# Weights load before /health answers: up to 30 minutes for a large model from a network volume.
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 180
SHM_GIB_PER_GPU, SHM_MIN_GIB = 4, 8
TOKEN_VOLUME, TOKEN_MOUNT = "kube-api-access", "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_EXPIRATION_S = 3607  # what the ServiceAccount admission plugin projects (the kubelet rotates it)
# The engine's preStop hook waits for the agent's drain (the same loopback call as the agent's own hook):
# a container without a hook gets SIGTERM at once, while the agent still drains (python3: every engine image has it).
ENGINE_PRESTOP = ["python3", "-c", "import urllib.request as u; u.urlopen(u.Request("
                  f"'http://127.0.0.1:{ADMIN_PORT}/drain?wait=true', data=b'', method='POST'), timeout=86400)"]  # NCCL and the tokenizer/detokenizer processes share /dev/shm


def group_member(deployment: str, namespace: str, role: Role, revision: str, index: int,
                 member: int) -> GroupMember:
    """Member ``member`` of replica ``index``: the first pod is reached through the group's headless
    Service, which publishes not-ready addresses (the engines rendezvous before any is Ready)."""
    leader = group_pod_name(deployment, role, revision, index, 0)
    service = group_service_name(deployment, role)
    return GroupMember(node_rank=member, leader_host=f"{leader}.{service}.{namespace}.svc")


def group_service(deployment: str, namespace: str, role: Role, selector: dict[str, str],
                  port: tuple[str, int]) -> dict:
    """The headless Service of a role's replica groups: no cluster IP, not-ready addresses published (the
    members rendezvous before any is Ready), the rendezvous port named (the engine kind's ``group_port``)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": group_service_name(deployment, role), "namespace": namespace},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": dict(selector),
                 "ports": [{"name": port[0], "port": port[1], "targetPort": port[1], "protocol": "TCP"}]},
    }


def launch_command(name: str, spec: PDDeploymentSpec, role: Role, member: GroupMember | None = None) -> list[str]:
    """The engine's command line (the kind's ``EngineContainer.command``): owned flags from the spec, then
    spec.engine.args and the role's. ``member``: this pod's place in its replica group (needed when
    nodesPerReplica > 1)."""
    container = engine_plugin(spec).container
    if container is None:
        raise ValueError("the built-in runtime has no engine container")
    return container.command(name, spec, role, member)


def _group_env(spec: PDDeploymentSpec, role: Role) -> list[dict]:
    """NCCL and Gloo across a replica group's pods: the pod network's interface, and over rdma the HCAs
    of rdmaDeviceMap (every GPU's devices) or rdmaDevices; none given leaves NCCL's own discovery."""
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    if rs.parallelism.nodes_per_replica == 1:
        return []
    env = [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}, {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"}]
    t = spec.transfer
    if t.protocol is LinkProtocol.RDMA:
        devices = sorted({d for ds in (t.rdma_device_map or {}).values() for d in ds} | set(t.rdma_devices or ()))
        if devices:
            env.append({"name": "NCCL_IB_HCA", "value": ",".join(devices)})
    return env


def _engine_env(spec: PDDeploymentSpec, role: Role, plugin: EnginePlugin) -> list[dict]:
    assert plugin.container is not None

    def field_ref(path: str) -> dict:  # apiVersion as the apiserver defaults it: render prints what is stored
        return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}

    env: list[dict] = [
        {"name": "POD_NAME", **field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": "POD_IP", **field_ref("status.podIP")},
        {"name": "HOME", "value": CACHE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
    ]
    hf = spec.model.source.hugging_face if spec.model.source else None
    if hf is not None and hf.endpoint:
        env.append({"name": "HF_ENDPOINT", "value": hf.endpoint})
    if hf is not None and hf.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": hf.token_secret, "key": HF_TOKEN_KEY}}})
    env += _group_env(spec, role)
    # the kind's transfer environment (its protocol table), then the user's env (shared, then the role's)
    env += plugin.container.transfer_env(spec, role)
    return env + [dict(e) for e in role_engine(spec, role).env]


def engine_container(name: str, spec: PDDeploymentSpec, role: Role, resources: dict, security: dict,
                     member: GroupMember | None = None, plugin: EnginePlugin | None = None) -> dict:
    """The ``engine`` container: the kind's command and environment, its worker port and the prefill's
    bootstrap port, probes on its worker contract's health path."""
    plugin = plugin if plugin is not None else engine_plugin(spec)
    container = plugin.container
    assert container is not None
    worker = plugin.worker

    def probe() -> dict:
        return {"httpGet": {"path": worker.health_path, "port": worker.port}}

    ports = [{"name": "engine-http", "containerPort": worker.port, "protocol": "TCP"}]
    if role is Role.PREFILL:
        ports.append({"name": "bootstrap", "containerPort": container.bootstrap_port(spec), "protocol": "TCP"})
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "engine-cache", "mountPath": CACHE_MOUNT}]
    src = spec.model.source
    if src is not None and src.path is not None and src.volume is not None:
        mounts.append({"name": MODEL_VOLUME, "mountPath": src.path, "readOnly": True})
    if src is not None and src.hugging_face is not None and src.hugging_face.cache is not None:
        mounts.append({"name": WEIGHTS_VOLUME, "mountPath": HUB_CACHE})  # the Hub client's own cache and locks
    return {
        "name": ENGINE_CONTAINER,
        "image": role_engine(spec, role).image,
        "imagePullPolicy": "IfNotPresent",
        "command": container.command(name, spec, role, member),
        "ports": ports,
        "env": _engine_env(spec, role, plugin),
        "resources": resources,
        "volumeMounts": mounts,
        "startupProbe": {**probe(), "periodSeconds": STARTUP_PERIOD_S, "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": {**probe(), "periodSeconds": 5},
        "livenessProbe": {**probe(), "periodSeconds": 10, "failureThreshold": 6},
        "lifecycle": {"preStop": {"exec": {"command": ENGINE_PRESTOP}}},
        "securityContext": security,
    }


def _token_volume() -> dict:
    """The ServiceAccount token, projected for the agent alone (the engine gets no API credential)."""
    return {"name": TOKEN_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRATION_S}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}


def agent_command(spec: PDDeploymentSpec, role: Role) -> list[str]:
    """``pdfleet-runtime agent``: the runtime config, the engine's kind and declared version, the model directory
    it shares with the engine (checked only where it can see it: a model volume), and the routers' drop bound.
    Nothing of the built-in runtime's ``serve`` command (a router's worker args are flags of ``serve``: the
    agent refused them, and a vLLM prefill's agent never started)."""
    engine = role_engine(spec, role)
    cmd = ["pdfleet-runtime", "agent", "--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}", "--engine-kind", engine.kind.value,
           "--engine-version", str(engine.version),
           "--router-drop-seconds", f"{ROUTER_DROP_BOUND_S:g}"]
    src = spec.model.source
    if src is not None and src.path is not None and src.volume is not None:
        cmd += ["--model-path", src.path]
    return cmd


def with_engine(pod: dict, name: str, spec: PDDeploymentSpec, role: Role, engine_resources: dict,
                plugin: EnginePlugin) -> dict:
    """The runtime pod turned into an engine pod (``plugin.container``): the engine owns the GPUs and RDMA;
    the runtime container becomes the agent (``pdfleet-runtime agent``, docs/agent.md) with the role's own
    image, env and resources, no capability, the pod's only API token and the model volume read-only.
    ``engine_resources``: the GPUs and the RDMA share, as limits and requests."""
    container = plugin.container
    assert container is not None
    rs = spec.prefill if role is Role.PREFILL else spec.decode
    pod_spec = pod["spec"]
    (agent,) = pod_spec["containers"]
    agent["resources"] = rs.resources.model_dump(mode="json", by_alias=True, exclude_none=True)
    engine_security = copy.deepcopy(agent["securityContext"])
    agent["securityContext"]["capabilities"] = {"drop": ["ALL"]}
    agent["command"] = agent_command(spec, role)
    agent["ports"] = [p for p in agent["ports"] if p["name"] == "http"]  # the engine binds bootstrap and data ports
    agent["volumeMounts"].append({"name": TOKEN_VOLUME, "mountPath": TOKEN_MOUNT, "readOnly": True})
    pod_spec["automountServiceAccountToken"] = False  # the agent's projected token only
    pod_spec["volumes"].append(_token_volume())
    gpus = rs.parallelism.gpus_per_pod
    for v in pod_spec["volumes"]:
        if v["name"] == "dshm":
            v["emptyDir"]["sizeLimit"] = f"{max(SHM_MIN_GIB, SHM_GIB_PER_GPU * gpus)}Gi"
    pod_spec["volumes"].append({"name": "engine-cache", "emptyDir": {}})
    src = spec.model.source
    if src is not None and src.path is not None and src.volume is not None:
        pod_spec["volumes"].append({"name": MODEL_VOLUME, **src.volume})
        agent["volumeMounts"].append({"name": MODEL_VOLUME, "mountPath": src.path, "readOnly": True})
    if src is not None and src.hugging_face is not None and src.hugging_face.cache is not None:
        pod_spec["volumes"].append({"name": WEIGHTS_VOLUME, **copy.deepcopy(src.hugging_face.cache)})
    if container.host_ipc(spec):
        pod_spec["hostIPC"] = True
    member = None
    meta = pod["metadata"]
    if rs.parallelism.nodes_per_replica > 1:  # this pod's node rank in its group and the group's first pod
        member = group_member(name, meta["namespace"], role, meta["labels"][LABEL_REVISION],
                              int(meta["labels"][LABEL_INDEX]), int(meta["labels"][LABEL_MEMBER]))
    pod_spec["containers"] = [engine_container(name, spec, role, engine_resources, engine_security, member, plugin),
                              agent]
    if role is Role.PREFILL and (member is None or member.node_rank == 0):  # the leader's bootstrap serves the group
        pod["metadata"]["annotations"][container.bootstrap_annotation] = str(container.bootstrap_port(spec))
    return pod
