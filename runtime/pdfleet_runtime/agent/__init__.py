"""``pdfleet-runtime agent``: the container beside an SGLang engine (no torch in its process).

Reading order: ``model_config`` (config.json against the layout, pure), ``engine_info`` (SGLang's
/server_info and /metrics, pure), ``canary`` (a request as SGLang's router sends it, re-checked),
``readiness`` (the verdict, pure), ``options``, ``app`` (the loops, the gate, the drain), ``main``.
docs/agent.md describes what it checks and when, its readiness reasons and the drain.

Importing this package imports nothing: ``main.agent`` loads the server.
"""

from __future__ import annotations

__all__: list[str] = []
