"""Run in the vLLM check venv: vLLM 0.33's own models read the bodies of one PD request of the built-in runtime's
vLLM contract (tests/vllm/test_vllm_contract_models.py writes them). Prints one JSON object: per body, ok or the
error vLLM's code raised.

    python check_contract_bodies.py BODIES.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse

    with open(path) as f:
        bodies = json.load(f)
    out: dict[str, str] = {}

    def check(name: str, fn) -> None:
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # what vLLM's code raised, reported
            out[name] = f"{type(e).__name__}: {e}"[:500]

    for name in ("step_one_request", "step_two_request"):
        check(name, lambda n=name: ChatCompletionRequest.model_validate(bodies[n]))
    for name in ("step_one_answer", "decode_answer"):
        check(name, lambda n=name: ChatCompletionResponse.model_validate(bodies[n]))
    # What a vLLM NIXL decode does with the kv_transfer_params it is handed (its scheduler's metadata).
    params = bodies["step_two_request"]["kv_transfer_params"]
    check("nixl_decode_reads_params", lambda: NixlConnectorMetadata().add_new_req_to_recv(
        "req-1", ([0],), params))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
