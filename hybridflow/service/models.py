"""One base model, many training clients: each a peft LoRA adapter with its own AdamW state.

The base HF model is loaded once (fp32) and wrapped by peft on the first `create`; every later client is one
more named adapter on the same wrapper (`add_adapter`). A call activates its client's adapter
(`set_adapter`, which also leaves only that adapter trainable), so gradients from `forward_backward`
accumulate in that adapter alone until its `optim_step`. Freed clients drop their adapter.

LoRA targets follow Tinker's `lora_config`: train_attn -> q/k/v/o_proj, train_mlp -> gate/up/down_proj,
train_unembed -> lm_head, except on a model whose lm_head is tied to its embeddings (SmolLM2), where an
adapter on the head would train the embeddings too: there it is left out (docs/guides/tinker.md). The
adapters are scaled by alpha / rank with alpha = `LORA_ALPHA`.

The forward itself (shared prompts, the head only where needed) is service/forward.py's; a loss says which tokens
it differentiates (`TinkerLoss.grad_positions`).

Not thread-safe: the service runs every call from its one worker thread (`scheduler.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import peft
import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import Tensor

from hybridflow.algos.tinker_losses import TINKER_LOSSES, TinkerLoss
from hybridflow.engine.config import LoraConfig
from hybridflow.engine.lora import peft_config
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.service.errors import UserError
from hybridflow.service.forward import batch_parts, head_splits, target_logprobs
from hybridflow.service.wire import Datum, ForwardBackwardBody

LORA_ALPHA = 32.0
"""Adapter scaling numerator (updates are scaled by alpha / rank)."""
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROBE_TEXT = "The parity probe: a sampler holds the weights it was given, and 2 + 3 = 5."
"""Text whose log-probs the training forward and the sampler must agree on (sampler.py's parity check)."""


@dataclass
class AdapterSpec:
    """A client's adapter: what `create_model`'s lora_config asked for, as applied."""

    rank: int
    targets: list[str]
    seed: int | None = None

    @property
    def scaling(self) -> float:
        return LORA_ALPHA / self.rank


@dataclass
class TrainingModel:
    """One training client's state."""

    model_id: str
    session_id: str
    spec: AdapterSpec
    optimizer: torch.optim.AdamW
    steps: int = 0


class ModelRegistry:
    """The base model and every client's adapter (module docstring)."""

    def __init__(self, path: str | Path, name: str) -> None:
        self.path = Path(path)
        self.name = name
        """The base model's name in the API (what clients pass as base_model)."""
        self.tokenizer = load_tokenizer(self.path)
        self.base = load_causal_lm(self.path, dtype=torch.float32)
        self.config = self.base.config
        self.vocab_size = int(self.config.vocab_size)
        self.context_length = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.tied_head = bool(getattr(self.config, "tie_word_embeddings", False))
        self.base_weights: dict[str, Tensor] = {k: p.detach() for k, p in self.base.named_parameters()}
        """The base model's own tensors by HF name (shared with the peft wrapper, not copies)."""
        self.peft: peft.PeftModel | None = None
        self.models: dict[str, TrainingModel] = {}
        self.probe = np.asarray(self.tokenizer.encode(PROBE_TEXT), dtype=np.int64)
        """The parity probe's token ids."""
        self.split_head = head_splits(self.base)
        """Whether logits are `head(decoder(...))`, so the head can run on chosen tokens (module docstring)."""

    # ---- clients

    def targets(self, train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
        """The module names an adapter covers for Tinker's three switches (module docstring)."""
        names = [*(ATTN if train_attn else ()), *(MLP if train_mlp else ())]
        if train_unembed and not self.tied_head:
            names.append("lm_head")
        present = {n.rsplit(".", 1)[-1] for n, _ in self.base.named_modules()}
        names = [n for n in names if n in present]
        if not names:
            raise UserError(
                "lora_config selects no layer of this model (train_attn / train_mlp are off, and the head is "
                "tied to the embeddings); turn on train_attn or train_mlp"
            )
        return names

    def create(self, model_id: str, session_id: str, rank: int, targets: list[str], seed: int | None) -> TrainingModel:
        """A new client `model_id` with a fresh adapter (B = 0: it starts equal to the base)."""
        if model_id in self.models:
            raise UserError(f"model {model_id} exists already (model_seq_id reused within session {session_id})")
        if rank < 1:
            raise UserError(f"lora_config.rank must be >= 1, got {rank}")
        spec = AdapterSpec(rank, targets, seed)
        cfg = peft_config(LoraConfig(rank=rank, alpha=LORA_ALPHA, target_modules=targets))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if seed is None else seed)
            if self.peft is None:
                self.peft = peft.get_peft_model(self.base, cfg, adapter_name=model_id)
            else:
                self.peft.add_adapter(model_id, cfg)
        params = self._activate(model_id)
        model = TrainingModel(model_id, session_id, spec, torch.optim.AdamW(params, lr=1e-4))
        self.models[model_id] = model
        return model

    def get(self, model_id: str) -> TrainingModel:
        """The client `model_id`; an unknown id is a UserError naming it."""
        model = self.models.get(model_id)
        if model is None:
            raise UserError(f"unknown model_id {model_id!r}: create it with create_model (or it was freed)")
        return model

    def free(self, model_id: str) -> None:
        """Drop the client's adapter and optimizer (saved checkpoints stay)."""
        if self.models.pop(model_id, None) is not None and self.peft is not None:
            self.peft.delete_adapter(model_id)

    def _activate(self, model_id: str) -> list[torch.nn.Parameter]:
        """Make `model_id` the active adapter; returns its (now trainable) parameters."""
        assert self.peft is not None
        # PeftModel.set_adapter, not its base_model's: the wrapper keeps its own active adapter name, which its
        # forward reads, and which would still name the first client's adapter after that client was freed
        self.peft.set_adapter(model_id)
        return [p for n, p in self.peft.named_parameters() if f".{model_id}." in n and p.requires_grad]

    # ---- training

    def forward_backward(self, body: ForwardBackwardBody) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Run the loss over the batch, accumulate grads unless forward_only; per-datum outputs and metrics."""
        model = self.get(body.model_id)
        loss = self._loss(body)
        for i, d in enumerate(body.data):
            self._check_datum(d, i, body.loss_fn, loss.inputs)
        self._activate(model.model_id)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        for part in batch_parts(body.data):
            inputs = [_tensors(d) for d in part]
            with torch.set_grad_enabled(not body.forward_only):
                grads = None if body.forward_only else [loss.grad_positions(x) for x in inputs]
                logps = self._target_logprobs(part, grads)
                losses = [loss.fn(lp, x, body.loss_fn_config) for lp, x in zip(logps, inputs)]
                part_loss = torch.stack(losses).sum()
                if not body.forward_only and part_loss.requires_grad:
                    part_loss.backward()
            total += float(part_loss.detach())
            for lp, x in zip(logps, inputs):
                out = {"logprobs": lp.detach().numpy().astype(np.float32)}
                if body.loss_fn == "cross_entropy":
                    out["elementwise_loss"] = -(lp.detach() * x["weights"]).numpy().astype(np.float32)
                outputs.append(out)
        return outputs, {"loss:sum": total}

    def _loss(self, body: ForwardBackwardBody) -> TinkerLoss:
        if body.loss_fn not in TINKER_LOSSES:
            raise UserError(f"unknown loss_fn {body.loss_fn!r}; the service serves {sorted(TINKER_LOSSES.names())}")
        loss = TINKER_LOSSES.get(body.loss_fn)
        unknown = set(body.loss_fn_config) - set(loss.config_keys)
        if unknown:
            raise UserError(
                f"loss_fn_config keys {sorted(unknown)} are not read by {body.loss_fn!r} "
                f"(it takes {list(loss.config_keys) or 'none'})"
            )
        if not body.data:
            raise UserError("forward_backward got no datums")
        return loss

    def _check_datum(self, d: Datum, i: int, loss_fn: str, need: tuple[str, ...]) -> None:
        n = len(d.tokens)
        if n == 0:
            raise UserError(f"datum {i} has an empty model_input")
        if n > self.context_length:
            raise UserError(
                f"datum {i} is {n} tokens long, more than the model's context of {self.context_length}; "
                "truncate or split it"
            )
        missing = [k for k in need if k not in d.inputs]
        extra = sorted(set(d.inputs) - set(need))
        if missing or extra:
            raise UserError(
                f"datum {i}: loss_fn {loss_fn!r} takes loss_fn_inputs {list(need)}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unexpected {extra}" if extra else "")
            )
        for key, arr in d.inputs.items():
            if len(arr) != n:
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has {len(arr)} values for {n} input tokens")
        for key, arr in (("model_input", d.tokens), ("target_tokens", d.inputs["target_tokens"])):
            bad = (arr < 0) | (arr >= self.vocab_size)
            if bad.any():
                raise UserError(
                    f"datum {i}: {key} holds token id {int(arr[bad][0])}, outside the vocabulary [0, {self.vocab_size})"
                )

    def _target_logprobs(self, data: list[Datum], grads: list[Tensor] | None = None) -> list[Tensor]:
        assert self.peft is not None
        return target_logprobs(self.peft.get_base_model(), data, grads, self.split_head)

    @torch.no_grad()
    def probe_logprobs(self, model_id: str) -> np.ndarray:
        """The client's log-probs of each probe token given those before it (the training forward)."""
        self.get(model_id)
        self._activate(model_id)
        datum = Datum(self.probe[:-1], {"target_tokens": self.probe[1:]})
        return self._target_logprobs([datum])[0].numpy().astype(np.float32)

    def optim_step(self, model_id: str, lr: float, betas: tuple[float, float], eps: float, wd: float, clip: float):
        """One AdamW step of the client's adapter with these hyper-parameters; its grads are zeroed after."""
        model = self.get(model_id)
        params = self._activate(model_id)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        for group in model.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=wd)
        model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=True)
        model.steps += 1
        return {"grad_norm:mean": float(grad_norm)}

    # ---- adapter state

    def adapter_state(self, model_id: str) -> dict[str, Tensor]:
        """A copy of the client's adapter weights (peft names without the adapter name)."""
        self.get(model_id)
        assert self.peft is not None
        state = get_peft_model_state_dict(self.peft, adapter_name=model_id)
        return {k: v.detach().clone() for k, v in state.items()}

    def load_adapter_state(self, model_id: str, state: dict[str, Tensor]) -> None:
        """Overwrite the client's adapter with `state` (from `adapter_state` of a same-shaped adapter)."""
        self.get(model_id)
        assert self.peft is not None
        mine = get_peft_model_state_dict(self.peft, adapter_name=model_id)
        if set(mine) != set(state) or any(mine[k].shape != state[k].shape for k in mine):
            raise UserError(
                "the checkpoint's adapter does not fit this model's (different rank or layers); create the "
                "training client with the checkpoint's lora_config"
            )
        set_peft_model_state_dict(self.peft, state, adapter_name=model_id)

    def merged(self, state: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
        """W + scaling * B @ A under HF names, for each layer `state` (an adapter) covers."""
        out = {}
        for key, a in state.items():
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            b = state[key.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = self.base_weights[f"{module}.weight"] + scaling * (b.float() @ a.float())
        return out


def _tensors(d: Datum) -> dict[str, Tensor]:
    return {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in d.inputs.items() if k != "target_tokens"}
