"""The run's own operators in one process, for the device profile (planner/device.py) to time.

A raw Hugging Face forward / backward scales with threads differently from what a run executes: the engine
packs rows, computes in bf16 from fp32 master weights (casts each pass), takes the LM head at response
positions only and steps a fused AdamW; the rollout decodes with its own kernels and a preallocated cache.
Timed on SmolLM2 at 1 vs 2 threads, the raw forward + backward sped up 1.65x, the engine's update 1.80x,
and two-worker vs one-worker runs of the main job 1.81x. So the profile times these operators themselves:
FSDPEngine (world size 1) log-probs and update, and the native rollout's decode steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.models import load_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.base import load_rollout_model


class EngineOperators:
    """An FSDPEngine and a native rollout of one model in this process, in one dtype."""

    def __init__(self, model_path: str, dtype: torch.dtype) -> None:
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        # lr ~0: the update's work without moving the weights away from the model measured
        self.engine = FSDPEngine.from_pretrained(model_path, EngineConfig(param_dtype=name), OptimConfig(lr=1e-12))
        self.vocab = int(self.engine.hf_config().vocab_size)
        self.tokenizer = load_tokenizer(model_path)
        self.rollout_config = RolloutConfig(name="native", dtype=name, ignore_eos=True)
        self._rollout_model: torch.nn.Module | None = None
        self.model_path = model_path
        self._generate_calls: dict[tuple[int, int, int], Callable[[], None]] = {}
        self.optimizer_s: list[float] = []
        """Seconds of each optimizer step the updates took (gradient norm, AdamW step, zero-grad), timed inside."""
        step = self.engine._optimizer_step

        def timed_step() -> dict[str, float]:
            start = time.perf_counter()
            out = step()
            self.optimizer_s.append(time.perf_counter() - start)
            return out

        self.engine._optimizer_step = timed_step  # this instance only: the profile times the step apart

    def batch(self, rows: int, length: int) -> dict[str, torch.Tensor]:
        """`rows` unpadded rows of `length` random tokens, the last half of them the response."""
        ids = torch.randint(0, self.vocab, (rows, length))
        mask = torch.ones_like(ids)
        return {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: mask.cumsum(-1) - 1,
            keys.RESPONSES: ids[:, length - max(1, length // 2) :],
        }

    def log_probs(self, data: dict[str, torch.Tensor]) -> Callable[[], None]:
        """One log-prob pass over `data` as one micro-batch."""
        return lambda: self.engine.compute_log_probs(data, len(data[keys.INPUT_IDS]))

    def update(self, data: dict[str, torch.Tensor]) -> Callable[[], None]:
        """One update (forward, backward, optimizer step: its seconds appended to `optimizer_s`) on `data` as
        one micro-batch, loss -mean log p."""

        def loss_fn(out: dict[str, torch.Tensor], micro: dict) -> tuple[torch.Tensor, dict]:
            return -out["log_probs"].mean(), {}

        return lambda: self.engine.train_step([data], loss_fn)

    def generate(self, rows: int, length: int, new_tokens: int) -> Callable[[], None]:
        """One native-rollout generate call: `rows` prompts of `length` tokens, `new_tokens` each (the same call
        for the same arguments, so that its rollout's buffers, allocated on its first run, are reused)."""
        key = (rows, length, new_tokens)
        if key in self._generate_calls:
            return self._generate_calls[key]
        cfg = replace(self.rollout_config, response_length=new_tokens, prompt_length=length, max_batch_size=rows)
        rollout = build_rollout(cfg, self.rollout_model, self.tokenizer)
        data = self.batch(rows, length)
        prompts = DataProto.from_dict({k: data[k] for k in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)})
        self._generate_calls[key] = lambda: rollout.generate_sequences(prompts)
        return self._generate_calls[key]

    @property
    def rollout_model(self) -> torch.nn.Module:
        """The rollout's model (a plain module in the profile's dtype), loaded on first use and shared by every
        `generate` call."""
        if self._rollout_model is None:
            self._rollout_model = load_rollout_model(self.model_path, self.rollout_config.torch_dtype)
        return self._rollout_model
