"""pdfleet's runtime: per-rank state pools, the transfer planner, engines and the pod server.

Reading order: ``layouts`` (what state a model has) -> ``matrix`` (what each
backend can move) -> ``planner`` (which bytes go where) -> ``pools`` (where
they live) -> ``engines`` (who moves them) -> ``protocol`` (how ranks agree).
The first three are pure and may be imported by the operator; nothing here
imports torch or an engine at import time of the package.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
