"""The per-deployment Secret whose key signs protocol messages between prefill and decode.

Created once with a random key and never rewritten (rotating it would cut live peers off);
``plan`` only creates it when it is missing.
"""

from __future__ import annotations

import base64
import secrets

from pdfleet_operator.resources.names import owner_labels, secret_name
from pdfleet_operator.resources.runtime_config import SECRET_FILE

__all__ = ["auth_secret"]


def auth_secret(name: str, namespace: str, key: bytes | None = None) -> dict:
    key = key if key is not None else secrets.token_bytes(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": secret_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "data": {SECRET_FILE: base64.b64encode(key).decode()},
    }
