"""Every command the operator renders for pdfleet's own containers parses with ``pdfleet-runtime``'s own parser,
for every example, role and router (a flag one sub-command does not take stops the container at start: the
vLLM prefill's agent once got ``serve``'s ``--pin-engine-id`` from vllm-router's worker args, and never ran)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.pods import runtime_pod
from pdfleet_operator.validation import validate_object
from pdfleet_runtime.cli import build_parser

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "valid").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_each_rendered_runtime_command_parses(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    verdict = validate_object(obj)
    assert verdict.violations == (), verdict.violations
    spec = PDDeploymentSpec.model_validate(verdict.spec)
    parser = build_parser()
    for role in Role:
        pod = runtime_pod(obj["metadata"]["name"], "ns", spec, role, "rev", 0, 0)
        for c in pod["spec"]["containers"]:
            cmd = c["command"]
            if cmd[0] != "pdfleet-runtime":
                continue
            try:
                args = parser.parse_args(cmd[1:])
            except SystemExit:
                pytest.fail(f"{path.name} {role.value} container {c['name']}: {cmd} does not parse")
            assert args.command in ("serve", "agent"), cmd
            if args.command == "agent":
                assert args.engine_kind == (spec.engine.kind.value if spec.engine else None), cmd
