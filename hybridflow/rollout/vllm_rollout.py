"""vllm rollout: an adapter over `vllm.LLM`, for machines with a GPU and vllm installed.

vllm is imported inside the class, so this module imports anywhere; building the
rollout without vllm or without a CUDA device raises a clear error. Caveats:
- `rollout_log_probs` are vllm's own per-token log-probs (its `logprobs_mode`; by
  default the raw model distribution at temperature 1), not `sampling.py`'s definition
  unless temperature is 1 and no filtering is on.
- `load_weights` writes the state dict to a temporary safetensors file and has every
  vllm worker load it through `collective_rpc` (tensors passed directly through the
  RPC do not arrive as tensors).
Not exercised on the CPU-only development machines; tests are marked `gpu`.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import Tensor

from hybridflow.keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
from hybridflow.protocol import DataProto
from hybridflow.rollout.base import Rollout, eos_token_ids, step_seed
from hybridflow.rollout.config import RolloutConfig, SamplingParams
from hybridflow.rollout.layout import build_output, pad_responses


def _load_weights_file(worker, path: str) -> None:
    """Run inside each vllm worker: load a safetensors state dict into its model."""
    from safetensors.torch import load_file

    worker.model_runner.model.load_weights(weights=load_file(path).items())


class VLLMRollout(Rollout):
    """Generation with vllm (see module docstring)."""

    def __init__(self, config: RolloutConfig, model_path: str | os.PathLike, tokenizer) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise RuntimeError("rollout.name='vllm' needs the vllm package (pip install 'hybridflow[vllm]' on "
                               "a CUDA machine); use rollout.name='native' on CPU") from exc
        if not torch.cuda.is_available():
            raise RuntimeError("rollout.name='vllm' needs a CUDA GPU; use rollout.name='native' on CPU")
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError("the vllm rollout loads its own model: pass a model directory, not a module")
        self.config, self.tokenizer, self._vllm = config, tokenizer, vllm
        self.eos_ids = eos_token_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self._seed: int | None = None
        self.llm = vllm.LLM(model=str(model_path), dtype={"bf16": "bfloat16", "fp32": "float32"}[config.dtype],
                            seed=config.seed, max_model_len=config.prompt_length + config.response_length)

    def reseed(self, step: int) -> None:
        """See `Rollout.reseed`: the following requests are seeded from (seed, step), one seed per prompt."""
        self._seed = step_seed(self.config.seed, step)

    def _sampling(self, params: SamplingParams, row: int):
        return self._vllm.SamplingParams(
            n=params.n, seed=None if self._seed is None else self._seed + row, temperature=params.temperature if params.do_sample else 0.0,
            top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=self.config.response_length, ignore_eos=self.config.ignore_eos,
            stop_token_ids=self.eos_ids, logprobs=0 if self.config.calculate_log_probs else None,
        )

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """See `Rollout.generate_sequences`."""
        params = self.config.sampling_params(prompts.meta_info)
        ids, mask = prompts.batch[INPUT_IDS], prompts.batch[ATTENTION_MASK]
        requests = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)]
        sampling = [self._sampling(params, i) for i in range(len(requests))]
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        samples = [s for out in outputs for s in out.outputs]
        width = self.config.response_length
        responses = torch.stack([pad_responses(torch.tensor([s.token_ids]), width, self.pad_id)[0] for s in samples])
        lengths = torch.tensor([len(s.token_ids) for s in samples])
        resp_mask = (torch.arange(width)[None] < lengths[:, None]).long()
        log_probs = torch.zeros(responses.shape) if self.config.calculate_log_probs else None
        if log_probs is not None:
            for i, s in enumerate(samples):
                log_probs[i, : len(s.token_ids)] = torch.tensor(
                    [lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids)])
        return build_output(prompts, ids, mask, prompts.batch[POSITION_IDS], responses, resp_mask, params.n, log_probs)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype vllm runs the model in (rollout.dtype)."""
        return self.config.torch_dtype

    def load_weights(self, state_dict: dict[str, Tensor], partial: bool = False) -> None:
        """Load a state dict into every vllm worker (through a temporary safetensors file).

        vllm's `load_weights` loads the tensors it is given, so `partial` needs nothing more
        (untested: RunConfig refuses LoRA, the only partial sender, with vllm for now)."""
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "weights.safetensors")
            save_file({k: v.detach().cpu().clone() for k, v in state_dict.items()}, path)  # clone: unties shared tensors
            self.llm.collective_rpc(_load_weights_file, args=(path,))
