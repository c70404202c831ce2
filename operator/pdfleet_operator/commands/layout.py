"""`pdfleet layout --config PATH --engine ENGINE [--tp N] [--page-size N] [-o text|yaml|json]`: a model's state
layout from its own config.json, in the form one engine keeps it.

Pure (no torch, no transformers, no engine): the config is read by ``pdfleet_runtime.model``. The text lists
every buffer one TP rank holds, named as the engine's code names it, with bytes per token, per request slot
and per rank; ``-o yaml`` prints the ``spec.model.layout`` to paste into a PDDeployment (``pdfleet validate``
accepts it), or exits 2 naming the forms pdfleet's schema cannot express yet.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from pdfleet_runtime.layouts import LayoutError
from pdfleet_runtime.model.families import model_facts
from pdfleet_runtime.model.forms import ENGINES, EngineForm, engine_form
from pdfleet_runtime.model.hf_config import CONFIG_FILE, MAX_CONFIG_BYTES, ModelConfigError
from pdfleet_runtime.model.weights import model_weight_bytes

__all__ = ["form_json", "form_text", "register", "run"]

_GIB = 1 << 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layout", help="a model's state layout from its config.json, per engine",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, metavar="PATH",
                   help="config.json, or a model directory holding one")
    p.add_argument("--engine", required=True, choices=ENGINES, help="whose state form")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (a serving choice; default 16, 64 for a model with an indexer: QSA, "
                   "and DSA, whose SGLang pool asserts 64)")
    p.add_argument("-o", "--output", choices=("text", "yaml", "json"), default="text")
    p.set_defaults(handler=run)


def _read(path: Path) -> dict:
    if path.is_dir():
        path = path / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path} is above the {MAX_CONFIG_BYTES}-byte bound", "config.json")
        data = json.loads(path.read_text())
    except OSError as e:
        raise ModelConfigError(f"cannot read {path}: {e.strerror}", "config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}", "config.json") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} must hold a JSON object", "config.json")
    return data


def _layers(ids: list[int]) -> str:
    names = [str(i) if i < 1 << 31 else "request-wide" for i in ids]
    return ",".join(names) if len(names) <= 6 else f"{names[0]}..{names[-1]} ({len(names)})"


def form_text(form: EngineForm, weight_bytes: int | None) -> str:
    lines = [f"{form.family} on {form.engine.value}, tp {form.tp}, page {form.page_size} tokens",
             f"per rank: {form.bytes_per_token:,.1f} bytes per token, {form.bytes_per_slot:,} bytes per request slot",
             f"per replica (tp {form.tp}): {form.bytes_per_token * form.tp:,.1f} bytes per token, "
             f"{form.bytes_per_slot * form.tp:,} bytes per request slot"]
    if weight_bytes is not None:
        lines.append(f"weights: {weight_bytes / _GIB:,.2f} GiB in all, {weight_bytes / form.tp / _GIB:,.2f} GiB per "
                     "rank")
    lines += ["", f"  {'state (engine name)':48} {'layers':20} {'item':6} {'shape':18} {'dtype':14} {'split':10} "
                  "bytes/item"]
    rows: dict[tuple, list[int]] = {}
    for b in form.buffers:
        rows.setdefault((b.name, b.item, b.shape, b.dtype, b.split), []).append(b.layer_id)
    for (name, item, shape, dtype, split), ids in rows.items():
        size = 1
        for d in shape:
            size *= d
        lines.append(f"  {name:48} {_layers(ids):20} {item.value:6} {list(shape)!s:18} {dtype.value:14} "
                     f"{split.value:10} {size * dtype.itemsize:,}")
    if form.empty_layers:
        lines.append(f"  (layers holding nothing: {_layers(list(form.empty_layers))})")
    for note in form.notes:
        lines.append(f"note: {note}")
    for m in form.missing:
        lines.append(f"not expressible in pdfleet's layout schema yet: {m}")
    return "\n".join(lines)


def form_json(form: EngineForm, weight_bytes: int | None) -> dict[str, object]:
    return {
        "family": form.family, "engine": form.engine.value, "tp": form.tp, "pageSize": form.page_size,
        "perRank": {"bytesPerToken": form.bytes_per_token, "bytesPerSlot": form.bytes_per_slot,
                    "weightBytes": None if weight_bytes is None else weight_bytes // form.tp},
        "buffers": [{"name": b.name, "layerId": b.layer_id, "item": b.item.value, "shape": list(b.shape),
                     "dtype": b.dtype.value, "split": b.split.value, "itemBytes": b.item_bytes,
                     "tokensPerItem": b.tokens_per_item, "maxTokens": b.max_tokens, "groups": list(b.groups)}
                    for b in form.buffers],
        "emptyLayers": list(form.empty_layers), "notes": list(form.notes), "missing": list(form.missing),
        "layout": None if form.layout is None else form.layout.model_dump(mode="json", by_alias=True,
                                                                         exclude_defaults=True),
    }


def run(args: argparse.Namespace) -> int:
    try:
        config = _read(Path(args.config))
        facts = model_facts(config)
        page = args.page_size or (64 if facts.indexer is not None else 16)
        if page < 1:
            raise ModelConfigError(f"--page-size {page} must be at least 1", "pageSize")
        form = engine_form(facts, args.engine, tp=args.tp, page_size=page)
        weights = model_weight_bytes(config)
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output == "json":
        print(json.dumps(form_json(form, weights), indent=2))
    elif args.output == "text":
        print(form_text(form, weights))
    else:
        if form.layout is None:
            print(f"error: {form.family} on {form.engine.value} has state pdfleet's layout schema cannot express "
                  "yet: " + "; ".join(form.missing), file=sys.stderr)
            return 2
        inline = form.layout.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        if weights is not None:
            inline["weightBytes"] = weights
        print(f"# pdfleet layout --engine {form.engine.value} --tp {form.tp}: {form.family}, "
              f"{form.bytes_per_token * form.tp:,.0f} bytes per token and {form.bytes_per_slot * form.tp:,} bytes "
              "per request slot per replica")
        print(yaml.safe_dump({"layout": {"inline": inline}}, sort_keys=False, default_flow_style=None), end="")
    return 0
