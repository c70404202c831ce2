"""Pure builders of the objects a PDDeployment owns (dicts ready for the API).

Nothing here talks to the cluster: ``plan`` calls these, ``apply`` writes the results.
Reading order: ``names`` -> ``revision`` -> ``runtime_config`` -> ``pods`` -> ``services``,
``secret``, ``rbac``.
"""
