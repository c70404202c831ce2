"""The per-deployment Secret whose key signs protocol messages between prefill and decode.

Created once with a random key and never rewritten by the operator; ``plan`` creates it only when it
is missing *and no pod of the deployment runs*: a Secret deleted while pods use its key is not
silently replaced (the new key would make new pods and running ones refuse each other), the
deployment is reported ``Degraded`` (``AuthSecretMissing``) with the fix instead. Rotating the key
is the user's step, which running pods follow: write a new ``key`` and the old one as
``key.previous`` (docs/security.md, Runtime; ``pdfleet_runtime.protocol.keys``).

A role whose replicas span nodes also gets its own group key (``group_secret``, the same format),
mounted into that role's pods only: rank messages inside a replica are signed with it, so a pod
of the other role, which holds the deployment key, cannot speak for a rank. It follows the same
rule: made only while no pod of the role's groups runs.
"""

from __future__ import annotations

import base64
import secrets

from pdfleet_operator.api.constants import Role
from pdfleet_operator.resources.names import group_secret_name, owner_labels, secret_name, worker_secret_name
from pdfleet_operator.resources.runtime_config import SECRET_FILE

__all__ = ["AUTH_SECRET_MISSING", "auth_secret", "group_secret", "missing_group_key_in_use", "missing_key_in_use",
           "worker_secret"]

AUTH_SECRET_MISSING = "AuthSecretMissing"


def _key_secret(secret: str, deployment: str, namespace: str, key: bytes | None) -> dict:
    key = key if key is not None else secrets.token_bytes(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": secret, "namespace": namespace, "labels": owner_labels(deployment)},
        "data": {SECRET_FILE: base64.b64encode(key).decode()},
    }


def worker_secret(name: str, namespace: str, key: str | None = None) -> dict:
    """``<deployment>-worker-auth``: the key the routers send to the worker API (``Authorization: Bearer``), so
    text, not bytes; mounted into the runtime pods and the router pods (docs/security.md)."""
    return _key_secret(worker_secret_name(name), name, namespace,
                       (key if key is not None else secrets.token_urlsafe(32)).encode())


def auth_secret(name: str, namespace: str, key: bytes | None = None) -> dict:
    return _key_secret(secret_name(name), name, namespace, key)


def group_secret(name: str, namespace: str, role: Role, key: bytes | None = None) -> dict:
    """``<deployment>-<role>-group-auth``: the key of the role's replica groups (item ``key``)."""
    return _key_secret(group_secret_name(name, role), name, namespace, key)


def missing_key_in_use(name: str, secret_exists: bool, pods_running: int) -> str | None:
    """Why the Secret must not be made again now (``Degraded``'s message), or None."""
    if secret_exists or pods_running == 0:
        return None
    return (f"Secret {secret_name(name)} (the transfer key) is gone while {pods_running} pod(s) still use its key: "
            "a new key would make new pods and running ones refuse each other, so none is made. Restore the "
            "Secret with the same key (its pods hold it in memory and in their mounts), or delete the "
            "deployment's pods so that a new key is made for all of them")


def missing_group_key_in_use(name: str, role: Role, pods_running: int) -> str:
    """``Degraded``'s message when a role's group key is gone while its groups' pods hold it."""
    return (f"Secret {group_secret_name(name, role)} (the {role.value} replica groups' key) is gone while "
            f"{pods_running} pod(s) of its groups still use it: a new key would split running and new members, "
            "so none is made. Restore the Secret with the same key, or delete the role's pods so that a new "
            "key is made for all of them")
