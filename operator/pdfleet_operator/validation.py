"""Offline verdicts on PDDeployment manifests: the apiserver's checks, then the capability matrix.

Reading order: ``validate_object`` (one object -> ``ObjectVerdict``), built from three passes in
the order the apiserver runs them on ``kubectl apply --dry-run=server``:

1. ``check_schema``: the CRD's own structural schema (types, enums, ranges, required fields,
   unknown fields as strict field validation reports them), applying schema defaults on the way.
2. ``check_cel``: the Python twins of the CRD's CEL rules, on the defaulted object.
3. ``check_matrix``: the spec as pydantic models -> ``MatrixInput`` -> ``matrix.evaluate`` (what
   the validating webhook adds).

Every pass is total: any input (bad YAML, wrong types, missing fields) gives violations, never an
exception, and all passes run so one report lists every problem.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import yaml
from pydantic import ValidationError

from pdfleet_operator.api.constants import API_VERSION, KIND, LIST_KIND
from pdfleet_operator.api.crd import openapi_schema
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.api.rules import CEL_RULES
from pdfleet_operator.autoscale.admission import autoscaling_violations
from pdfleet_operator.engine import engine_input
from pdfleet_runtime.engine_rules import evaluate_engine, router_violations
from pdfleet_runtime.layouts import PRESETS, LayoutRef
from pdfleet_runtime.matrix import (
    GENERAL_RULES,
    MatrixInput,
    RoleInput,
    Verdict,
    Violation,
    all_rules,
    evaluate,
)
from pdfleet_runtime.matrix import matrix_input as build_matrix_input

__all__ = [
    "ObjectVerdict",
    "check_cel",
    "check_matrix",
    "check_schema",
    "iter_objects",
    "matrix_input",
    "validate_object",
    "validate_text",
]

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SCHEMA_REASON = ""  # the message says it all; the apiserver gives no reason either


@dataclass(frozen=True)
class ObjectVerdict:
    """The verdict on one object of one document; ``source`` is ``file#index``."""

    source: str
    name: str
    violations: tuple[Violation, ...]
    warnings: tuple[Violation, ...] = ()
    matrix_versions: tuple[str, ...] = ()
    spec: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def admitted(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "name": self.name,
            "admitted": self.admitted,
            "matrixVersions": list(self.matrix_versions),
            "violations": [v.as_dict() for v in self.violations],
            "warnings": [v.as_dict() for v in self.warnings],
        }


def _v(rule: str, message: str, *paths: str, reason: str = _SCHEMA_REASON, fix: str = "") -> Violation:
    return Violation(rule, message, paths, reason, fix)


# -- 1. schema ---------------------------------------------------------------------------------------


def _type_name(v: object) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def _type_ok(v: object, s: Mapping[str, Any]) -> bool:
    if s.get("x-kubernetes-int-or-string"):
        return type(v) in (int, str)
    t = s.get("type")
    if t == "integer":
        return type(v) is int
    if t == "number":
        return type(v) in (int, float)
    return {"string": str, "boolean": bool, "object": dict, "array": list}.get(str(t), object) is type(v)


def check_schema(value: Any, schema: Mapping[str, Any], path: str, errors: list[Violation]) -> Any:
    """Validate ``value`` against a structural schema node; returns it with schema defaults applied."""
    if type(value) is float and not math.isfinite(value):
        errors.append(_v("schema", f"must be a finite number, got {value}", path))
        return value
    if not _type_ok(value, schema):
        want = "integer or string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
        errors.append(_v("schema", f"must be of type {want}, got {_type_name(value)} {_short(value)}", path))
        return value
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(f'"{e}"' for e in schema["enum"])
        errors.append(_v("schema", f"unsupported value {_short(value)}: supported values: {supported}", path))
    if type(value) in (int, float):
        if "minimum" in schema and schema.get("exclusiveMinimum") and value <= schema["minimum"]:
            errors.append(_v("schema", f"{value} should be greater than {schema['minimum']}", path))
        elif "minimum" in schema and value < schema["minimum"]:
            errors.append(
                _v("schema", f"{value} should be greater than or equal to {schema['minimum']}", path)
            )
        if "maximum" in schema and schema.get("exclusiveMaximum") and value >= schema["maximum"]:
            errors.append(_v("schema", f"{value} should be less than {schema['maximum']}", path))
        elif "maximum" in schema and value > schema["maximum"]:
            errors.append(_v("schema", f"{value} should be less than or equal to {schema['maximum']}", path))
    elif isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(_v("schema", f"may not be longer than {schema['maxLength']}", path))
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(_v("schema", f"should be at least {schema['minLength']} chars long", path))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(_v("schema", f"{_short(value)} should match '{schema['pattern']}'", path))
    elif isinstance(value, list):
        return _check_list(value, schema, path, errors)
    elif isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        return _check_object(value, schema, path, errors)
    return value


