"""SGLang PDDeployment manifests for the engine-rule, render and agreement tests."""

from __future__ import annotations

import copy
from typing import Any

SGLANG_BASE: dict[str, Any] = {
    "apiVersion": "pdfleet.io/v1alpha1",
    "kind": "PDDeployment",
    "metadata": {"name": "qwen", "namespace": "default"},
    "spec": {
        "engine": {"kind": "sglang", "version": "0.5.23", "image": "lmsysorg/sglang:v0.5.23"},
        "model": {
            "layout": {"preset": "qwen3.8-flash-next"},
            "servedName": "qwen3.8-flash-next",
            "source": {"path": "/models/qwen3.8-flash-next",
                       "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        },
        "transfer": {"backend": "mooncake"},
        "prefill": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
        "decode": {"replicas": 1, "parallelism": {"tensor": 2}, "image": "ghcr.io/pdfleet/runtime:0.1.0"},
    },
}


def sglang_obj(**edits: Any) -> dict[str, Any]:
    """SGLANG_BASE with dotted-path edits (``spec__transfer__backend="mori"``); None deletes."""
    obj = copy.deepcopy(SGLANG_BASE)
    for dotted, value in edits.items():
        *parents, leaf = dotted.split("__")
        node = obj
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return obj


VLLM_BASE: dict[str, Any] = copy.deepcopy(SGLANG_BASE)
VLLM_BASE["metadata"]["name"] = "qwen-vllm"
VLLM_BASE["spec"]["engine"] = {"kind": "vllm", "version": "0.33.0", "image": "vllm/vllm-openai:v0.33.0"}
VLLM_BASE["spec"]["model"]["layout"] = {"preset": "qwen3-next-hybrid"}
VLLM_BASE["spec"]["model"]["servedName"] = "qwen3-next"
VLLM_BASE["spec"]["model"]["source"]["path"] = "/models/qwen3-next"
VLLM_BASE["spec"]["transfer"] = {"backend": "nixl"}


def vllm_obj(**edits: Any) -> dict[str, Any]:
    """VLLM_BASE (Qwen3-Next on NIXL, TP 2 both roles) with dotted-path edits, as ``sglang_obj``."""
    obj = copy.deepcopy(VLLM_BASE)
    for dotted, value in edits.items():
        *parents, leaf = dotted.split("__")
        node = obj
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return obj
