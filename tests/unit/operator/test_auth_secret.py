"""Issue 25 item 5 (key rotation, operator side): a transfer-key Secret deleted while pods use its key is not
silently made again with a new key (new and running pods would refuse each other); the deployment reports
``Degraded`` with the fix. With no pod running, a missing Secret is made as before.
"""

from __future__ import annotations

import dataclasses

from pdfleet_operator.observe import observed_pod
from pdfleet_operator.plan import ActionKind, Snapshot, plan
from tests.unit.operator.test_plan import OWNER, base_spec, pods_of


def _running() -> tuple:
    first = plan(OWNER, base_spec(), Snapshot())
    return tuple(observed_pod({**p, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, "uid-1")
                 for p in pods_of(first))


def secrets_created(actions: list) -> list[str]:
    return [a.name for a in actions if a.kind is ActionKind.CREATE and a.object_kind == "Secret"]


def test_a_secret_deleted_while_pods_run_is_not_made_again_with_a_new_key() -> None:
    pods = _running()
    assert secrets_created(plan(OWNER, base_spec(), Snapshot(pods=pods, secret_exists=False,
                                                             worker_secret_exists=True))) == []


def test_with_no_pod_running_a_missing_secret_is_made() -> None:
    assert secrets_created(plan(OWNER, base_spec(), Snapshot())) == ["demo-transfer-auth", "demo-worker-auth"]
    gone = tuple(dataclasses.replace(p, deleting=True) for p in _running())
    assert secrets_created(plan(OWNER, base_spec(), Snapshot(pods=gone, worker_secret_exists=True))) == [
        "demo-transfer-auth"]


def test_the_worker_key_is_made_whenever_missing_as_text_and_mounted_into_every_runtime_pod() -> None:
    """Issue 39: the worker API wants the deployment's worker key. A deployment from before it gets one on its
    first pass, pods running or not (the new revision's pods mount it; the old ones never read it)."""
    import base64

    from pdfleet_operator.resources.names import worker_secret_name

    [create] = [a for a in plan(OWNER, base_spec(), Snapshot(pods=_running(), secret_exists=True))
                if a.kind is ActionKind.CREATE and a.object_kind == "Secret"]
    assert create.name == worker_secret_name("demo") == "demo-worker-auth"
    key = base64.b64decode(create.body["data"]["key"])
    assert len(key) >= 32 and key.decode("ascii").isprintable()  # a bearer token: text
    for pod in pods_of(plan(OWNER, base_spec(), Snapshot())):
        [vol] = [v for v in pod["spec"]["volumes"] if v["name"] == "worker-auth"]
        assert vol["secret"]["secretName"] == "demo-worker-auth"
        [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "worker-auth"]
        assert mount == {"name": "worker-auth", "mountPath": "/var/run/pdfleet/worker-auth", "readOnly": True}


def test_the_deployment_reports_degraded_with_the_fix() -> None:
    from pdfleet_operator.plan import pods_running
    from pdfleet_operator.resources.secret import AUTH_SECRET_MISSING, missing_key_in_use
    from pdfleet_operator.status import with_degraded

    snap = Snapshot(pods=_running(), secret_exists=False)
    why = missing_key_in_use(OWNER.name, snap.secret_exists, pods_running(snap))
    assert why is not None and "Restore the Secret with the same key" in why
    [cond] = with_degraded([], AUTH_SECRET_MISSING, why, 3)
    assert (cond.type, cond.status, cond.reason) == ("Degraded", "True", "AuthSecretMissing")
    assert missing_key_in_use(OWNER.name, True, 4) is None and missing_key_in_use(OWNER.name, False, 0) is None