def _check_list(value: list[Any], schema: Mapping[str, Any], path: str, errors: list[Violation]) -> list[Any]:
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(
            _v("schema", f"too many: {len(value)}: must have at most {schema['maxItems']} items", path)
        )
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(_v("schema", f"must have at least {schema['minItems']} items", path))
    items = schema.get("items", {})
    out = [check_schema(item, items, f"{path}[{i}]", errors) for i, item in enumerate(value)]
    if schema.get("x-kubernetes-list-type") == "set":
        seen: list[Any] = []
        for i, item in enumerate(out):
            if item in seen:
                errors.append(_v("schema", f"duplicate value: {_short(item)}", f"{path}[{i}]"))
            seen.append(item)
    return out


def _check_object(
    value: dict[str, Any], schema: Mapping[str, Any], path: str, errors: list[Violation]
) -> dict:
    props: Mapping[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    out: dict[str, Any] = {}
    for key, item in value.items():
        sub = f"{path}.{key}" if path else str(key)
        if item is None and not (props.get(key) or {}).get("nullable"):
            continue  # the apiserver prunes nulls before defaulting
        if not isinstance(key, str):
            errors.append(_v("schema", f"field name {key!r} must be a string", sub))
        elif key in props:
            out[key] = check_schema(item, props[key], sub, errors)
        elif isinstance(extra, Mapping):
            out[key] = check_schema(item, extra, sub, errors)
        else:
            errors.append(
                _v(
                    "schema",
                    f'unknown field "{sub}"',
                    sub,
                    fix=f"remove it; known fields: {', '.join(props) or 'none'}",
                )
            )
    for key, sub_schema in props.items():
        if key not in out and "default" in sub_schema:
            out[key] = check_schema(
                copy.deepcopy(sub_schema["default"]), sub_schema, f"{path}.{key}" if path else key, errors
            )
    for key in schema.get("required", ()):
        if key not in out:
            errors.append(_v("schema", "Required value", f"{path}.{key}" if path else key))
    return out


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# -- 2. CEL ------------------------------------------------------------------------------------------


def _at(obj: Any, path: str) -> Any:
    for name in path.split("."):
        if not isinstance(obj, dict) or name not in obj:
            return None
        obj = obj[name]
    return obj


def check_cel(obj: Mapping[str, Any]) -> list[Violation]:
    """Violations of the CRD's CEL rules on a defaulted object (rooted at the object, not the spec)."""
    rules = all_rules()
    out = []
    for rule in CEL_RULES:
        for path in rule.at:
            node = _at(obj, path)
            if not isinstance(node, dict):
                continue
            try:
                ok = rule.check(node)
            except (KeyError, TypeError, ZeroDivisionError, AttributeError):
                continue  # the schema pass reports the missing or mistyped field
            if not ok:
                r = rules.get(rule.id)
                field_path = path + (rule.field_path or "")
                out.append(
                    _v(
                        rule.id,
                        rule.message,
                        field_path,
                        reason=r.reason if r else rule.reason or "a CEL rule of the CRD",
                        fix=r.fix if r else rule.fix or rule.message,
                    )
                )
    return out


# -- 3. matrix ---------------------------------------------------------------------------------------


def _role_shape(role: Any) -> RoleInput:
    p = role.parallelism
    return RoleInput(
        tensor=p.tensor,
        pipeline=p.pipeline,
        data=p.data,
        expert=p.expert,
        nodes_per_replica=p.nodes_per_replica,
        runtime_version=role.runtime_version,
        max_requests=role.pool.max_concurrent_requests,
        kv_tokens=role.pool.kv_tokens_per_replica,
        gpu_memory_gib=role.gpu_memory_gib,
    )


def matrix_input(spec: PDDeploymentSpec) -> MatrixInput:
    """The matrix's view of a spec; an unresolvable layout becomes ``layout=None``."""
    engine = spec.engine.kind if spec.engine is not None else "pdfleet"
    return build_matrix_input(spec.model.layout, spec.transfer.backend, spec.transfer.protocol,
                              _role_shape(spec.prefill), _role_shape(spec.decode), str(engine))


def check_matrix(spec: Mapping[str, Any]) -> Verdict | None:
    """The matrix verdict on a (defaulted) spec dict, or None when it does not parse as a spec.

    The layout parses on its own, so an inconsistent inline layout still lets every other rule run.
    """
    layout_error: Violation | None = None
    raw_layout = _at(spec, "model.layout")
    try:
        LayoutRef.model_validate(raw_layout)
    except ValidationError as exc:
        layout_error = _v(
            "layout-unresolved",
            _pydantic_message(exc),
            "spec.model.layout",
            reason=GENERAL_RULES["layout-unresolved"].reason,
            fix=GENERAL_RULES["layout-unresolved"].fix,
        )
        spec = {**spec, "model": {**(spec.get("model") or {}), "layout": {"preset": next(iter(PRESETS))}}}
    try:
        model = PDDeploymentSpec.model_validate(spec)
    except (ValidationError, ValueError, TypeError):
        return None
    inp = matrix_input(model)
    if layout_error is not None:
        inp = MatrixInput(None, inp.backend, inp.protocol, inp.prefill, inp.decode, inp.engine)
    verdict = _with_engine(evaluate(inp), model)
    if layout_error is None:
        return verdict
    rest = tuple(v for v in verdict.violations if v.rule != "layout-unresolved")
    return Verdict((layout_error, *rest), verdict.warnings, verdict.matrix_versions)


def _with_engine(verdict: Verdict, spec: PDDeploymentSpec) -> Verdict:
    """The engine's rules (flags, version, start-up and transfer rejections) and the autoscaling checks that
    need a loop over replica counts (``api.autoscaling``) added to the matrix's."""
    scaling_errors, scaling_warnings = autoscaling_violations(spec)
    verdict = Verdict(verdict.violations + tuple(scaling_errors), verdict.warnings + tuple(scaling_warnings),
                      verdict.matrix_versions)
    inp = engine_input(spec)
    if inp is None:  # no engine container to check: the built-in runtime, whose router is its plug-in's
        kind = spec.engine.kind.value if spec.engine is not None else "pdfleet"
        wrong = router_violations(kind, spec.router.kind.value if spec.router and spec.router.kind else None,
                                  spec.transfer.backend if spec.router is not None else None)
        return verdict if not wrong else Verdict((*verdict.violations, *wrong), verdict.warnings,
                                                 verdict.matrix_versions)
    errors, warnings = evaluate_engine(inp)
    return Verdict(verdict.violations + errors, verdict.warnings + warnings, verdict.matrix_versions)


def _pydantic_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)


