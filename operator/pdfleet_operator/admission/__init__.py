"""Admission of PDDeployments in the cluster: the validating webhook and the re-check of stored objects.

Reading order: ``verdicts`` (``pdfleet validate``'s verdict, cached, with the running matrix) ->
``review`` (pure: request bytes -> AdmissionReview response; never raises) -> ``status`` (pure:
verdict -> Admitted/Degraded conditions) -> ``server`` (kopf's WebhookServer with ``review`` in
front) -> ``process`` (that server in a process of its own). ``pdfleet_operator.handlers`` wires them into kopf. docs/admission.md has the deployment
shapes (production and dev).
"""

from pdfleet_operator.admission.handlers import VALIDATE_WEBHOOK_ID, conditions_hook, recheck_patch
from pdfleet_operator.admission.review import deny, response_problems, review, scan_uid
from pdfleet_operator.admission.server import AdmissionServer, WebhookSetupError, build_server
from pdfleet_operator.admission.status import admission_conditions, merge_conditions
from pdfleet_operator.admission.verdicts import Verdicts, running_matrix

__all__ = [
    "VALIDATE_WEBHOOK_ID",
    "AdmissionServer",
    "Verdicts",
    "WebhookSetupError",
    "admission_conditions",
    "build_server",
    "conditions_hook",
    "deny",
    "merge_conditions",
    "recheck_patch",
    "response_problems",
    "review",
    "running_matrix",
    "scan_uid",
]
