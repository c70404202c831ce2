"""Stand-ins on kwok nodes, named as such wherever they are used: for the runtime, and for SGLang and vLLM.

``SGLangStandIn`` and ``VllmStandIn`` are modes of the harness's kubelet (``Kubelet(rewrite=...)``): the
engines need GPUs, so the ``engine`` container of an SGLang or vLLM pod runs ``pdfleet-runtime serve``
instead, built from the rendered ``python3 -m sglang.launch_server`` or ``vllm serve`` command (its flags
mapped to the runtime config), with the model directory's ``config.json`` generated from the layout; it
answers the engine's worker contract and reports the engine version of the image tag (``/server_info``,
vLLM's ``/version``) and says it is a stand-in. The agent beside it runs unchanged.

``RuntimeStandIn``:

Nothing runs in a kwok pod, so tests, benchmarks and the demo that do not start real runtimes use
this thread to do the two things a runtime does to its pod through the API: set the
``pdfleet.io/transfer-path`` readiness-gate condition once the pod runs (a real runtime does so
only after a verified canary transfer), and report ``pdfleet.io/drained`` a moment after the
operator starts draining it (a real runtime does so once no transfer is in flight).
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import yaml

from pdfleet_runtime.agent.model_config import config_for_layout
from pdfleet_runtime.config import DRAIN_ANNOTATION, READINESS_GATE, RuntimeConfig, drain_of, drained_message
from pdfleet_runtime.config import DRAINED_CONDITION as DRAINED_CONDITION
from pdfleet_runtime.engine_rules.argv import flag_set, parse_args
from pdfleet_runtime.engine_rules.vllm_argv import read_vllm_args
from pdfleet_runtime.layouts import resolve_layout

__all__ = ["DRAINED_CONDITION", "LAUNCH_SERVER", "RuntimeStandIn", "SGLangStandIn", "VllmStandIn"]

LAUNCH_SERVER = ["python3", "-m", "sglang.launch_server"]
STANDIN_ADMIN_PORT = 8082  # the agent beside it holds the pod's admin port (8081)



class RuntimeStandIn(threading.Thread):
    """Polls pods (one namespace, or all with the managed-by label) and sets the two conditions."""

    def __init__(self, api_client: Any, namespace: str | None = None, drain_delay: float = 0.3,
                 interval: float = 0.1, reason: str = "RuntimeStandIn", failing_images: frozenset[str] = frozenset(),
                 watch: bool = False) -> None:
        super().__init__(daemon=True)
        from kubernetes.client import CoreV1Api

        self.core = CoreV1Api(api_client)
        self.namespace, self.drain_delay, self.interval, self.reason = namespace, drain_delay, interval, reason
        # Pods of these images fail their canary: the gate goes False with a reason, as a runtime
        # that cannot complete a verified transfer reports it.
        self.failing_images = failing_images
        self.stop_event = threading.Event()
        self.gated = 0
        self.drained = 0
        self.errors: list[str] = []  # e.g. a pod deleted between list and patch; retried next round
        # watch: follow a watch instead of listing every ``interval`` (benchmarks of a thousand pods,
        # where polling lists would cost more CPU than the operator under test)
        self.watch = watch
        self._waiting: dict[tuple[str, str], Any] = {}  # drains whose delay has not passed yet

    def _list(self) -> list[Any]:
        selector = "app.kubernetes.io/managed-by=pdfleet-operator"
        if self.namespace:
            return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        return self.core.list_pod_for_all_namespaces(label_selector=selector).items

    def _set(self, pod: Any, kind: str, status: str = "True", message: str = "set by a stand-in for the runtime",
             reason: str | None = None) -> None:
        body = {"status": {"conditions": [{"type": kind, "status": status, "reason": reason or self.reason,
                                           "message": message}]}}
        self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, body)

    def step(self) -> None:
        for pod in self._list():
            self.step_pod(pod)

    def step_pod(self, pod: Any) -> None:
        if pod.metadata.deletion_timestamp or pod.status.phase != "Running":
            return
        conds = {c.type: c.status for c in pod.status.conditions or ()}
        if pod.spec.containers[0].image in self.failing_images:
            if conds.get(READINESS_GATE) != "False":
                self._set(pod, READINESS_GATE, "False", "canary transfer failed (stand-in: failing image)",
                          reason="TransfersFailing")
        elif conds.get(READINESS_GATE) != "True":
            self._set(pod, READINESS_GATE)
            self.gated += 1
        started = (pod.metadata.annotations or {}).get(DRAIN_ANNOTATION)
        reported = {c.type: c.message for c in pod.status.conditions or ()}.get(DRAINED_CONDITION)
        key = (pod.metadata.namespace, pod.metadata.name)
        self._waiting.pop(key, None)
        if started and drain_of(reported) != started:
            if time.time() - float(started) >= self.drain_delay:
                self._set(pod, DRAINED_CONDITION, message=drained_message(started, "set by a stand-in for the runtime"))
                self.drained += 1
            else:
                self._waiting[key] = pod

    def _follow(self) -> None:
        from kubernetes import watch

        selector, w = "app.kubernetes.io/managed-by=pdfleet-operator", watch.Watch()
        list_fn = (self.core.list_pod_for_all_namespaces if not self.namespace
                   else lambda **kw: self.core.list_namespaced_pod(self.namespace, **kw))
        version = None
        while not self.stop_event.is_set():
            try:
                for event in w.stream(list_fn, label_selector=selector, timeout_seconds=1,
                                      **({"resource_version": version} if version else {})):
                    if event["type"] != "DELETED":
                        self.step_pod(event["object"])
                    version = event["object"].metadata.resource_version
                for ns, name in list(self._waiting):
                    self.step_pod(self.core.read_namespaced_pod(name, ns))
            except Exception as exc:  # 410 Gone and the like: start over from a fresh listing
                self.errors.append(repr(exc))
                version = None

    def run(self) -> None:
        if self.watch:
            self._follow()
            return
        while not self.stop_event.is_set():
            try:
                self.step()
            except Exception as exc:
                self.errors.append(repr(exc))
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)


class _EngineStandIn:
    """The kubelet's rewrite of an engine pod's containers: the engine becomes a ``serve`` process standing in
    for it (``engine``: its kind as ``--stand-in-for`` names it), the agent runs unchanged.

    ``agent_args`` / ``serve_args``: local-run flags added to the agent's and the stand-in's commands."""

    engine = ""

    def __init__(self, agent_args: tuple[str, ...] = (), serve_args: tuple[str, ...] = ()) -> None:
        self.agent_args, self.serve_args = agent_args, serve_args

    def _update(self, cmd: list[str], container: dict) -> tuple[dict[str, Any], str] | None:
        """The runtime config's fields the engine's command sets, and its model path; None: not this engine."""
        raise NotImplementedError

    def __call__(self, sandbox: Any, container: dict) -> dict:  # sandbox: podsandbox.PodSandbox
        cmd = list(container.get("command") or ())
        if cmd[:2] == ["pdfleet-runtime", "agent"]:
            return {**container, "command": [*cmd, *self.agent_args]}
        found = self._update(cmd, container)
        if found is None:
            return container
        update, model_path = found
        m = re.search(r":v?(\d+\.\d+\.\d+)", container.get("image") or "")
        version = m.group(1) if m else "unknown"
        cfg = self._config(sandbox, update)
        (sandbox.workdir / "stand-in").mkdir(parents=True, exist_ok=True)
        path = sandbox.workdir / "stand-in" / "runtime.yaml"
        path.write_text(cfg.to_yaml())
        self._model_dir(sandbox, container, model_path, cfg)
        argv = ["pdfleet-runtime", "serve", "--config", str(path), "--device", "cpu", "--no-gate",
                "--stand-in-for", f"{self.engine}=={version}", *self.serve_args]
        return {**container, "command": argv, "args": []}

    @staticmethod
    def _config(sandbox: Any, update: dict[str, Any]) -> RuntimeConfig:
        """The agent's runtime config (the pod's ``config`` volume) with the engine's flags mapped onto it."""
        (vol,) = [v for v in sandbox.pod["spec"]["volumes"] if v["name"] == "config"]
        data = sandbox.lookup("configMap", vol["configMap"]["name"])
        base = RuntimeConfig.model_validate(yaml.safe_load(data["runtime.yaml"]))
        update = {**update, "admin_port": STANDIN_ADMIN_PORT,
                  # the pod's protocol secret, where the kubelet wrote the volume (the host's filesystem is the image)
                  "secret_path": sandbox.workdir / "volumes" / "auth" / "key",
                  # the engine's HTTP API takes no worker key here, and the engine container has none mounted:
                  # neither does its stand-in (the runtime's own pods require the deployment's key).
                  "worker_key_path": None}
        return RuntimeConfig.model_validate({**base.model_dump(), **update})

    @staticmethod
    def _model_dir(sandbox: Any, container: dict, model_path: str, cfg: RuntimeConfig) -> None:
        """config.json of the layout in the model volume (when the model path is one), as a real model has."""
        from pdfleet_runtime.engine_rules.sglang import MODEL_FAMILIES

        mounts = [m for m in container.get("volumeMounts") or () if m["mountPath"] == model_path]
        if not mounts:
            return
        fam = MODEL_FAMILIES.get(cfg.layout.preset or "")
        arch, kind, nested = (fam.architecture, fam.model_type, fam.nested_text_config) if fam else (
            "LlamaForCausalLM", "llama", False)
        d = sandbox.workdir / "volumes" / mounts[0]["name"]
        (d / "config.json").write_text(json.dumps(config_for_layout(resolve_layout(cfg.layout), arch, kind,
                                                                   nested_text_config=nested), indent=1))


