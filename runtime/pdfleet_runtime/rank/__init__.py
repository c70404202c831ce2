"""The rank processes and their contract with the pod process (torch and an engine, in the children the pod's fork server starts).

Reading order: ``pipe`` (the typed messages between the pod process and its ranks: the contract, pure),
``entry`` (the rank process's torch-free target), ``process`` (a rank process: pools, engine, protocol
coordinator), ``requests`` (what a rank does with a synthetic request), ``synthetic`` (seeded request state,
filled and verified), ``arena`` (a rank's seeded arena and whole-arena check, for the parity harness that
drives these same rank processes), ``staging_setup`` (the staged path's regions of a rank), then the
reference engine: ``reference`` (a rank process as a reference engine: load, prompts, generate),
``cache_pools`` (the one cache <-> pool mapping both sides share), ``model_runner`` (load a local model,
prefill, decode, the aggregate reference), ``faults`` (the negative controls applied to state).

The pod process imports only ``pipe`` and ``entry`` of this package (import-linter keeps it so): this
``__init__`` imports nothing.
"""
