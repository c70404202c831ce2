"""The demo's vLLM steps (issue 44): what of a vLLM fleet can be shown on a host without a GPU.

- **Rendered and checked.** A ``spec.engine.kind: vllm`` PDDeployment (Qwen3.8 Flash Next on vLLM 0.33.0 over
  NIXL, as ``examples/valid/vllm-qwen3.8-flash-next-nixl.yaml``) goes through ``render.render_object``, the one
  code path ``pdfleet render`` prints (the webhook's verdict, then the operator's first reconcile pass), and the
  ``vllm serve`` command line of each role's ``engine`` container is printed; then the operator's webhook admits it
  with a server-side dry run, so nothing is created. vLLM itself needs a GPU and cannot run here: nothing starts it,
  and the demo says so on screen.
- **Served through vllm-router.** The chat deployment's twin with ``spec.router.kind: vllm`` on NIXL: vllm-router
  0.1.17 really runs (its rendered command, verbatim) in front of built-in runtime pods (``pdfleet-runtime
  serve``) standing in for vLLM, which speak vLLM's PD contract (``pdfleet_runtime.pod.vllm_contract``: NIXL's two
  steps, ``kv_transfer_params``). Mooncake is not used: admission denies vllm-router's discovery with Mooncake
  (``vllm-router-mooncake-discovery``), which is why ``tests/e2e/test_vllm_router_runtimes.py`` runs NIXL too.

This module never touches the cluster itself: the demo hands it ``kubectl`` (``Kubectl``), so the operator's
import contract (only ``demo`` and ``dev`` import the local-cluster tooling) stays as it is.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from pdfleet_operator.commands.validate import format_verdict
from pdfleet_operator.render import render_object

__all__ = ["STAND_IN", "VLLM_CHAT", "VLLM_NAME", "VLLM_VERSION", "EngineCommand", "Kubectl", "VllmSpecError", "engine_commands",
           "show_vllm_spec", "vllm_chat_manifest", "vllm_manifest"]

VLLM_NAME = "qwen-flash-vllm"
VLLM_VERSION = "0.33.0"
VLLM_CHAT = "chat-vllm"
ENGINE_CONTAINER = "engine"
"""The container of a vLLM pod that runs ``vllm serve`` (the pdfleet agent runs beside it, in ``runtime``)."""
STAND_IN = ("vLLM cannot run here (no GPU): the built-in runtime (pdfleet-runtime serve) stands in for it in the prefill "
            "and decode pods, speaking vLLM's PD contract (kv_transfer_params, NIXL's two steps); vllm-router itself "
            "really runs, its rendered command verbatim")
NO_GPU = ("vLLM itself cannot run here (it needs a GPU; this host has none): this deployment is rendered and "
          "checked only, nothing starts its pods")


class VllmSpecError(Exception):
    """The vLLM manifest was not admitted, or rendered no engine command: the message says why."""


class Kubectl(Protocol):
    """``LocalCluster.kubectl``: what this module needs of the cluster."""

    def __call__(self, *args: str, input: str | None = None, check: bool = True,
                 timeout: float = ...) -> subprocess.CompletedProcess[str]: ...


class EngineCommand(BaseModel):
    """One role's rendered ``engine`` container: the command line vLLM would be started with, and the names of the
    variables set for it (their values come from the downward API or the transfer, not worth a screen)."""

    model_config = ConfigDict(frozen=True)

    role: str = Field(min_length=1)
    pod: str = Field(min_length=1)
    argv: list[str] = Field(min_length=2)
    env: list[str] = Field(default_factory=list)

    @property
    def transfer_env(self) -> list[str]:
        """The variables vLLM's connector reads (NIXL's side channel, UCX's devices), not the pod's own."""
        return [n for n in self.env if n.startswith(("VLLM_", "UCX_"))]

    @property
    def line(self) -> str:
        return shlex.join(self.argv)


def vllm_manifest(namespace: str) -> dict[str, Any]:
    """Qwen3.8 Flash Next on vLLM 0.33.0, prefill TP 4 x1 and decode TP 4 x2 over NIXL (RDMA), vllm-router in
    front: ``examples/valid/vllm-qwen3.8-flash-next-nixl.yaml`` in the demo's namespace (the examples are not part
    of the installed package, so the demo carries its own copy)."""
    return {
        "apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment",
        "metadata": {"name": VLLM_NAME, "namespace": namespace},
        "spec": {
            "engine": {"kind": "vllm", "version": VLLM_VERSION, "image": f"vllm/vllm-openai:v{VLLM_VERSION}",
                       "args": ["--gpu-memory-utilization", "0.9", "--max-model-len", "32768"]},
            "model": {"layout": {"preset": "qwen3.8-flash-next"}, "servedName": "qwen3.8-flash-next",
                      "source": {"path": "/models/qwen3.8-flash-next",
                                 "volume": {"persistentVolumeClaim": {"claimName": "models"}}}},
            "transfer": {"backend": "nixl", "protocol": "rdma", "rdmaDevices": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]},
            "prefill": {"replicas": 1, "parallelism": {"tensor": 4}, "image": "ghcr.io/pdfleet/runtime:0.1.0",
                        "engine": {"args": ["--max-num-batched-tokens", "16384"]}},
            "decode": {"replicas": 2, "parallelism": {"tensor": 4}, "image": "ghcr.io/pdfleet/runtime:0.1.0",
                       "engine": {"args": ["--max-num-seqs", "256"]}},
            "router": {"image": "ghcr.io/pdfleet/runtime:0.1.0"},
        },
    }


def vllm_chat_manifest(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat deployment ``chat`` (same model, pods, pools and rollout) behind vllm-router on NIXL: the engine
    stays the built-in runtime, standing in for vLLM; only the router and the transfer change."""
    spec = json.loads(json.dumps(chat["spec"]))  # a deep copy: the caller's manifest stays as it is
    spec["transfer"] = {**spec["transfer"], "backend": "nixl"}
    spec["router"] = {**spec["router"], "kind": "vllm"}
    return {**chat, "metadata": {**chat["metadata"], "name": VLLM_CHAT}, "spec": spec}


