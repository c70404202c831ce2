"""A user's vLLM ``engine.args`` read the way ``vllm serve``'s parser reads them.

vLLM's ``FlexibleArgumentParser.parse_args`` (``vllm/utils/argparse_utils.py``) rewrites the arguments
before argparse sees them: underscores in option names become dashes (``--max_num_seqs``), ``-O3`` /
``-O=3`` / ``-O 3`` become ``--optimization-level 3``, and dotted keys of a config flag
(``--kv-transfer-config.kv_role kv_producer``, ``--x.y+ a,b``) are folded into one JSON value of the flag;
``--config FILE`` splices the file's flags in. ``read_vllm_args`` does the same rewriting, then reads the
result with argparse's rules over vLLM's flag set (``argv.parse_args``: abbreviations, short options such
as ``-tp``, ``=`` forms, value counts, choices). Each rewritten token remembers the ``args`` element it
came from, so every violation names the element the user wrote. Pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pdfleet_runtime.engine_rules.argv import FlagSet, ParsedArgs, parse_args

__all__ = ["VllmArgs", "read_vllm_args"]

_NAME = re.compile(r"(?<=--)[^.]*")  # from the leading -- to the first dot: the part vLLM un-underscores


@dataclass(frozen=True)
class VllmArgs:
    """``parsed``: the rewritten args as argparse reads them (indexes into the rewritten list); ``origin``:
    rewritten index -> the ``args`` element it came from; ``written``: the elements as given;
    ``config_files``: elements that are ``--config`` (flags admission cannot see); ``dotted``: dest -> the
    dotted keys given for it (``kv_transfer_config`` -> ``("kv_role",)``)."""

    parsed: ParsedArgs
    origin: tuple[int, ...]
    written: tuple[str, ...]
    config_files: tuple[int, ...] = ()
    dotted: tuple[tuple[str, str], ...] = ()


def _dashes(token: str) -> str:
    key, eq, value = token.partition("=")
    return _NAME.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + eq + value


def _merge(into: dict, update: dict) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        elif isinstance(v, list) and isinstance(into.get(k), list):
            into[k] += v
        else:
            into[k] = v


def read_vllm_args(args: Sequence[str], fs: FlagSet) -> VllmArgs:
    written = tuple(str(a) for a in args)
    tokens: list[tuple[str, int]] = []
    config_files: list[int] = []
    skip_next = False
    for i, arg in enumerate(written):
        if skip_next:
            skip_next = False
            continue
        if arg == "--config" or arg.startswith("--config="):
            config_files.append(i)
            skip_next = arg == "--config"
        elif arg.startswith("--"):
            tokens.append((_dashes(arg), i))
        elif arg.startswith("-O") and arg != "-O":
            tokens += [("--optimization-level", i), (arg[3:] if arg[2:3] == "=" else arg[2:], i)]
        elif arg == "-O" and i + 1 < len(written) and written[i + 1] in {"0", "1", "2", "3"}:
            tokens.append(("--optimization-level", i))
        else:
            tokens.append((arg, i))
    # dotted keys of config flags fold into one JSON value per flag, placed where its first key was
    folded: dict[str, dict] = {}
    first: dict[str, int] = {}
    dotted: list[tuple[str, str]] = []
    out: list[tuple[str, int]] = []
    j = 0
    while j < len(tokens):
        tok, origin = tokens[j]
        name = tok.split("=", 1)[0]
        if tok.startswith("-") and "." in name:
            if "=" in tok:
                value = tok.split("=", 1)[1]
            else:
                value = tokens[j + 1][0] if j + 1 < len(tokens) else ""
                j += 1
            key, *keys = name.split(".")
            if keys and keys[-1].endswith("+"):
                keys[-1] = keys[-1][:-1]
                parsed: object = value.split(",")
            else:
                try:
                    parsed = json.loads(value)
                except ValueError:
                    parsed = value
            nested: object = parsed
            for k in reversed(keys):
                nested = {k: nested}
            _merge(folded.setdefault(key, {}), nested if isinstance(nested, dict) else {})
            first.setdefault(key, origin)
            dotted.append((key, ".".join(keys)))
            j += 1
            continue
        out.append((tok, origin))
        j += 1
    for key, folded_value in folded.items():
        out += [(key, first[key]), (json.dumps(folded_value), first[key])]
    parsed_args = parse_args([t for t, _ in out], fs)
    return VllmArgs(parsed_args, tuple(o for _, o in out), written, tuple(config_files), tuple(dotted))