# -- one object --------------------------------------------------------------------------------------


def _metadata_name(obj: Mapping[str, Any], errors: list[Violation]) -> str:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        errors.append(_v("document", "metadata is required", "metadata"))
        return "?"
    name, generate = meta.get("name"), meta.get("generateName")
    if name is None and isinstance(generate, str) and generate:
        return generate + "*"
    if not isinstance(name, str) or not name:
        errors.append(_v("document", "Required value: name or generateName is required", "metadata.name"))
        return "?"
    if len(name) > 253 or not _NAME_RE.match(name):
        errors.append(_v("document", f"{name!r} must be a lowercase RFC 1123 subdomain", "metadata.name"))
    return name


def validate_object(obj: object, source: str = "<object>") -> ObjectVerdict:
    """Every violation of one object, as schema + CEL + webhook would report it. Never raises."""
    try:
        return _validate_object(obj, source)
    except Exception as exc:  # totality: a bug here must be a verdict, not a traceback
        return ObjectVerdict(
            source,
            "?",
            (
                _v(
                    "matrix-internal-error",
                    f"{type(exc).__name__}: {exc}",
                    "",
                    reason="a bug in pdfleet validate",
                    fix="report it",
                ),
            ),
        )


def _validate_object(obj: object, source: str) -> ObjectVerdict:
    if not isinstance(obj, dict):
        return ObjectVerdict(source, "?", (_v("document", f"expected a mapping, got {_type_name(obj)}", ""),))
    errors: list[Violation] = []
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        errors.append(
            _v(
                "document",
                f"expected apiVersion {API_VERSION} and kind {KIND}, got "
                f"{obj.get('apiVersion')!r} {obj.get('kind')!r}",
                "apiVersion",
                "kind",
            )
        )
        return ObjectVerdict(source, _name_of(obj), tuple(errors))
    name = _metadata_name(obj, errors)
    # status is reset on create (status subresource); metadata is checked above, as the apiserver does
    body = {k: v for k, v in obj.items() if k not in ("status", "metadata")}
    defaulted = check_schema(body, _schema(), "", errors)
    errors += check_cel(defaulted)
    spec = defaulted.get("spec") if isinstance(defaulted, dict) else None
    verdict = check_matrix(spec) if isinstance(spec, dict) else None
    warnings: tuple[Violation, ...] = ()
    versions: tuple[str, ...] = ()
    if verdict is not None:
        warnings, versions = verdict.warnings, verdict.matrix_versions
        errors += _new_matrix_violations(errors, verdict.violations)
    return ObjectVerdict(
        source, name, tuple(errors), warnings, versions, spec if isinstance(spec, dict) else None
    )


