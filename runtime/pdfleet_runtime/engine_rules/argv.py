"""An engine's command-line flag set (data generated from its own parser) and a reading of ``args``.

The operator cannot import an engine, so it reads a user's ``engine.args`` the way the engine's
argparse parser would: exact long options, ``--flag=value``, unique-prefix abbreviations (argparse's
``allow_abbrev``), and the value counts of every flag. Anything argparse would refuse (an unknown or
ambiguous flag, a missing value, a value outside ``choices``) becomes an ``ArgProblem``, since the
engine would exit 2 at start. Pure: reads only the JSON files next to this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import MappingProxyType

__all__ = ["ArgProblem", "Flag", "FlagSet", "ParsedArgs", "flag_set", "parse_args"]

_DATA = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Flag:
    option: str
    dest: str
    nargs: int | str  # 0, 1, "?", "*", "+" (as argparse counts them)
    choices: tuple[str, ...] | None = None
    const: object = True  # what the flag stores when it takes no value


@dataclass(frozen=True)
class FlagSet:
    engine: str
    version: str
    flags: Mapping[str, Flag]
    abbrev: bool = True

    def resolve(self, option: str) -> tuple[Flag | None, tuple[str, ...]]:
        """The flag an option names (exactly or by unique prefix) and, when none, the candidates."""
        if option in self.flags:
            return self.flags[option], ()
        if not self.abbrev:
            return None, ()
        matches = tuple(o for o in self.flags if o.startswith(option))
        if len(matches) == 1:
            return self.flags[matches[0]], ()
        return None, matches


@cache
def flag_set(engine: str, version: str) -> FlagSet | None:
    """The flag set of one engine version, or None when the repository has none for it."""
    path = _DATA / f"{engine}-{version}.flags.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    flags = {
        opt: Flag(opt, f["dest"], f["nargs"] if f["nargs"] in ("?", "*", "+") else int(f["nargs"]),
                  tuple(f["choices"]) if f["choices"] is not None else None,
                  True if f.get("const") is None else f["const"])
        for opt, f in data["flags"].items()
    }
    return FlagSet(data["engine"], data["version"], MappingProxyType(flags), bool(data.get("abbrev", True)))


@dataclass(frozen=True, slots=True)
class ArgProblem:
    index: int  # position in the args list
    kind: str  # "unknown", "ambiguous", "value"
    message: str


@dataclass(frozen=True)
class ParsedArgs:
    """``values``: dest -> the last value given (True for a flag without value, a tuple for lists);
    ``where``: dest -> (the args index of the flag, the option as written, the flag it resolved to)."""

    values: Mapping[str, object]
    where: Mapping[str, tuple[int, str, str]]
    problems: tuple[ArgProblem, ...]


def _is_option(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # argparse reads a negative number as a value
    except ValueError:
        return True
    return False


def parse_args(args: Sequence[str], fs: FlagSet) -> ParsedArgs:
    values: dict[str, object] = {}
    where: dict[str, tuple[int, str, str]] = {}
    problems: list[ArgProblem] = []
    i = 0
    while i < len(args):
        token = str(args[i])
        if not _is_option(token):
            problems.append(ArgProblem(i, "unknown", f"unexpected value {token!r} (no flag before it takes one)"))
            i += 1
            continue
        option, eq, inline = token.partition("=")
        flag, candidates = fs.resolve(option)
        if flag is None:
            if candidates:
                problems.append(ArgProblem(i, "ambiguous", f"{option} is ambiguous: it could be "
                                           f"{', '.join(candidates[:6])}{' ...' if len(candidates) > 6 else ''}"))
            else:
                problems.append(ArgProblem(i, "unknown", f"{option} is not a flag of {fs.engine} {fs.version}"))
            i += 1
            continue
        start = i
        i += 1
        taken: list[str] = []
        if eq:
            taken = [inline]
            if flag.nargs == 0:
                problems.append(ArgProblem(start, "value", f"{flag.option} takes no value, got {inline!r}"))
        else:
            want = flag.nargs
            while i < len(args) and not _is_option(str(args[i])) and (
                    want in ("*", "+") or (want == "?" and not taken) or (isinstance(want, int) and len(taken) < want)):
                taken.append(str(args[i]))
                i += 1
            if (isinstance(want, int) and len(taken) < want) or (want == "+" and not taken):
                problems.append(ArgProblem(start, "value", f"{flag.option} needs a value"))
                continue
        if flag.choices is not None:
            bad = [v for v in taken if v not in flag.choices]
            if bad:
                problems.append(ArgProblem(start, "value", f"{flag.option} {bad[0]!r} is not one of "
                                           f"{', '.join(flag.choices)}"))
                continue
        values[flag.dest] = flag.const if flag.nargs == 0 else (taken[0] if flag.nargs in (1, "?") and taken
                                                            else tuple(taken))
        where[flag.dest] = (start, option, flag.option)
    return ParsedArgs(MappingProxyType(values), MappingProxyType(where), tuple(problems))
