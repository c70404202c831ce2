"""The vllm-router command pdfleet renders for a vLLM fleet, read by vllm-router 0.1.17's own parser.

``parse_router_args`` (vllm_router/launch_router.py) is what ``vllm-router`` runs before it starts: the
rendered command must parse, in PD mode, with the connector of spec.transfer.backend, Kubernetes discovery
of the deployment's two roles and the engine's port. Running the router end to end is part 2 of issue 41.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.resources.router import router_command
from pdfleet_operator.validation import validate_object
from tests.unit.engine_rules.builders import vllm_obj
from tests.vllm.harness import vllm_python

READ = """
import dataclasses, json, sys
from vllm_router.launch_router import parse_router_args
a = parse_router_args(json.loads(sys.argv[1]))
print(json.dumps({k: v for k, v in dataclasses.asdict(a).items()
                  if isinstance(v, (str, int, float, bool, list, dict, type(None)))}, default=str))
"""


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_vllm_router_parses_the_rendered_command(backend: str) -> None:
    obj = vllm_obj(spec__transfer={"backend": backend}, spec__router={"image": "vllm-router:0.1.17"})
    verdict = validate_object(obj)
    # Mooncake with the rendered discovery is denied (0.1.17 never asks a discovered prefill's bootstrap for its
    # engine id); the rendering it would get still parses.
    want = ["vllm-router-mooncake-discovery"] if backend == "mooncake" else []
    assert [v.rule for v in verdict.violations] == want, verdict.violations
    argv = router_command("qwen-vllm", "ns", PDDeploymentSpec.model_validate(verdict.spec or obj["spec"]))
    assert argv[0] == "vllm-router"
    proc = subprocess.run([vllm_python(), "-c", READ, json.dumps(argv[1:])], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = json.loads(proc.stdout.strip().splitlines()[-1])
    assert args["vllm_pd_disaggregation"] is True
    assert args["kv_connector"] == backend
    assert args["service_discovery"] is True and args["service_discovery_namespace"] == "ns"
    assert args["service_discovery_port"] == 30000
    assert args["host"] == "127.0.0.1" and args["port"] == 30001  # the pod's loopback: the front has 30000
    assert args["prefill_selector"] == {"pdfleet.io/deployment": "qwen-vllm", "pdfleet.io/role": "prefill"}
    assert args["decode_selector"] == {"pdfleet.io/deployment": "qwen-vllm", "pdfleet.io/role": "decode"}


def test_sglang_router_on_a_vllm_fleet_is_denied() -> None:
    verdict = validate_object(vllm_obj(spec__router={"image": "x", "kind": "sglang"}))
    (v,) = [v for v in verdict.violations if v.rule == "router-kind-engine"]
    assert v.paths == ("spec.router.kind",) and "vLLM ignores" not in v.message and "vllm" in v.message
