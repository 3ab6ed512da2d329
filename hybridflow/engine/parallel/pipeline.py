"""Pipeline parallel in the training engine: micro-batches through torch.distributed.pipelining's schedules.

Each pp rank holds one stage (hybridflow/engine/parallel/pipeline_stage.py) and the same rows as the other stages of its
(dp, sp, tp) slot. A call (`Pipeline.infer`, `Pipeline.train`) runs ALL its micro-batches through one schedule:
`ScheduleGPipe` for forward-only passes, `Schedule1F1B` for training (GPipe when there are fewer micro-batches than
stages, which 1F1B refuses). Activations pass between neighbouring stages over the pp process group (gloo on CPU,
NCCL on GPU).

One activation shape per call: PipelineStage sends fixed-shape buffers, so every micro-batch of a call is cut to
the call's one response window (the columns where any of its rows has a token, `use_remove_padding`) and padded to
the call's largest micro-batch by repeating its first row, whose outputs are dropped. The stages are built per call
with that shape given up front (static metadata: no shape-probing forward). Shared-prompt packing is not used under
pp (its packed rows differ in length per micro-batch); packing is refused at load.

Outputs and loss. The last stage computes per-token outputs (`HeadSpec`), puts them back in the [b, R] layout and
calls the engine's `loss_fn(outputs, micro)` with the real rows: the loss is the one the engine computes without
pp, with the same global normalisation (the loss function owns it; `scale_grads=False`, nothing is rescaled here).
Log-probs, entropy, values and the step's metrics are then broadcast from the last stage to every stage of the
slot, so every rank returns what one process would.

Gradients. FSDP2 reduces each stage's gradients over its own dp x sp ranks once, after the last backward
(torch.distributed.pipelining drives FSDP2's post-backward). The tied embedding's two copies (first and last stage)
are summed across the pp group; the gradient norm is the global one (each stage's squared norm summed over the pp
group, the tied weight counted once), and clipping scales every stage by it, so the step equals one process's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

import hybridflow.engine.batch as B
from hybridflow.engine.base import LossFn, MicroBatch
from hybridflow.engine.parallel.pipeline_stage import HeadSpec, PipelineStageModule
from hybridflow.protocol import keys


class Pipeline:
    """Runs a `PipelineStageModule` (the engine's FSDP2 root) in schedules over the pp process group."""

    def __init__(
        self, module: PipelineStageModule, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.module, self.group, self.device, self.dtype = module, group, device, dtype
        # A collective over the pp group: every stage learns it here, while all of them construct the engine.
        self._tied_shape = self._tied_local_shape() if module.tied else None

    @property
    def last_rank(self) -> int:
        """Group rank of the last stage (stage i is pp group rank i)."""
        return self.module.stages - 1

    # --- forward-only -------------------------------------------------------------
    def infer(self, micros: list[MicroBatch], spec: HeadSpec, remove_padding: bool) -> dict[str, torch.Tensor]:
        """Per-token outputs [B, R] of every row of `micros` ("log_probs" (+ "entropy") or "values"), on every
        stage. Call under no_grad."""
        call = _Call(micros, remove_padding)
        spec = call.head_spec(spec)
        schedule = ScheduleGPipe(self._stage(call, spec, False), len(micros), scale_grads=False)
        merged = schedule.step(*call.args(self.module.is_first), **call.kwargs)
        names = self._names(spec)
        if self.module.is_last:
            parts = merged if isinstance(merged, tuple) else (merged,)
            out = {n: torch.cat(call.place_all(p)) for n, p in zip(names, parts)}
        else:
            shape = (sum(m[keys.INPUT_IDS].shape[0] for m in micros), call.win.response_len)
            out = {n: torch.zeros(shape, device=self.device) for n in names}
        for t in out.values():
            dist.broadcast(t, group=self.group, group_src=self.last_rank)
        return out

    # --- training -----------------------------------------------------------------
    def train(self, micros: list[MicroBatch], spec: HeadSpec, loss_fn: LossFn, remove_padding: bool) -> dict:
        """Forward + backward of every micro-batch (gradients accumulate in the stage's parameters); returns
        {"loss": sum of the micro-batch losses, "stats": {name: [one value per micro-batch]}} on every stage."""
        call = _Call(micros, remove_padding)
        spec = call.head_spec(spec)
        names, stats, losses = self._names(spec), defaultdict(list), []

        def pipe_loss(output: torch.Tensor | tuple, index: torch.Tensor) -> torch.Tensor:
            i = int(index)
            parts = output if isinstance(output, tuple) else (output,)
            outputs = {n: call.place(i, p) for n, p in zip(names, parts)}
            loss, micro_stats = loss_fn(outputs, micros[i])
            for k, v in micro_stats.items():
                stats[k].append(float(v))
            return loss

        n = len(micros)
        kind = Schedule1F1B if n >= self.module.stages else ScheduleGPipe
        schedule = kind(self._stage(call, spec, True), n, loss_fn=pipe_loss, scale_grads=False)
        target = torch.arange(n, device=self.device)  # one index per micro-batch: the loss finds its rows by it
        schedule.step(*call.args(self.module.is_first), target=target, losses=losses, **call.kwargs)
        result = [{"loss": float(sum(float(x.detach()) for x in losses)), "stats": dict(stats)}]
        dist.broadcast_object_list(result, group=self.group, group_src=self.last_rank)
        return result[0]

    def clip_grads(self, params: list[torch.nn.Parameter], clip: float) -> float:
        """Sum the tied weight's gradient, then scale every stage's gradients by the global norm to at most `clip`
        (clip <= 0: not at all); returns the global norm before clipping."""
        self.sync_tied_grad()
        norm = float(self.global_grad_norm(params))
        if clip > 0:
            coef = min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
            for p in params:
                p.grad.mul_(coef)
        return norm

    def sync_tied_grad(self) -> None:
        """Sum the tied embedding / LM head gradient of the first and last stage (the middle stages add zeros)."""
        if not self.module.tied:
            return
        weight = self.module.tied_weight()
        if weight is not None and weight.grad is not None:
            grad = _local(weight.grad)
        else:
            grad = torch.zeros(self._tied_shape, device=self.device)
        dist.all_reduce(grad, group=self.group)

    def _tied_local_shape(self) -> torch.Size:
        """The tied weight's local shard shape, as the first stage holds it (a middle stage has no copy)."""
        shape = [torch.Size()]
        if self.module.is_first:
            shape[0] = _local(self.module.tied_weight()).shape
        dist.broadcast_object_list(shape, group=self.group, group_src=0)
        return shape[0]

    def global_grad_norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The gradient norm of the whole model: this stage's squared norm summed over the pp group, the tied
        weight counted on the first stage only."""
        skip = self.module.tied_weight() if self.module.tied and self.module.is_last else None
        grads = [p.grad for p in params if p.grad is not None and p is not skip]
        norm = torch.nn.utils.get_total_norm(grads, foreach=False) if grads else torch.zeros((), device=self.device)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.detach().float().pow(2).reshape(1)
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()[0]

    # --- stages -------------------------------------------------------------------
    def _stage(self, call: _Call, spec: HeadSpec, backward: bool) -> PipelineStage:
        self.module.spec = spec
        rows, width = call.rows, call.win.end - call.win.start
        hidden = torch.empty(rows, width, self.module.config.hidden_size, dtype=self.dtype, device="meta")
        hidden.requires_grad_(backward)  # the stages exchange gradients of the activations they pass
        ids = torch.empty(rows, width, dtype=torch.long, device="meta")
        out = torch.empty(rows, spec.n_valid, dtype=torch.float32, device="meta")
        outputs = (out,) * len(self._names(spec)) if self.module.is_last else hidden
        inputs = ids if self.module.is_first else hidden
        stage = PipelineStage(
            self.module,
            self.module.stage,
            self.module.stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )
        return stage

    def _names(self, spec: HeadSpec) -> tuple[str, ...]:
        if self.module.is_value:
            return ("values",)
        return ("log_probs", "entropy") if spec.calc_entropy else ("log_probs",)


class _Call:
    """The micro-batches of one call cut to one response window and padded to one number of rows."""

    def __init__(self, micros: list[MicroBatch], remove_padding: bool) -> None:
        if not micros:
            raise ValueError("a pipeline call needs at least one micro-batch")
        self.micros = micros
        whole = {k: torch.cat([m[k] for m in micros]) for k in (keys.ATTENTION_MASK, keys.RESPONSES)}
        self.win = B.response_window(whole, remove_padding)
        self.rows = max(m[keys.INPUT_IDS].shape[0] for m in micros)
        padded = [self._padded(m) for m in micros]
        self.stacked = {k: torch.cat([p[k] for p in padded]) for k in padded[0]}
        self.kwargs = {k: self.stacked[k] for k in ("attention_mask", "position_ids", "labels")}

    def head_spec(self, spec: HeadSpec) -> HeadSpec:
        """`spec` with this call's response window: the columns predicted and where a value model's values start."""
        return replace(spec, n_valid=self.win.n_valid, value_first=self.win.prompt_len - 1 - self.win.start)

    def args(self, first: bool) -> tuple[torch.Tensor, ...]:
        """Positional inputs of the schedule: the token ids on the first stage, nothing elsewhere."""
        return (self.stacked["input_ids"],) if first else ()

    def _padded(self, micro: MicroBatch) -> dict[str, torch.Tensor]:
        inputs = B.trim(B.select_inputs(micro, micro[keys.INPUT_IDS].device), self.win)
        inputs["labels"] = micro[keys.RESPONSES][:, : self.win.n_valid]
        missing = self.rows - micro[keys.INPUT_IDS].shape[0]
        return {k: torch.cat([v, v[:1].expand(missing, *v.shape[1:])]) for k, v in inputs.items()}

    def place(self, i: int, values: torch.Tensor) -> torch.Tensor:
        """Micro-batch `i`'s rows of `values` [rows, n_valid] in the [b, R] layout (zero off the response mask)."""
        micro = self.micros[i]
        b = micro[keys.INPUT_IDS].shape[0]
        return B.pad_to_response(values[:b], self.win, B.response_mask_of(micro))

    def place_all(self, merged: torch.Tensor) -> list[torch.Tensor]:
        """`place` of every micro-batch's block of the schedule's merged output."""
        return [self.place(i, block) for i, block in enumerate(merged.split(self.rows))]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def gather_stages(named: Mapping[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Every stage's full named tensors, merged (the stages hold disjoint names), on every rank of the pp group."""
    parts: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, dict(named), group=group)
    return {k: v for part in parts for k, v in part.items()}
