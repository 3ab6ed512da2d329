"""The native rollout: our batched KV-cache sampler (rollout.py), its decoders and the C kernels they
run on (panel.c, decode_step.c)."""
