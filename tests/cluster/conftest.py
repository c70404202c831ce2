"""Names the cluster tests share; the ``crd`` and ``operator`` fixtures live in tests/conftest.py."""

from __future__ import annotations

from pdfleet_devcluster.local_operator import LocalOperator

OperatorProcess = LocalOperator  # the name the cluster tests use
