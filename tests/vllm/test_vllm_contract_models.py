"""The built-in runtime's vLLM contract read by vLLM 0.33's own code (issue 44): the bodies vllm-router sends
(NIXL step one; step two with the prefill's ``kv_transfer_params``) parse as vLLM's ``ChatCompletionRequest``,
the prefill's and the decode's answers as its ``ChatCompletionResponse``, and a vLLM NIXL decode's scheduler
metadata takes the ``kv_transfer_params`` the runtime's prefill handed out (``add_new_req_to_recv``, which reads
the keys a vLLM decode pulls with). The bodies come from real ``serve`` processes; the check runs in the vLLM
check venv (``check_contract_bodies.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.server.harness import http
from tests.server.test_worker_api import MODEL, Pair
from tests.vllm.harness import vllm_python

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "what moves between prefill and decode?"}]


def test_vllms_own_models_read_the_runtimes_vllm_contract(tmp_path: Path) -> None:
    python = vllm_python()
    pair = Pair(tmp_path, "nixl").ready()
    try:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 8}
        step_one = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}}
        code, first = http("POST", pair.prefill.url + "/v1/chat/completions", step_one, 30)
        assert code == 200, first
        step_two = {**body, "kv_transfer_params": first["kv_transfer_params"]}
        code, answer = http("POST", pair.decode.url + "/v1/chat/completions", step_two, 60)
        assert code == 200 and answer["pdfleet"]["verified"], answer
    finally:
        pair.stop()
    bodies = tmp_path / "bodies.json"
    bodies.write_text(json.dumps({"step_one_request": step_one, "step_two_request": step_two,
                                  "step_one_answer": first, "decode_answer": answer}))
    proc = subprocess.run([python, str(Path(__file__).with_name("check_contract_bodies.py")), str(bodies)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert verdicts == dict.fromkeys(("step_one_request", "step_two_request", "step_one_answer", "decode_answer",
                                      "nixl_decode_reads_params"), "ok"), verdicts
