"""The demo's vLLM step (``commands/demo_vllm``) without a cluster: its manifest is the example's (the demo carries a
copy, since examples are not installed), it is admitted, and each role's rendered ``engine`` container runs
``vllm serve`` with its NIXL connector role; the chat's twin changes only the router and the transfer backend."""

from __future__ import annotations

from pathlib import Path

import yaml

from pdfleet_operator.commands.demo_vllm import VLLM_CHAT, engine_commands, vllm_chat_manifest, vllm_manifest
from pdfleet_operator.render import render_object

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "valid" / "vllm-qwen3.8-flash-next-nixl.yaml"


def test_the_demos_vllm_manifest_is_the_example_and_renders_vllm_serve_per_role() -> None:
    manifest = vllm_manifest("demo")
    assert manifest["spec"] == yaml.safe_load(EXAMPLE.read_text())["spec"]
    rendered = render_object(manifest, "demo.yaml")
    assert rendered.verdict.admitted, rendered.verdict
    prefill, decode = engine_commands(rendered.objects)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    for cmd, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        assert cmd.argv[:2] == ["vllm", "serve"], cmd.argv
        assert f'"kv_role":"{role}"' in cmd.line and "NixlConnector" in cmd.line
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in cmd.transfer_env


def test_the_vllm_chat_is_the_chat_behind_vllm_router_on_nixl() -> None:
    chat = {"metadata": {"name": "chat", "namespace": "demo-chat"},
            "spec": {"transfer": {"backend": "mooncake", "protocol": "tcp"}, "router": {"image": "i"}, "decode": {}}}
    twin = vllm_chat_manifest(chat)
    assert twin["metadata"] == {"name": VLLM_CHAT, "namespace": "demo-chat"}
    assert twin["spec"]["transfer"] == {"backend": "nixl", "protocol": "tcp"}
    assert twin["spec"]["router"] == {"image": "i", "kind": "vllm"} and twin["spec"]["decode"] == {}
    assert chat["spec"]["transfer"]["backend"] == "mooncake"  # the caller's manifest is left as it was
