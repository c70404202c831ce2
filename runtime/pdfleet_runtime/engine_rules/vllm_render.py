"""What a vLLM pod's engine gets from ``spec.transfer`` and its role: the kv-transfer-config and the transfer
environment. Pure (the operator's ``resources/plugins/vllm.py`` builds the command and container from these).

- ``kv_transfer_config``: ``{"kv_connector": NixlConnector|MooncakeConnector, "kv_role": kv_producer on
  prefill, kv_consumer on decode}``, with Mooncake's ``kv_connector_extra_config`` (``mooncake_protocol``,
  ``device_name``: one string for every rank).
- ``transfer_env``: NIXL's side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``; the host,
  ``VLLM_NIXL_SIDE_CHANNEL_HOST``, is the pod IP from the downward API, added by the operator on that
  variable itself) and UCX's transports and devices; Mooncake's bootstrap port
  (``VLLM_MOONCAKE_BOOTSTRAP_PORT``, served by the prefill).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pdfleet_runtime.engine_rules.vllm import (
    CONNECTORS,
    KV_ROLES,
    MOONCAKE_BOOTSTRAP_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    PROTOCOLS,
)
from pdfleet_runtime.links import Backend, LinkProtocol

__all__ = ["FIELD_REF_ENV", "bootstrap_port", "kv_transfer_config", "transfer_env"]

# variables whose value is the pod's IP (valueFrom.fieldRef status.podIP on the variable itself): NIXL's
# handshake listener advertises this host to the decode; vLLM's own address (Mooncake's transfer engine)
FIELD_REF_ENV = {Backend.NIXL: ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_HOST_IP"),
                 Backend.MOONCAKE: ("VLLM_HOST_IP",)}


def bootstrap_port(backend: Backend) -> int:
    """The prefill's port the decode (NIXL's handshake) or the router (Mooncake's bootstrap) reaches."""
    return NIXL_SIDE_CHANNEL_PORT if backend is Backend.NIXL else MOONCAKE_BOOTSTRAP_PORT


def kv_transfer_config(backend: Backend, protocol: LinkProtocol, role: str,
                       devices: Sequence[str] | None = None) -> str:
    settings = PROTOCOLS[(backend, protocol)]
    cfg: dict[str, object] = {"kv_connector": CONNECTORS[backend], "kv_role": KV_ROLES[role]}
    extra: dict[str, str] = dict(settings.extra_config)
    if settings.devices == "mooncake" and devices:
        extra["device_name"] = ",".join(devices)
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg, separators=(",", ":"))


def transfer_env(backend: Backend, protocol: LinkProtocol, devices: Sequence[str] | None) -> list[tuple[str, str]]:
    """The transfer's fixed environment, in order (the operator adds the pod-IP variables first)."""
    settings = PROTOCOLS.get((backend, protocol))
    if settings is None:
        return []
    out: list[tuple[str, str]] = []
    if backend is Backend.NIXL:
        out.append(("VLLM_NIXL_SIDE_CHANNEL_PORT", str(NIXL_SIDE_CHANNEL_PORT)))
    else:
        out.append(("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(MOONCAKE_BOOTSTRAP_PORT)))
    out += list(settings.env.items())
    if settings.devices == "ucx" and devices:
        out.append(("UCX_NET_DEVICES", ",".join(f"{d}:1" for d in devices)))
    return out
