"""The vllm rollout: vLLM's engine inside the worker process (rollout.py), its engine arguments
(engine.py) and the weight loading inside vLLM's worker (weights.py)."""
