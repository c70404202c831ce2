"""The demo's model deployment (``pdfleet demo --model DIR``): a real model behind the router, checked against
aggregate generation.

The chat deployment's runtime pods compute the model in ``DIR`` (the reference engine: transformers on the CPU),
which reaches them as a ``hostPath`` volume the harness's kubelet binds read-only (docs/local-cluster.md). Its
layout is derived from the model's own config and its content pinned by ``spec.model.source.digest``, as a user
would write them (``pdfleet layout``, ``pdfleet digest``). The answer that came through the router is compared,
token for token, with what ``pdfleet-runtime generate --aggregate`` computes without PD in a process of its own
(the demo's process never imports torch).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pdfleet_runtime.model.aggregate_answer import AggregateAnswer
from pdfleet_runtime.model.config_values import ModelConfigError
from pdfleet_runtime.model.digest import directory_digest
from pdfleet_runtime.model.hf_config import layout_for_model, read_config

__all__ = ["MAX_TOKENS", "MODEL_PATH", "QUESTION", "AggregateCheck", "DemoModelError", "aggregate_check", "model_spec"]

MODEL_PATH = "/models/demo"
"""Where the model directory is mounted in the runtime containers."""
QUESTION = "Recite the Zen of Python from line 3."
"""What the demo asks the project's Zen model (scripts/zen_model.py), which learnt to answer it."""
MAX_TOKENS = 64
AGGREGATE_TIMEOUT_S = 300.0
"""A torch import and one small model's generation on a loaded host."""


class DemoModelError(Exception):
    """The model directory cannot be served, or aggregate generation failed: the message says why."""


def model_spec(model_dir: Path) -> dict[str, Any]:
    """``spec.model`` for ``model_dir``: the layout its config gives, the directory as a read-only hostPath
    volume, and its content digest."""
    try:
        layout = layout_for_model(read_config(model_dir))
        digest = directory_digest(model_dir)
    except (ModelConfigError, OSError) as exc:
        raise DemoModelError(f"--model {model_dir}: {exc}") from exc
    return {"layout": {"inline": layout.model_dump(mode="json", by_alias=True, exclude_defaults=True)},
            "source": {"path": MODEL_PATH, "digest": digest,
                       "volume": {"hostPath": {"path": str(model_dir.resolve()), "type": "Directory"}}}}


class AggregateCheck:
    """What aggregate generation answered, and whether the PD answer's token ids equal it."""

    def __init__(self, command: list[str], answer: AggregateAnswer, pd: dict[str, Any]) -> None:
        self.command, self.answer = command, answer
        self.equal = (list(pd.get("promptIds") or ()) == answer.prompt_ids
                      and list(pd.get("outputIds") or ()) == answer.output_ids)

    def against(self, pd: dict[str, Any]) -> AggregateCheck:
        """The same aggregate answer compared with another PD answer to the same question (the demo's second
        router): aggregate generation is deterministic, so running it again would only cost a torch start."""
        return AggregateCheck(self.command, self.answer, pd)


def aggregate_check(model_dir: Path, pd: dict[str, Any]) -> AggregateCheck:
    """``pdfleet-runtime generate --aggregate`` on the demo's question, compared with the PD answer's ``pdfleet``
    extension (``promptIds``, ``outputIds``)."""
    cmd = ["pdfleet-runtime", "generate", "--aggregate", "--model", str(model_dir), "--chat", QUESTION,
           "--max-tokens", str(MAX_TOKENS), "--json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    try:
        out = subprocess.run([sys.executable, "-m", "pdfleet_runtime", *cmd[1:]], capture_output=True, text=True,
                             env=env, timeout=AGGREGATE_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise DemoModelError(f"`{shlex.join(cmd)}` did not end within {AGGREGATE_TIMEOUT_S:.0f}s") from exc
    if out.returncode != 0:
        raise DemoModelError(f"`{shlex.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    try:
        answer = AggregateAnswer.model_validate(json.loads(out.stdout))
    except (ValueError, ValidationError) as exc:
        raise DemoModelError(f"`{shlex.join(cmd)}` printed no answer: {exc}") from exc
    return AggregateCheck(cmd, answer, pd)