class SGLangStandIn(_EngineStandIn):
    """SGLang's ``python3 -m sglang.launch_server``, its flags mapped onto the runtime config."""

    engine = "sglang"

    def _update(self, cmd: list[str], container: dict) -> tuple[dict[str, Any], str] | None:
        if cmd[:3] != LAUNCH_SERVER:
            return None
        fs = flag_set("sglang", "0.5.23")
        assert fs is not None
        flags = parse_args(cmd[3:], fs).values
        update: dict[str, Any] = {
            "role": flags["disaggregation_mode"], "backend": flags.get("disaggregation_transfer_backend", "mooncake"),
            "shape": {"tensor": int(flags.get("tp_size", 1)), "pipeline": int(flags.get("pp_size", 1))},
            "http_port": int(flags["port"]), "bootstrap_port": int(flags["disaggregation_bootstrap_port"]),
            "served_model_name": flags.get("served_model_name"),
        }
        if "max_total_tokens" in flags:
            update["kv_tokens"] = int(flags["max_total_tokens"])
        return update, str(flags["model_path"])


class VllmStandIn(_EngineStandIn):
    """vLLM's ``vllm serve MODEL``: the KV role and connector of ``--kv-transfer-config`` give the role and the
    backend; the bootstrap is where vLLM's decode reaches the prefill (NIXL's side channel, Mooncake's HTTP
    bootstrap), as the rendered environment sets it."""

    engine = "vllm"
    ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
    BACKENDS = {"NixlConnector": ("nixl", "VLLM_NIXL_SIDE_CHANNEL_PORT", 5600),
                "MooncakeConnector": ("mooncake", "VLLM_MOONCAKE_BOOTSTRAP_PORT", 8998)}

    def _update(self, cmd: list[str], container: dict) -> tuple[dict[str, Any], str] | None:
        if cmd[:2] != ["vllm", "serve"] or len(cmd) < 3:
            return None
        fs = flag_set("vllm", "0.33.0")
        assert fs is not None
        flags = read_vllm_args(cmd[3:], fs).parsed.values
        kv = json.loads(str(flags["kv_transfer_config"]))
        backend, port_env, port = self.BACKENDS[kv["kv_connector"]]
        env = {e["name"]: e.get("value") for e in container.get("env") or ()}
        names = flags.get("served_model_name")
        update: dict[str, Any] = {
            "role": self.ROLES[kv["kv_role"]], "backend": backend,
            "shape": {"tensor": int(str(flags.get("tensor_parallel_size", 1))),
                      "pipeline": int(str(flags.get("pipeline_parallel_size", 1)))},
            "http_port": int(str(flags["port"])), "bootstrap_port": int(env.get(port_env) or port),
            "served_model_name": names[0] if isinstance(names, tuple) and names else None,
        }
        return update, cmd[2]
