"""The single-controller runtime: one controller process drives SPMD worker groups.

Backend-agnostic pieces live here (`decorator`, `worker`, `worker_group`,
`resource_pool`, `colocate`); `ray/` and `local.py` are the backends. Nothing
in this package knows about RL or models.
"""