def engine_commands(objects: Sequence[dict[str, Any]]) -> list[EngineCommand]:
    """The ``engine`` container of each role's first pod, prefill first (every pod of a role runs the same
    command but for its group rank, which these single-node replicas do not have)."""
    found: dict[str, EngineCommand] = {}
    for obj in objects:
        if obj.get("kind") != "Pod":
            continue
        role = obj["metadata"].get("labels", {}).get("pdfleet.io/role")
        for c in obj["spec"]["containers"]:
            if role and role not in found and c["name"] == ENGINE_CONTAINER:
                found[role] = EngineCommand(role=role, pod=obj["metadata"]["name"],
                                            argv=[*c.get("command", ()), *c.get("args", ())],
                                            env=[e["name"] for e in c.get("env", ())])
    return sorted(found.values(), key=lambda e: e.role != "prefill")


def show_vllm_spec(kubectl: Kubectl, namespace: str) -> None:
    """Render the vLLM manifest with pdfleet's own code path and print each role's ``vllm serve``; then have the
    operator's webhook admit it (``kubectl apply --dry-run=server``: the apiserver's schema, the CRD's rules and
    the webhook, nothing stored). Raises ``VllmSpecError`` when either refuses it."""
    manifest = vllm_manifest(namespace)
    print(NO_GPU)
    rendered = render_object(manifest, f"{VLLM_NAME}.yaml")
    print(f"$ pdfleet render -f {VLLM_NAME}.yaml   # the verdict, then each role's engine container")
    print(format_verdict(rendered.verdict, warnings=False))  # the webhook's warnings are printed below
    if not rendered.verdict.admitted:
        raise VllmSpecError("pdfleet render refused the demo's vLLM manifest (above)")
    commands = engine_commands(rendered.objects)
    if {c.role for c in commands} != {"prefill", "decode"}:
        raise VllmSpecError(f"the vLLM manifest rendered no engine command for each role: {commands}")
    for c in commands:
        print(f"{c.role} {c.pod}: {c.line}")
        print(f"  transfer env: {', '.join(c.transfer_env)}")
    print("$ kubectl apply --dry-run=server -f -   # the apiserver's schema and rules, then the operator's webhook; "
          "nothing is stored")
    out = kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)
    if out.returncode != 0:
        raise VllmSpecError(f"the webhook refused the demo's vLLM manifest: {out.stderr.strip()}")
    print("\n".join(line for line in (out.stderr.strip(), out.stdout.strip()) if line))
    print(f"vLLM spec admitted by the webhook: {namespace}/{VLLM_NAME}, engine vllm=={VLLM_VERSION}, NIXL, "
          "prefill tp4 x1, decode tp4 x2 (rendered and checked only: no GPU to run vLLM)")
