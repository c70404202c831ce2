"""Tiny ``config.json`` files of each layout preset's real model family, as vLLM reads them.

vLLM resolves the architecture (``architectures``) and its checks (MoE, MLA, hybrid) from the file, so it
names the real family (``engine_rules.vllm.MODEL_FAMILIES``); the sizes come from the pdfleet layout, as
for the SGLang check. No weights: the check adds ``--load-format dummy``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdfleet_runtime.agent.model_config import config_for_layout
from pdfleet_runtime.engine_rules.vllm import MODEL_FAMILIES
from pdfleet_runtime.layouts import resolve_layout


def config_for(preset: str) -> dict:
    fam = MODEL_FAMILIES[preset]
    return config_for_layout(resolve_layout(preset), fam.architecture, fam.model_type,
                             nested_text_config=fam.nested_text_config)


def write_model_dirs(root: Path) -> dict[str, Path]:
    out = {}
    for preset in MODEL_FAMILIES:
        d = root / preset
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config_for(preset), indent=1))
        out[preset] = d
    return out
