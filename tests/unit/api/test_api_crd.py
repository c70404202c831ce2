"""The generated CRD: up to date with the models, structural, described, and carrying the CEL rules,
subresources and printer columns. Also the JSON-schema -> structural converter on its own."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field

from pdfleet_operator.api.crd import CRD_FILE, build_crd, crd_yaml, main, openapi_schema
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.api.schema import StructuralSchemaError, to_structural, walk
from pdfleet_runtime.layouts import PRESETS

FORBIDDEN = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "const"}


def test_crds_dir_is_up_to_date() -> None:
    assert CRD_FILE.exists(), "run: python -m pdfleet_operator.api.crd --write"
    assert CRD_FILE.read_text() == crd_yaml(), (
        "crds/ is stale: run python -m pdfleet_operator.api.crd --write"
    )
    assert main(["--check"]) == 0


def test_schema_is_structural() -> None:
    for path, node in walk(openapi_schema()):
        assert not FORBIDDEN & node.keys(), (path, FORBIDDEN & node.keys())
        assert node.get("additionalProperties", {}) is not False, path
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path} has no type"
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
        for req in node.get("required", []):
            assert req in node["properties"] and "default" not in node["properties"][req], (path, req)


def test_every_field_has_a_description() -> None:
    missing = [
        p
        for p, n in walk(openapi_schema())
        if p and not p.endswith(("[]", ".*")) and "description" not in n and p != "metadata"
    ]
    assert not missing


def test_kubernetes_types_use_the_escape_hatches() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]
    role = spec["decode"]["properties"]
    assert role["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert role["env"]["items"]["properties"]["valueFrom"]["x-kubernetes-preserve-unknown-fields"] is True
    assert (
        role["resources"]["properties"]["limits"]["additionalProperties"]["x-kubernetes-int-or-string"]
        is True
    )
    rollout = spec["rollout"]["properties"]
    assert rollout["maxSurge"]["x-kubernetes-int-or-string"] is True and rollout["maxSurge"]["default"] == 1
    assert spec["model"]["properties"]["layout"]["properties"]["preset"]["enum"] == sorted(PRESETS)


def test_defaults_except_for_the_choices_a_user_must_make() -> None:
    spec = openapi_schema()["properties"]["spec"]
    assert spec["required"] == ["model", "transfer", "prefill", "decode"]
    transfer = spec["properties"]["transfer"]
    assert transfer["required"] == ["backend"] and transfer["properties"]["protocol"]["default"] == "rdma"
    role = spec["properties"]["prefill"]
    assert sorted(role["required"]) == ["image", "parallelism", "replicas"]
    assert role["properties"]["parallelism"]["required"] == ["tensor"]
    assert role["properties"]["gpuMemoryGiB"]["default"] == 141
    # full default objects: the apiserver checks CEL rules on a default without nested defaulting
    assert role["properties"]["pool"]["default"] == {
        "maxConcurrentRequests": 64,
        "kvTokensPerReplica": 131072,
    }
    assert spec["properties"]["rollout"]["default"] == {
        "maxSurge": 1,
        "maxUnavailable": 0,
        "drainTimeoutSeconds": 600,
        "progressDeadlineSeconds": 900,
        "paused": False,
    }


def test_cel_rules_are_attached_where_declared() -> None:
    nodes = dict(walk(openapi_schema()))
    for rule in CEL_RULES:
        for at in rule.at:
            entries = nodes[at].get("x-kubernetes-validations", [])
            assert any(e["rule"] == rule.rule and e["message"].startswith(f"{rule.id}: ") for e in entries), (
                at
            )


def test_crd_metadata_subresources_and_columns() -> None:
    crd = build_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "pddeployments.pdfleet.io"
    assert spec["names"]["shortNames"] == ["pdd"] and spec["names"]["kind"] == "PDDeployment"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Prefill", "Decode", "Backend", "Shapes", "Age"} <= columns.keys()
    assert yaml.safe_load(CRD_FILE.read_text()) == crd


# -- the converter on its own ----------------------------------------------------------------------


class Inner(BaseModel):
    """Inner doc."""

    x: int = Field(1, ge=0, description="x.")


class Outer(BaseModel):
    inner: Inner | None = Field(None, description="Field description wins.")
    n: int | str = Field(description="int or string.")
    e: int = Field(description="exclusive", gt=0)


def test_converter_inlines_refs_and_collapses_optionals() -> None:
    out = to_structural(Outer.model_json_schema())
    assert out["properties"]["inner"]["description"] == "Field description wins."
    assert out["properties"]["inner"]["properties"]["x"] == {
        "default": 1,
        "description": "x.",
        "minimum": 0,
        "type": "integer",
    }
    assert out["properties"]["n"] == {"x-kubernetes-int-or-string": True, "description": "int or string."}
    assert out["properties"]["e"]["minimum"] == 0 and out["properties"]["e"]["exclusiveMinimum"] is True
    assert out["required"] == ["n", "e"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}},
        {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "boolean"}]}}},
        {"type": "object", "properties": {"a": {"description": "Any without a type"}}},
        {"type": "object", "properties": {"a": {"type": "object", "additionalProperties": True}}},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},
        {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"},
        {"type": "string", "format": "date", "patternProperties": {}},
    ],
)
def test_converter_refuses_what_is_not_structural(schema: dict[str, Any]) -> None:
    with pytest.raises(StructuralSchemaError):
        to_structural(schema)
