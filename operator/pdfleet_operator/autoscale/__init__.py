"""Autoscaling both roles on PD signals (issue 48; docs/autoscaling.md).

Reading order: ``signals`` (one role's metrics -> a replica recommendation per signal, pure) ->
``planner`` (both roles' recommendations -> the desired replicas, kept inside the bounds, the GPU
budget, the ratio band and the stabilization windows, pure, with an injected clock).
"""
