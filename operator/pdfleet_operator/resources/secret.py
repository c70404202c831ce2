"""The per-deployment Secret whose key signs protocol messages between prefill and decode.

Created once with a random key and never rewritten by the operator; ``plan`` creates it only when it
is missing *and no pod of the deployment runs*: a Secret deleted while pods use its key is not
silently replaced (the new key would make new pods and running ones refuse each other), the
deployment is reported ``Degraded`` (``AuthSecretMissing``) with the fix instead. Rotating the key
is the user's step, which running pods follow: write a new ``key`` and the old one as
``key.previous`` (docs/security.md, Runtime; ``pdfleet_runtime.protocol.keys``).
"""

from __future__ import annotations

import base64
import secrets

from pdfleet_operator.resources.names import owner_labels, secret_name
from pdfleet_operator.resources.runtime_config import SECRET_FILE

__all__ = ["AUTH_SECRET_MISSING", "auth_secret", "missing_key_in_use"]

AUTH_SECRET_MISSING = "AuthSecretMissing"


def auth_secret(name: str, namespace: str, key: bytes | None = None) -> dict:
    key = key if key is not None else secrets.token_bytes(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": secret_name(name), "namespace": namespace, "labels": owner_labels(name)},
        "data": {SECRET_FILE: base64.b64encode(key).decode()},
    }


def missing_key_in_use(name: str, secret_exists: bool, pods_running: int) -> str | None:
    """Why the Secret must not be made again now (``Degraded``'s message), or None."""
    if secret_exists or pods_running == 0:
        return None
    return (f"Secret {secret_name(name)} (the transfer key) is gone while {pods_running} pod(s) still use its key: "
            "a new key would make new pods and running ones refuse each other, so none is made. Restore the "
            "Secret with the same key (its pods hold it in memory and in their mounts), or delete the "
            "deployment's pods so that a new key is made for all of them")
