"""A Tinker-compatible training service: the `tinker` SDK's API served over hybridflow's own parts.

`hybridflow tinker` serves one base model to many training clients, each a LoRA adapter with its own optimizer
(models.py), samples with the native rollout from frozen adapter snapshots (sampler.py), keeps checkpoints as
tinker:// paths (checkpoints.py) and answers every state-changing call with a future (futures.py) that one worker
thread ends, each client's calls in seq_id order (scheduler.py). app.py is the HTTP layer, wire.py the protobuf
bodies, core.py the operations. docs/guides/tinker.md has the supported surface and each departure.
"""
