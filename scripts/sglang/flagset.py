"""Write SGLang's command-line flag set, read from its own parser, as JSON (run in the SGLang venv).

    $(bash scripts/sglang-venv.sh)/bin/python scripts/sglang/flagset.py > \
        runtime/pdfleet_runtime/engine_rules/sglang-0.5.23.flags.json

The operator checks every flag of a PDDeployment's ``engine.args`` against this data (it cannot import
SGLang); tests/sglang checks the committed file against the parser it came from.
"""

from __future__ import annotations

import argparse
import json
import sys


def flag_set() -> dict:
    import sglang
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        nargs = action.nargs
        if nargs is None and action.option_strings:
            nargs = 0 if isinstance(action, (argparse._StoreConstAction, argparse._CountAction,
                                             argparse.BooleanOptionalAction)) else 1
        for opt in action.option_strings:
            flags[opt] = {
                "dest": action.dest,
                # what a flag without a value stores (store_true/false, --no-x of BooleanOptionalAction)
                "const": (not opt.startswith("--no-")) if isinstance(action, argparse.BooleanOptionalAction)
                else action.const if nargs == 0 and isinstance(action.const, (bool, int, str)) else None,
                "nargs": nargs if isinstance(nargs, int) else str(nargs),
                "choices": sorted(map(str, action.choices)) if action.choices is not None else None,
            }
    return {"engine": "sglang", "version": sglang.__version__, "abbrev": parser.allow_abbrev,
            "flags": dict(sorted(flags.items()))}


if __name__ == "__main__":
    json.dump(flag_set(), sys.stdout, indent=1)
    sys.stdout.write("\n")
