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
