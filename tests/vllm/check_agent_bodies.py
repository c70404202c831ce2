"""Run in the vLLM check venv: vLLM 0.33's own models read the agent's canary bodies, and vLLM's own code writes
what the agent reads back (``/version`` and ``/v1/models``). tests/vllm/test_vllm_agent_bodies.py writes the
bodies and checks the agent's reading of vLLM's answers.

    python check_agent_bodies.py BODIES.json SERVED_NAME MODEL_PATH

Prints one JSON object: ``verdicts`` (per body, ok or the error vLLM's code raised), ``version`` (vLLM's
``GET /version`` body) and ``models`` (its ``GET /v1/models`` body for one served name).
"""

from __future__ import annotations

import json
import sys


def main(path: str, served: str, model_path: str) -> int:
    import asyncio
    from types import SimpleNamespace

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.version import __version__ as vllm_version

    with open(path) as f:
        bodies = json.load(f)
    verdicts: dict[str, str] = {}
    for name, body in bodies.items():
        try:
            req = CompletionRequest.model_validate(body)
            params = req.kv_transfer_params  # what vLLM hands its connector, unchanged
            verdicts[name] = "ok" if params == body.get("kv_transfer_params") else f"params became {params!r}"
        except Exception as e:  # what vLLM's code raised, reported
            verdicts[name] = f"{type(e).__name__}: {e}"[:500]
    # vLLM's show_version() answers {"version": VLLM_VERSION}; /v1/models is its registry's
    # show_available_models() dumped as the route does (the model config only gives max_model_len).
    registry = OpenAIModelRegistry(SimpleNamespace(max_model_len=4096),  # type: ignore[arg-type]
                                   [BaseModelPath(name=served, model_path=model_path)])
    models = asyncio.run(registry.show_available_models()).model_dump()
    print(json.dumps({"verdicts": verdicts, "version": {"version": vllm_version}, "models": models}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
