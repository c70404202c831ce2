"""Fluent builders for AdmissionReview requests and PDDeployment objects used by the admission tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def example(name: str, kind: str = "valid") -> dict[str, Any]:
    """An example manifest as a fresh dict (``name`` without ``.yaml``)."""
    return yaml.safe_load((EXAMPLES / kind / f"{name}.yaml").read_text())


class Review:
    """``Review(obj).update(old).uid("x").body()`` -> AdmissionReview request bytes."""

    def __init__(self, obj: Any) -> None:
        self.doc: dict[str, Any] = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "uid-1",
                "operation": "CREATE",
                "object": copy.deepcopy(obj),
                "resource": {"group": "pdfleet.io", "version": "v1alpha1", "resource": "pddeployments"},
                "userInfo": {"username": "tester"},
            },
        }

    def uid(self, uid: Any) -> Review:
        self.doc["request"]["uid"] = uid
        return self

    def update(self, old: Any) -> Review:
        self.doc["request"]["operation"] = "UPDATE"
        self.doc["request"]["oldObject"] = copy.deepcopy(old)
        return self

    def operation(self, op: Any) -> Review:
        self.doc["request"]["operation"] = op
        return self

    def body(self) -> bytes:
        return json.dumps(self.doc).encode()
