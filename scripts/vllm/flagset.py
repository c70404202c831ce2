"""Write `vllm serve`'s command-line flag set, read from vLLM's own parser, as JSON (run in the vLLM venv).

    $(bash scripts/vllm-venv.sh)/bin/python scripts/vllm/flagset.py > \
        runtime/pdfleet_runtime/engine_rules/vllm-0.33.0.flags.json

Every option string the ``serve`` subparser registers (``_option_string_actions``: the visible ones, short
options such as ``-tp``, and the hidden ``--no-enable-x`` forms of vLLM's ``EnableDisableAction``), with its
dest, value count, choices and what it stores without a value; ``json`` marks flags whose value is a config
object (vLLM then accepts dotted keys, ``--kv-transfer-config.kv_role kv_producer``). The operator reads
``engine.args`` against this data (pdfleet imports no vLLM); tests/vllm checks the committed file against
the parser. vLLM's parser needs a platform (its defaults infer the device type), so the check harness's
shims (tests/vllm/shims/h200.py: a stand-in libcuda, an H200 platform) come first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

SHIMS = Path(__file__).resolve().parents[2] / "tests" / "vllm" / "shims"


_JSON_TYPES = {"parse_dataclass", "loads", "union_dict_and_str"}


def _takes_json(fn: object, depth: int = 0) -> bool:
    """Whether an argparse type parses a JSON object: vLLM wraps its config parsers (``parse_dataclass``,
    ``json.loads``) in ``optional_type``/``parse_type`` closures, so the closure cells are searched too."""
    if fn is None or depth > 3:
        return False
    if getattr(fn, "__name__", "") in _JSON_TYPES:
        return True
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:
            continue
        if callable(inner) and _takes_json(inner, depth + 1):
            return True
    return False


def flag_set() -> dict:
    sys.path.insert(0, str(SHIMS))
    import h200

    with tempfile.TemporaryDirectory(prefix="vllm-flagset-") as tmp:
        h200.activate(h200.build_libcuda(tmp))
    import vllm
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand().subparser_init(sub)
    flags = {}
    for opt, action in sorted(serve._option_string_actions.items()):
        if isinstance(action, argparse._HelpAction):
            continue
        nargs = action.nargs
        if nargs is None:
            nargs = 0 if isinstance(action, (argparse._StoreConstAction, argparse._CountAction,
                                             argparse.BooleanOptionalAction)) else 1
        negative = getattr(action, "negative_option_strings", None)
        if isinstance(action, argparse.BooleanOptionalAction):
            const = (opt not in negative) if negative is not None else not opt.startswith("--no-")
        else:
            const = action.const if nargs == 0 and isinstance(action.const, (bool, int, str)) else None
        flags[opt] = {
            "dest": action.dest,
            "const": const,
            "nargs": nargs if isinstance(nargs, int) else str(nargs),
            "choices": sorted(map(str, action.choices)) if action.choices is not None else None,
            # a config object given as JSON: vLLM also takes its keys dotted (--kv-transfer-config.kv_role)
            "json": _takes_json(action.type),
        }
    positionals = [a.dest for a in serve._actions if not a.option_strings]
    return {"engine": "vllm", "version": vllm.__version__, "abbrev": serve.allow_abbrev,
            "positionals": positionals, "flags": flags}


if __name__ == "__main__":
    json.dump(flag_set(), sys.stdout, indent=1)
    sys.stdout.write("\n")
