"""The built-in pdfleet runtime as an engine kind: the runtime container is the engine.

No engine container (``container`` None): ``resources.pods.runtime_pod`` is the whole pod, the runtime
serves the worker API on its HTTP port, and a replica group's members reach their leader on the runtime's
group port (``pdfleet_runtime.config``).
"""

from __future__ import annotations

from pdfleet_operator.api.models import EngineKind
from pdfleet_operator.resources.plugins.contract import EngineContainer, NamedPort, WorkerContract
from pdfleet_runtime.config import GROUP_PORT, HTTP_PORT
from pdfleet_runtime.engine_rules import EngineRules
from pdfleet_runtime.engine_rules.builtin import BUILTIN as BUILTIN_RULES

__all__ = ["BUILTIN", "BuiltinEngine"]


class BuiltinEngine:
    """``spec.engine.kind: pdfleet`` (or no ``spec.engine``)."""

    kind = EngineKind.PDFLEET
    rules: EngineRules = BUILTIN_RULES
    worker = WorkerContract(port=HTTP_PORT, health_path="/health")  # the worker API (the OpenAI routes and /health)
    group_port = NamedPort(name="group", port=GROUP_PORT)
    container: EngineContainer | None = None


BUILTIN = BuiltinEngine()
