"""The agent beside vLLM read against vLLM 0.33's own code (issue 44): its canary's bodies (NIXL's two steps,
Mooncake's one) parse as vLLM's ``CompletionRequest`` with their ``kv_transfer_params`` handed on unchanged, and
what vLLM's code answers on ``/version`` and ``/v1/models`` passes the agent's checks when it agrees with the
deployment and is named when it does not (``check_agent_bodies.py`` in the vLLM check venv)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pdfleet_runtime.agent.vllm_engine import canary_request, info_problems, mooncake_bodies, nixl_bodies
from tests.vllm.harness import vllm_python

CHECKER = Path(__file__).resolve().parent / "check_agent_bodies.py"
SERVED, PATH = "qwen-served", "/models/qwen"


def test_the_agents_canary_and_checks_read_vllms_own_bodies(tmp_path: Path) -> None:
    body = canary_request(SERVED)
    answered = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
                "remote_engine_id": "e-1", "remote_request_id": "cmpl-1", "remote_host": "10.0.0.7",
                "remote_port": 5600, "tp_size": 1}  # the keys a vLLM NIXL prefill answers
    nixl_one, nixl_two = nixl_bodies(body, answered)
    moon_p, moon_d = mooncake_bodies(body, "pdfleet-canary-1", "e-2", "http://10.0.0.8:8998")
    bodies = {"nixl_prefill": nixl_one, "nixl_decode": nixl_two, "mooncake_prefill": moon_p,
              "mooncake_decode": moon_d, "a_made_up_field": {**body, "kv_transfer_params": "not a dict"}}
    path = tmp_path / "bodies.json"
    path.write_text(json.dumps(bodies))
    done = subprocess.run([vllm_python(), str(CHECKER), str(path), SERVED, PATH], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    verdicts = said.pop("verdicts")
    assert {k: v for k, v in verdicts.items() if k != "a_made_up_field"} == dict.fromkeys(
        ("nixl_prefill", "nixl_decode", "mooncake_prefill", "mooncake_decode"), "ok"), verdicts
    assert verdicts["a_made_up_field"].startswith("ValidationError"), verdicts  # vLLM's model can refuse
    assert said["version"] == {"version": "0.33.0"}, said
    assert info_problems(said["version"], said["models"], declared_version="0.33.0", served_model=SERVED) == []
    wrong = info_problems(said["version"], said["models"], declared_version="0.33.1", served_model="other")
    assert len(wrong) == 2, wrong
    assert "reports version '0.33.0', the deployment declares '0.33.1'" in wrong[0]
    assert f"serves models ['{SERVED}'], the deployment declares 'other'" in wrong[1]
