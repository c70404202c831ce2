"""Stand-ins on kwok nodes, named as such wherever they are used: for the runtime, and for SGLang.

``SGLangStandIn`` is a mode of the harness's kubelet (``Kubelet(rewrite=...)``): SGLang needs GPUs, so
the ``engine`` container of an SGLang pod runs ``pdfleet-runtime serve`` instead, built from the
rendered ``python3 -m sglang.launch_server`` command (its flags mapped to the runtime config), with the
model directory's ``config.json`` generated from the layout; its ``/server_info`` reports the engine
version of the image tag and says it is a stand-in. The agent beside it runs unchanged.

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
from pdfleet_runtime.layouts import resolve_layout

__all__ = ["DRAINED_CONDITION", "LAUNCH_SERVER", "RuntimeStandIn", "SGLangStandIn"]

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


class SGLangStandIn:
    """The kubelet's rewrite of an SGLang pod's containers: the engine becomes a ``serve`` process.

    ``agent_args`` / ``serve_args``: local-run flags added to the agent's and the stand-in's commands."""

    def __init__(self, agent_args: tuple[str, ...] = (), serve_args: tuple[str, ...] = ()) -> None:
        self.agent_args, self.serve_args = agent_args, serve_args

    def __call__(self, sandbox: Any, container: dict) -> dict:  # sandbox: podsandbox.PodSandbox
        cmd = list(container.get("command") or ())
        if cmd[:2] == ["pdfleet-runtime", "agent"]:
            return {**container, "command": [*cmd, *self.agent_args]}
        if cmd[:3] != LAUNCH_SERVER:
            return container
        m = re.search(r":v?(\d+\.\d+\.\d+)", container.get("image") or "")
        version = m.group(1) if m else "unknown"
        fs = flag_set("sglang", "0.5.23")
        assert fs is not None
        flags = parse_args(cmd[3:], fs).values
        cfg = self._config(sandbox, flags)
        (sandbox.workdir / "stand-in").mkdir(parents=True, exist_ok=True)
        path = sandbox.workdir / "stand-in" / "runtime.yaml"
        path.write_text(cfg.to_yaml())
        self._model_dir(sandbox, container, str(flags["model_path"]), cfg)
        argv = ["pdfleet-runtime", "serve", "--config", str(path), "--device", "cpu", "--no-gate",
                "--stand-in-for", f"sglang=={version}", *self.serve_args]
        return {**container, "command": argv, "args": []}

    @staticmethod
    def _config(sandbox: Any, flags: Any) -> RuntimeConfig:
        """The agent's runtime config (the pod's ``config`` volume) with the launch flags mapped onto it."""
        (vol,) = [v for v in sandbox.pod["spec"]["volumes"] if v["name"] == "config"]
        data = sandbox.lookup("configMap", vol["configMap"]["name"])
        base = RuntimeConfig.model_validate(yaml.safe_load(data["runtime.yaml"]))
        update: dict[str, Any] = {
            "role": flags["disaggregation_mode"], "backend": flags.get("disaggregation_transfer_backend", "mooncake"),
            "shape": {"tensor": int(flags.get("tp_size", 1)), "pipeline": int(flags.get("pp_size", 1))},
            "http_port": int(flags["port"]), "bootstrap_port": int(flags["disaggregation_bootstrap_port"]),
            "admin_port": STANDIN_ADMIN_PORT, "served_model_name": flags.get("served_model_name"),
            # the pod's protocol secret, where the kubelet wrote the volume (the host's filesystem is the image)
            "secret_path": sandbox.workdir / "volumes" / "auth" / "key",
            # SGLang's HTTP API takes no worker key, and the engine container has none mounted: neither does its
            # stand-in (the runtime's own pods require the deployment's key on the worker routes).
            "worker_key_path": None,
        }
        if "max_total_tokens" in flags:
            update["kv_tokens"] = int(flags["max_total_tokens"])
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
