"""One pipeline stage of a Llama/Qwen2-style model: its slice of the decoder layers, as an `nn.Module`.

`split_stage(model, stage, stages)` keeps, in place, what stage `stage` of `stages` runs: decoder layers
[stage L/stages, (stage+1) L/stages), the token embedding on the first stage, the final norm and the LM head
(or a value model's head) on the last; everything else is dropped. The layers stay under their global HF names
(`model.layers.12....` on the stage that holds layer 12: the layer list becomes a dict keyed by the global
index, as torchtitan does), so every stage's state dict is a disjoint part of the one-process model's.

Tied embeddings (SmolLM2: `lm_head.weight` is `model.embed_tokens.weight`): the first stage keeps the
embedding, the last the head, each its own copy of the one weight; the engine sums their gradients across
the two stages before each step (Megatron's shared-embedding all-reduce), so the copies see the same update and
stay equal.

`PipelineStageModule.forward` is what `torch.distributed.pipelining.PipelineStage` runs per micro-batch: the
first stage takes token ids, every other stage the previous stage's hidden states; the attention mask and
position ids come as keyword arguments on every stage (each pp rank holds its dp group's rows), and the causal
mask and rotary embeddings are built on each stage from them, as the HF model's own forward builds them once. The
last stage returns per-token outputs of the response window (`HeadSpec`), not logits: log-probs (and entropy) of
the labels, or values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from hybridflow.algos.logits import entropy_from_logits, logprobs_from_logits
from hybridflow.models.value import ValueModel, value_head


def check_pp_layout(pp: int, num_layers: int, key: str = "engine.pipeline_model_parallel_size") -> None:
    """Refuse a stage count that does not split the decoder layers evenly (`key`: the config key in the message)."""
    if pp < 1:
        raise ValueError(f"{key} must be >= 1, got {pp}")
    if num_layers % pp:
        raise ValueError(
            f"{key}={pp} must divide num_hidden_layers ({num_layers}): every stage holds the same number of "
            f"decoder layers"
        )


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """Global indices of the decoder layers stage `stage` of `stages` holds."""
    check_pp_layout(stages, num_layers)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside the {stages} pipeline stages")
    per = num_layers // stages
    return range(stage * per, (stage + 1) * per)


@dataclass
class HeadSpec:
    """What the last stage computes from its hidden states in one call (all micro-batches share it)."""

    n_valid: int
    """Response columns predicted (the call's response window)."""
    value_first: int = 0
    """Value model: the column whose value is the first response token's."""
    temperature: float = 1.0
    """Logits are divided by it before log-probs / entropy."""
    calc_entropy: bool = False
    """Also return the entropy of each prediction."""
    chunk: int = 1024
    """Rows per chunk of the fp32 log-softmax (EngineConfig.logits_chunk_size)."""


@dataclass
class _Parts:
    """References to the HF submodules a stage runs (a plain holder, so nothing is registered twice)."""

    hf: nn.Module
    base: nn.Module
    embed: nn.Module | None
    layers: list[tuple[int, nn.Module]]
    norm: nn.Module | None
    head: nn.Module | None


class PipelineStageModule(nn.Module):
    """A stage of a causal LM or `ValueModel`, under the full model's parameter names; see the module docstring."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        self.stage, self.stages = stage, stages
        self.is_value = isinstance(model, ValueModel)
        self.config = model.config
        self.tied = stages > 1 and _tied(model)  # before the split drops one of the two
        self.parts = _split(model, stage, stages)
        for name, child in model.named_children():
            self.add_module(name, child)
        self.spec: HeadSpec | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def tied_weight(self) -> nn.Parameter | None:
        """The local copy of the tied embedding / LM head weight on the first and last stage, else None."""
        if not self.tied:
            return None
        module = self.parts.embed if self.is_first else self.parts.head if self.is_last else None
        return None if module is None else module.weight

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Token ids [b, W] (first stage) or hidden states [b, W, H] -> hidden states, or on the last stage the
        head's outputs for the response window (`HeadSpec`)."""
        p = self.parts
        h = p.embed(x) if p.embed is not None else x
        masks = self._masks(h, attention_mask, position_ids)
        rotary = p.base.rotary_emb(h, position_ids=position_ids)
        types = getattr(self.config, "layer_types", None)
        for i, layer in p.layers:
            mask = masks[types[i]] if types else masks["full_attention"]
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids, use_cache=False)
        if p.head is None:
            return h
        return self._head(p.norm(h), labels)

    def _masks(self, h: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> dict:
        kw = dict(
            config=self.config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        masks = {"full_attention": create_causal_mask(**kw)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        return masks

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        s = self.spec
        if s is None:
            raise RuntimeError("the last pipeline stage needs a HeadSpec before it runs")
        if self.is_value:
            values = self.parts.head(h).squeeze(-1).float()
            return (values[:, s.value_first : s.value_first + s.n_valid].clone(),)
        logits = self.parts.head(h[:, -(s.n_valid + 1) :])[:, :-1]
        if s.temperature != 1.0:
            logits = logits.float() / s.temperature
        out = [logprobs_from_logits(logits, labels, s.chunk)]
        if s.calc_entropy:
            out.append(entropy_from_logits(logits, s.chunk))
        # Fresh tensors, not reshaped views: FSDP2 warns that in-place ops on a view skip its backward hooks.
        return tuple(t.clone() for t in out)


def split_stage(model: nn.Module, stage: int, stages: int) -> PipelineStageModule:
    """`model` (a causal LM or `ValueModel`) cut down in place to stage `stage` of `stages`, wrapped to run it."""
    return PipelineStageModule(model, stage, stages)


def _hf(model: nn.Module) -> nn.Module:
    return model.backbone if isinstance(model, ValueModel) else model


def _head_name(model: nn.Module) -> str:
    return value_head(model.backbone)[0] if isinstance(model, ValueModel) else "lm_head"


def _tied(model: nn.Module) -> bool:
    hf = _hf(model)
    head = getattr(hf, _head_name(model))
    return head.weight is hf.base_model.embed_tokens.weight


def _split(model: nn.Module, stage: int, stages: int) -> _Parts:
    """Drop from `model` what stage `stage` does not run; return what it does."""
    hf = _hf(model)
    base, head_name = hf.base_model, _head_name(model)
    own = stage_layers(len(base.layers), stage, stages)
    layers = [(i, base.layers[i]) for i in own]
    base.layers = nn.ModuleDict({str(i): layer for i, layer in layers})
    first, last = stage == 0, stage == stages - 1
    embed, norm, head = base.embed_tokens, base.norm, getattr(hf, head_name)
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = None
        setattr(hf, head_name, None)
    return _Parts(hf, base, embed if first else None, layers, norm if last else None, head if last else None)
