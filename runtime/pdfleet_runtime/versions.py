"""Runtime releases: which capability matrix and wire protocol each implements.

A stored PDDeployment names a ``runtimeVersion`` per role. The operator maps it here to the matrix
that describes what that runtime can move, and to the wire protocol its ranks speak, so that an
upgrade can be re-checked and two roles whose protocols cannot talk are refused before any pod
starts. Pure data; add a row per release.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pdfleet_runtime import __version__

__all__ = [
    "CURRENT_RUNTIME_VERSION",
    "RUNTIME_RELEASES",
    "RUNTIME_VERSION_PATTERN",
    "Compatibility",
    "RuntimeRelease",
    "WireProtocol",
    "compatibility",
    "release_of",
]

CURRENT_RUNTIME_VERSION: str = __version__
# Semantic version with an optional pre-release; build metadata ("+cu13") is ignored for lookups.
RUNTIME_VERSION_PATTERN = r"^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$"
_VERSION_RE = re.compile(RUNTIME_VERSION_PATTERN)


@dataclass(frozen=True, slots=True, order=True)
class WireProtocol:
    """The version of the messages ranks exchange; peers talk iff the majors are equal.

    Minors add optional message fields only, so a peer ignores what it does not know.
    """

    major: int
    minor: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    def talks_to(self, other: WireProtocol) -> bool:
        return self.major == other.major


@dataclass(frozen=True, slots=True)
class RuntimeRelease:
    version: str
    matrix_version: str
    wire: WireProtocol


RUNTIME_RELEASES: Mapping[str, RuntimeRelease] = MappingProxyType(
    {
        "0.1.0": RuntimeRelease("0.1.0", matrix_version="1", wire=WireProtocol(1, 3)),
    }
)


@dataclass(frozen=True, slots=True)
class Compatibility:
    """Whether two runtime versions can pair; ``reason`` says why not."""

    ok: bool
    reason: str = ""


def release_of(
    version: object, releases: Mapping[str, RuntimeRelease] = RUNTIME_RELEASES
) -> RuntimeRelease | None:
    """The release a version string names (build metadata ignored), or None when unknown or malformed."""
    if not isinstance(version, str) or not _VERSION_RE.match(version):
        return None
    return releases.get(version.split("+", 1)[0])


def compatibility(
    a: object, b: object, releases: Mapping[str, RuntimeRelease] = RUNTIME_RELEASES
) -> Compatibility:
    """Can ranks of runtime ``a`` and runtime ``b`` exchange request state?"""
    ra, rb = release_of(a, releases), release_of(b, releases)
    if ra is None or rb is None:
        unknown = a if ra is None else b
        return Compatibility(False, f"runtime version {unknown!r} is unknown to this matrix")
    if not ra.wire.talks_to(rb.wire):
        return Compatibility(
            False,
            f"runtime {ra.version} speaks wire protocol {ra.wire}, runtime {rb.version} speaks {rb.wire}",
        )
    return Compatibility(True)