def _new_matrix_violations(found: list[Violation], matrix: tuple[Violation, ...]) -> list[Violation]:
    """Matrix violations not already reported by the schema or a CEL rule of the same id and field."""
    seen = {(v.rule, p) for v in found for p in v.paths}
    layout_reported = any(p.startswith("spec.model.layout") for v in found for p in v.paths)
    out = []
    for v in matrix:
        if any((v.rule, p) in seen for p in v.paths):
            continue
        if (v.rule == "layout-unresolved" and layout_reported) or (v.rule == "input-invalid" and found):
            continue
        out.append(v)
    return out


def _name_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else "?"


@cache
def _schema() -> dict[str, Any]:
    return openapi_schema()


# -- documents ---------------------------------------------------------------------------------------


def _normalise(value: Any) -> Any:
    """YAML -> what the apiserver sees as JSON: timestamps become strings, as kubectl sends them."""
    if isinstance(value, dict):
        return {
            (_normalise(k) if not isinstance(k, (str, int, float, bool)) else k): _normalise(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    return value


def iter_objects(text: str, source: str) -> Iterator[tuple[str, object]]:
    """(source#index, object) for every document; a YAML error yields an ``Exception`` instead."""
    index = 0
    docs = yaml.safe_load_all(text)
    while True:
        try:
            doc = next(docs)
        except StopIteration:
            return
        except (yaml.YAMLError, RecursionError) as exc:  # the stream cannot continue past a syntax error
            yield f"{source}#{index}", exc
            return
        if doc is None:
            continue
        try:
            doc = _normalise(doc)
        except RecursionError as exc:
            yield f"{source}#{index}", yaml.YAMLError(f"nested too deeply: {exc}")
            return
        items = doc.get("items") if isinstance(doc, dict) and doc.get("kind") in ("List", LIST_KIND) else None
        for obj in items if isinstance(items, list) else [doc]:
            yield f"{source}#{index}", obj
            index += 1


def validate_text(text: str, source: str) -> list[ObjectVerdict]:
    """Verdicts for every object of a multi-document YAML text; YAML errors are verdicts too."""
    out = []
    for where, obj in iter_objects(text, source):
        if isinstance(obj, Exception):
            mark = getattr(obj, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(obj, "problem", None) or str(obj).splitlines()[0]
            out.append(
                ObjectVerdict(
                    where,
                    "?",
                    (
                        _v(
                            "yaml",
                            f"not valid YAML{at}: {problem}",
                            "",
                            reason="the file cannot be parsed",
                            fix="fix the YAML syntax",
                        ),
                    ),
                )
            )
        else:
            out.append(validate_object(obj, where))
    return out
