"""pdfleet's operator: the PDDeployment API, admission, reconcile and rollouts.

Imports only the runtime's pure modules (layouts, matrix, runtime config),
never torch or a transfer engine (checked by import-linter).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
