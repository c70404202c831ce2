"""kopf wiring of admission: the validating webhook and the re-check of stored objects.

- ``@kopf.on.validate`` (CREATE, UPDATE; failurePolicy Fail) exists so kopf's managed mode (dev)
  publishes the right ValidatingWebhookConfiguration; requests to it are answered by the pure
  ``review`` through ``AdmissionServer``'s route table, and the handler gives the same answer if
  kopf's own path ever calls it.
- Re-check: on resume (operator start, e.g. after an upgrade), create, update and a slow timer, the
  stored object is judged by the running operator's verdict; ``Admitted`` and ``Degraded`` are
  written through the status subresource, only when they change.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from pdfleet_operator.admission.process import AdmissionProcess
from pdfleet_operator.admission.review import format_denial, judge
from pdfleet_operator.admission.server import server_kwargs
from pdfleet_operator.admission.status import admission_conditions, merge_conditions
from pdfleet_operator.admission.verdicts import Verdicts
from pdfleet_operator.api.constants import GROUP, PLURAL, VERSION
from pdfleet_operator.api.models import Condition
from pdfleet_operator.settings import OperatorSettings, WebhookMode

__all__ = ["VALIDATE_WEBHOOK_ID", "conditions_hook", "recheck_patch", "register", "status_hook"]

# The last URL segment kopf publishes (https://HOST:PORT/validate-pddeployment); the Helm chart's
# configuration uses the same path.
VALIDATE_WEBHOOK_ID = "validate-pddeployment"
_RESOURCE = (GROUP, VERSION, PLURAL)


def recheck_patch(body: Mapping[str, Any], verdicts: Verdicts, now: dt.datetime) -> dict[str, Any]:
    """The status fields to write for a stored object (empty when nothing changes). Pure but for the cache."""
    obj = {k: body[k] for k in body}
    verdict = verdicts.of(obj)
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    status = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
    generation = meta.get("generation") if isinstance(meta.get("generation"), int) else None
    out: dict[str, Any] = {}
    conditions = merge_conditions(status.get("conditions"), admission_conditions(verdict, generation), now)
    if conditions is not None:
        out["conditions"] = conditions
    versions = ", ".join(verdict.matrix_versions)
    if versions and status.get("matrixVersion") != versions:
        out["matrixVersion"] = versions
    return out


def status_hook(verdicts: Verdicts) -> Callable[[dict[str, Any]], tuple[list[Condition], str | None]]:
    """``obj -> ([Admitted, Degraded], matrixVersion or None)`` for a reconciler that writes status."""

    def hook(obj: dict[str, Any]) -> tuple[list[Condition], str | None]:
        verdict = verdicts.of(obj)
        return admission_conditions(verdict, _generation(obj)), ", ".join(verdict.matrix_versions) or None

    return hook


def _generation(obj: Mapping[str, Any]) -> int | None:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    return meta.get("generation") if isinstance(meta.get("generation"), int) else None


def conditions_hook(verdicts: Verdicts) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """``obj -> [Admitted, Degraded]`` as plain dicts (no lastTransitionTime), for a reconciler that
    writes status itself: reconcile and the re-check then judge with one (cached) verdict."""

    def hook(obj: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            c.model_dump(by_alias=True, mode="json", exclude_none=True)
            for c in admission_conditions(verdicts.of(obj), _generation(obj))
        ]

    return hook


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings, kopf_settings: kopf.OperatorSettings,
             verdicts: Verdicts | None = None, recheck_handlers: bool = True) -> Verdicts:
    """Register the admission handlers and, unless the webhook is off, its server; returns the verdicts.

    ``recheck_handlers=False`` leaves the re-check to a reconciler that writes the whole status
    itself through ``status_hook`` (one writer of the status).
    """
    verdicts = verdicts or Verdicts.from_settings(settings.recheck)

    async def recheck(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
        now = dt.datetime.now(dt.UTC).replace(microsecond=0)
        fields = recheck_patch(body, verdicts, now)
        for key, value in fields.items():
            patch.status[key] = value
        if "conditions" in fields:
            admitted = next(c for c in fields["conditions"] if c["type"] == "Admitted")
            log = logger.info if admitted["status"] == "True" else logger.warning
            log(f"re-check: Admitted={admitted['status']}: {admitted.get('message', '')}")

    if recheck_handlers:
        for kind in ("resume", "create", "update"):
            getattr(kopf.on, kind)(*_RESOURCE, id=f"admission-recheck-{kind}", registry=registry)(recheck)
        interval = settings.recheck.interval_seconds
        kopf.timer(*_RESOURCE, id="admission-recheck-timer", interval=interval, initial_delay=interval,
                   registry=registry)(recheck)

    if settings.admission.mode is WebhookMode.OFF:
        return verdicts

    async def validate(body: kopf.Body, old: kopf.Body | None, warnings: list[str], **_: Any) -> None:
        judged = judge(verdicts, {k: body[k] for k in body}, {k: old[k] for k in old} if old else None)
        warnings.extend(judged.warnings)
        if judged.denied:
            raise kopf.AdmissionError(format_denial(judged.verdict, judged.denied), code=403)

    kopf.on.validate(*_RESOURCE, id=VALIDATE_WEBHOOK_ID, operations=["CREATE", "UPDATE"], persistent=False,
                     registry=registry)(validate)
    # Its own process: reviews never wait behind the watch events and passes of this one.
    kopf_settings.admission.server = AdmissionProcess(server_kwargs(settings.admission), settings.recheck,
                                                      VALIDATE_WEBHOOK_ID)
    if settings.admission.mode is WebhookMode.DEV:
        kopf_settings.admission.managed = settings.admission.configuration_name
    return verdicts
