"""Pydantic JSON schema -> Kubernetes structural OpenAPI v3 schema.

The apiserver accepts only structural schemas: every node has a ``type`` (or is int-or-string or
preserves unknown fields), no ``$ref``/``$defs``, no ``anyOf``/``oneOf`` that introduce types, no
``additionalProperties: false``, no ``title``. Pydantic emits all of those. This converter inlines
references and rewrites the few shapes our models use; anything else raises
``StructuralSchemaError`` so an unsupported model construct fails the generator, not the cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["StructuralSchemaError", "to_structural", "walk"]

_DROP = frozenset({"title", "$defs", "discriminator"})
_PASS = frozenset(
    {
        "type",
        "description",
        "default",
        "enum",
        "format",
        "pattern",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "nullable",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-int-or-string",
        "x-kubernetes-validations",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
        "x-kubernetes-embedded-resource",
    }
)


class StructuralSchemaError(ValueError):
    """A pydantic schema construct that has no structural equivalent (the path says where)."""


def _clean_description(text: str) -> str:
    return " ".join(text.replace("``", "`").split())


def to_structural(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Convert a pydantic ``model_json_schema(by_alias=True)`` to a structural schema."""
    defs = schema.get("$defs", {})
    return _convert(schema, defs, "", ())


def _resolve(
    node: Mapping[str, Any], defs: Mapping[str, Any], path: str, seen: tuple[str, ...]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Inline ``$ref`` (sibling keys such as the field's description win over the target's)."""
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is None:
        return node, seen
    name = ref.rsplit("/", 1)[-1]
    if not ref.startswith("#/$defs/") or name not in defs:
        raise StructuralSchemaError(f"{path or '<root>'}: unresolvable $ref {ref}")
    if name in seen:
        raise StructuralSchemaError(f"{path}: recursive model {name} cannot be a structural schema")
    target, seen = _resolve(defs[name], defs, path, (*seen, name))
    target.update(node)
    return target, seen


def _convert(
    node: Mapping[str, Any], defs: Mapping[str, Any], path: str, seen: tuple[str, ...]
) -> dict[str, Any]:
    node, seen = _resolve(node, defs, path, seen)
    if "allOf" in node:  # pydantic wraps a $ref with siblings in allOf in some versions
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise StructuralSchemaError(f"{path}: allOf with {len(parts)} parts")
        inner, seen = _resolve(parts[0], defs, path, seen)
        inner.update(node)
        node = inner
    if "oneOf" in node:
        raise StructuralSchemaError(f"{path}: oneOf is not structural; use one object and a CEL rule")
    if "anyOf" in node:
        node, seen = _collapse_any_of(node, defs, path, seen)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "default" in node and node["default"] is None:
        del node["default"]  # null is pruned by the apiserver: an absent field is the same thing
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "description":
            out[key] = _clean_description(value)
        elif key == "properties":
            out[key] = {k: _convert(v, defs, f"{path}.{k}", seen) for k, v in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, f"{path}[]", seen)
        elif key == "additionalProperties":
            if isinstance(value, Mapping):
                out[key] = _convert(value, defs, f"{path}.*", seen)
            elif value is True and not node.get("x-kubernetes-preserve-unknown-fields"):
                raise StructuralSchemaError(
                    f"{path}: free-form object needs x-kubernetes-preserve-unknown-fields"
                )
        elif key == "required":
            req = [r for r in value if "default" not in node.get("properties", {}).get(r, {})]
            if req:
                out[key] = req
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[bound], out[key] = value, True
        elif key in _PASS:
            out[key] = copy.deepcopy(value)
        else:
            raise StructuralSchemaError(f"{path}: unsupported schema keyword {key!r}")
    if (
        "type" not in out
        and not out.get("x-kubernetes-int-or-string")
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        raise StructuralSchemaError(
            f"{path}: node without a type (Any needs x-kubernetes-preserve-unknown-fields)"
        )
    if out.get("x-kubernetes-preserve-unknown-fields") and "type" not in out:
        out["type"] = "object"
    return out


def _collapse_any_of(
    node: dict[str, Any], defs: Mapping[str, Any], path: str, seen: tuple[str, ...]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``X | None`` -> X; ``int | str`` -> int-or-string (string constraints lifted to the node)."""
    branches = []
    for b in node.pop("anyOf"):
        resolved, b_seen = _resolve(b, defs, path, seen)
        branches.append((resolved, b_seen))
    branches = [(b, s) for b, s in branches if b.get("type") != "null"]
    types = sorted(str(b.get("type")) for b, _ in branches)
    if len(branches) == 1:
        merged, seen = branches[0]
    elif types == ["integer", "string"]:
        merged = {"x-kubernetes-int-or-string": True}
        for b, _ in branches:
            merged.update({k: v for k, v in b.items() if k != "type"})
    else:
        raise StructuralSchemaError(f"{path}: anyOf of {types} is not structural")
    merged.update(node)
    return merged, seen


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every node of a structural schema with its dotted path (``[]`` for items, ``*`` for map values)."""
    out = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        out += walk(sub, f"{path}.{name}" if path else name)
    if isinstance(schema.get("items"), dict):
        out += walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += walk(schema["additionalProperties"], f"{path}.*")
    return out
