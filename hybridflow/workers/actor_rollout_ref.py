"""`ActorRolloutRefWorker`: the policy in all its roles, one class over the `Engine` interface.

`role` is any "_"-joined combination of actor, rollout and ref. In the hybrid
engine ("actor_rollout" / "actor_rollout_ref", the default) one process holds the
FSDP-sharded training policy, a rollout copy in the rollout dtype and, when KL is
used, the frozen reference policy; after every actor update the rollout copy is
refreshed before the next generation (hybridflow/rollout/sync.py): from the gathered
weights, or, with rollout.tensor_model_parallel_size > 1, by resharding the training
shards to the rollout's generation shard (hybridflow/engine/reshard.py). With
trainer.mode one_step_off / async the roles are split over two groups ("actor[_ref]"
and "rollout"), and the weights cross from one to the other over a process group
spanning both (transfer_weights, hybridflow/rollout/bridge.py).

With LoRA (actor.lora.rank > 0) a worker hosting both actor and ref builds no second
model: the reference policy is the actor with its adapters disabled (the frozen base,
computed in the actor's engine.param_dtype). The rollout generates from the merged
weights; after the first sync only the adapted layers' merged weights are sent.

Every method receives THIS worker's data-parallel shard and returns a DataProto whose
tensors are laid out as in hybridflow/protocol/keys.py, with worker-side metrics under
meta_info["metrics"]. The worker declares two meshes for the N-D dispatch
(hybridflow/controller/dispatch.py): "rollout", dp x tp by rollout.tensor_model_parallel_size,
and "policy", dp x tp x sp by actor.engine.tensor_parallel_size and ulysses_sequence_parallel_size,
which the actor and the reference share: the tp/sp ranks of a dp group receive the same rows and
only the group's first rank's output is collected. With tp = sp = 1 both meshes are the plain
DP_COMPUTE_PROTO split. The ranks of a rollout tp group sample with the same seed (they must draw
the same tokens). A rollout tp group is consecutive ranks, except beside a plain FSDP-sharded actor,
where its ranks are spaced so that each rank's training rows lie in its generation shard
(`aligned_stride`, engine/reshard.py).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridflow.agent.loop.runner import GenerateFn
from hybridflow.algos.core import masked_mean
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from hybridflow.controller.worker import Worker, collective_timeout_s
from hybridflow.endpoint.harness import HarnessRunner
from hybridflow.engine import export_hf
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.parallel.dims import GenerationDims, ParallelDims, aligned_stride
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.parity.weights import SyncSite, WeightCheck, bridge_expected, prints_once
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout import build_rollout
from hybridflow.rollout.bridge import WeightBridge, announced, manifest_of, open_store, store_client
from hybridflow.rollout.config import RolloutConfig, SamplingParams
from hybridflow.rollout.multi_turn import generate_multi_turn
from hybridflow.rollout.partial import PushWatch, fill_versions, generate_turnwise, resumable, versioned
from hybridflow.rollout.sync import BEFORE_LOAD, LOADED, SKIP_LOAD, share_engine_weights, sync_weights
from hybridflow.utils.device import device_kind
from hybridflow.utils.hooks import HookPoint
from hybridflow.utils.memory import release_freed_memory
from hybridflow.utils.peak_memory import operator_peak
from hybridflow.utils.plugins import import_plugins
from hybridflow.workers.config import ActorConfig, DistillationConfig, ModelConfig, RefConfig
from hybridflow.workers.engines import build_engine, declare_engine_mesh
from hybridflow.workers.losses import actor_loss_builder
from hybridflow.workers.ppo_update import run_ppo_update

ROLES = ("actor", "rollout", "ref")
GENERATED = HookPoint(
    "rollout.generated",
    "a generate call's output, before it is returned: (out: DataProto, step), step None outside training; "
    "the hook may change `out` in place",
)
POLICY_MESH, ROLLOUT_MESH = "policy", "rollout"
"""Names of the meshes this worker declares for the N-D dispatch."""
_ON_POLICY_MESH = make_nd_compute_dataproto_dispatch_fn(POLICY_MESH)
_ON_ROLLOUT_MESH = make_nd_compute_dataproto_dispatch_fn(ROLLOUT_MESH)


class ActorRolloutRefWorker(Worker):
    """The policy: generates (rollout), scores its own tokens (actor / ref) and trains (actor)."""

    def __init__(
        self,
        model: ModelConfig,
        actor: ActorConfig,
        rollout: RolloutConfig,
        ref: RefConfig,
        role: str,
        plugins: Sequence[str] = (),
    ) -> None:
        """`plugins`: the run's trainer.plugins, imported here first (in the worker process)."""
        super().__init__()
        import_plugins(plugins)
        self.roles = set(role.split("_"))
        if not self.roles or not self.roles <= set(ROLES):
            raise ValueError(f"ActorRolloutRefWorker role={role!r}: expected a '_'-joined combination of {ROLES}")
        self.model_cfg, self.actor_cfg, self.rollout_cfg, self.ref_cfg = model, actor, rollout, ref
        self.actor = self.ref = self.rollout = None
        self._harness: HarnessRunner | None = None
        self._rollout_stale = False
        self._parity_pending: list[str] = []  # weight-sync findings of a validation call, for the next training batch
        self._rollout_has_all_weights = False
        self._update_calls = 0
        self._pushed_version = 0  # a rollout-only worker's: the step of the weights it received last (0: initial)
        self._inline_pushes: dict[int, dict[str, Any]] = {}  # pushes a partial generation took: step -> its report
        self._watch_store: Any = None  # its own client of the bridge's store, for PushWatch (rollout/partial.py)
        self._bridge: WeightBridge | None = None
        self._bridge_address: tuple[str, int] | None = None
        # The reference runs on the actor's layout: both are dispatched over the policy mesh.
        self.dp_size = declare_engine_mesh(self, POLICY_MESH, actor.engine, "actor.engine.")
        self.rollout_tp_size = rollout.tensor_model_parallel_size
        GenerationDims(self.world_size, self.rollout_tp_size)  # refuses a tp that does not divide the ranks
        self.rollout_stride = self._rollout_stride()
        generation = GenerationDims(self.world_size, self.rollout_tp_size, self.rollout_stride)
        self.rollout_dp_rank, tp_index = generation.coords(self.rank)
        self._register_dispatch_collect_info(ROLLOUT_MESH, self.rollout_dp_rank, tp_index == 0)

    def _rollout_stride(self) -> int:
        """How far apart the ranks of a rollout tp group are: with a plain FSDP actor in the same processes, the
        stride that makes each rank's training rows part of its generation shard (engine/reshard.py)."""
        engine = self.actor_cfg.engine
        if (
            "actor" not in self.roles
            or "rollout" not in self.roles
            or self.rollout_tp_size == 1
            or engine.ranks_per_dp_group > 1
        ):
            return 1
        dims = ParallelDims.from_config(engine, self.world_size, device_kind(), "actor.engine.")
        return aligned_stride(dims.dp_shard, self.rollout_tp_size)

    # --- setup ----------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Form the process group and load the engines this worker's roles need."""

        self.init_process_group()
        path = resolve_model_path(self.model_cfg.path)
        self.tokenizer = load_tokenizer(self.model_cfg.tokenizer_path or path)
        if "actor" in self.roles:
            self.actor = build_engine(path, self.actor_cfg.engine, self.actor_cfg.optim, lora=self.actor_cfg.lora)
        if "ref" in self.roles and not self._ref_is_actor_base():
            engine = self.actor_cfg.engine
            self.ref = build_engine(
                path,
                EngineConfig(
                    param_dtype=self.ref_cfg.param_dtype,
                    tensor_parallel_size=engine.tensor_parallel_size,
                    ulysses_sequence_parallel_size=engine.ulysses_sequence_parallel_size,
                    pipeline_model_parallel_size=engine.pipeline_model_parallel_size,
                    backend=engine.backend,  # the reference runs on the actor's engine backend
                ),
            )
        if "rollout" in self.roles:
            cfg = self.rollout_cfg
            seed = cfg.seed + self.rollout_dp_rank
            self.rollout = build_rollout(replace(cfg, seed=seed), path, self.tokenizer, self.rollout_stride)
            if self.actor is not None and share_engine_weights(self.rollout, self.actor):
                release_freed_memory()  # the rollout's own copy, dropped before the first update allocates

    # --- rollout ----------------------------------------------------------------
    @register(dispatch_mode=_ON_ROLLOUT_MESH)
    def generate_sequences(
        self,
        prompts: DataProto,
        *,
        step: int | None = None,
        sampling: SamplingParams | None = None,
        validate: bool = False,
        partial: bool = False,
    ) -> DataProto:
        """Prompts [b, P] (left-padded) -> b * n rows of prompts, responses, masks, rollout_log_probs
        (rollout.multi_turn.enable: agent-loop trajectories, see hybridflow/rollout/multi_turn.py; rollout.agent:
        harness trajectories, see hybridflow/endpoint/harness.py).

        `step`: the training step; the sampler reseeds from it first (None: no reseed, the sampler goes on
        from its state, as validation does). `sampling`: this call's params; None: the configured ones,
        rollout.val_kwargs when `validate`, else the training ones (giving both is refused). `partial`
        (trainer.partial_rollout, a rollout-only worker's training call, with `step`): weight pushes announced during
        the generation are taken in its middle, the rows going on under the new weights (hybridflow/rollout/partial.py;
        single-turn rows are then generated turn-wise). Multi-turn, harness and partial rows carry each model token's
        policy version (keys.TOKEN_POLICY_VERSION): the step of the weights that sampled it.
        """

        if sampling is not None and validate:
            raise ValueError("generate_sequences: pass sampling or validate=True, not both")
        if partial and step is None:
            raise ValueError("generate_sequences: partial=True is for training calls, which pass their step")
        metrics: dict[str, float] = {}
        findings = self._sync_rollout(step, metrics) if self._rollout_stale and self.actor is not None else []
        # the guard reads training batches only: a sync's findings wait for the next one (validation may sync first)
        findings, self._parity_pending = (self._parity_pending + findings, []) if step is not None else ([], findings)
        if step is not None:
            # Seeded by (seed, step, rank) rather than by call count, so a resumed run samples exactly as an uninterrupted one.
            self.rollout.reseed(step)
        start = time.perf_counter()
        with operator_peak("generate", metrics):
            params = sampling or self.rollout_cfg.sampling_params(validate)
            if self.rollout_cfg.multi_turn.enable:  # one agent-loop trajectory per sample (rollout/multi_turn.py)
                wrap = self._turn_wrap(step, partial) if step is not None else None
                with self._push_watch() if partial else contextlib.nullcontext():
                    out = generate_multi_turn(self.rollout, prompts, params, self.rollout_cfg, wrap, partial)
            elif partial:  # single-turn rows through the turn generator, so that they can take a push mid-way
                with self._push_watch():
                    out = generate_turnwise(self.rollout, prompts, params, self._turn_wrap(step, partial))
            elif self.rollout_cfg.agent.enable:  # one harness call per sample (endpoint/harness.py)
                out, server_metrics = self._harness_runner().generate(prompts, params)
                if step is not None:
                    fill_versions(out, self._held_version(step))
                metrics.update(server_metrics)
            else:
                out = self.rollout.generate_sequences(prompts, params)
        if partial:  # the pushes this generation took: their findings travel with the rows their weights sampled
            findings += [line for report in self._inline_pushes.values() for line in report.pop(K.META_PARITY, [])]
        GENERATED(out=out, step=step)
        metrics["timing_s/generate_on_worker"] = time.perf_counter() - start
        out.meta_info[K.META_METRICS] = {**out.meta_info.get(K.META_METRICS, {}), **metrics}  # + agent/* times
        if findings:
            out.meta_info[K.META_PARITY] = out.meta_info.get(K.META_PARITY, []) + findings
        return out

    def _held_version(self, step: int) -> int:
        """The policy version the rollout generates step `step` with: a rollout-only worker's, the last push it
        received; beside the actor, the weights after step `step` - 1's update (synced before generating)."""
        return self._pushed_version if "actor" not in self.roles else max(step - 1, 0)

    def _turn_wrap(self, step: int, partial: bool) -> Callable[[GenerateFn], GenerateFn]:
        """The agent loop's generate, each turn stamped with its version; with `partial`, taking pushes mid-way."""
        if not partial:
            return lambda generate: versioned(generate, lambda: self._held_version(step))
        self._check_partial()
        return lambda generate: resumable(
            generate, self.rollout.eos_ids, self.rollout.interrupted, self._take_push, lambda: self._pushed_version
        )

    def _check_partial(self) -> None:
        if "actor" in self.roles or self._bridge is None:
            raise RuntimeError(
                "generate_sequences(partial=True) is for the rollout workers of trainer.mode one_step_off / async, "
                "after join_weight_bridge"
            )

    def _push_watch(self) -> PushWatch:
        """A watch for pushes announced in the bridge's store while this generation runs (rollout/partial.py)."""
        self._check_partial()
        if self._watch_store is None:
            self._watch_store = store_client(*self._bridge_address, collective_timeout_s())
        store = self._watch_store
        return PushWatch(lambda: announced(store), lambda: self._pushed_version, self.rollout.interrupted)

    def _take_push(self) -> bool:
        """Receive and load the weights of a push announced since the last one taken (partial rollout); its report
        waits for the transfer_weights call of that push, its findings go out with this generation's rows."""
        step = self._bridge.announced()
        taken = step is not None and step > self._pushed_version
        if taken:
            self._inline_pushes[step] = self._receive_weights(time.perf_counter(), step)
        self.rollout.interrupted.clear()
        return taken

    def _sync_rollout(self, step: int | None, metrics: dict[str, float]) -> list[str]:
        """Refresh the rollout copy from the actor (rollout/sync.py); returns the weight-sync parity findings."""
        cfg = self.rollout_cfg
        report = sync_weights(
            self.rollout, self.actor, self._rollout_has_all_weights, step, cfg.weight_fingerprints, cfg.name
        )
        self._rollout_stale = False
        self._rollout_has_all_weights = True
        metrics["timing_s/weight_sync"] = report.seconds
        if cfg.weight_fingerprints:
            metrics["timing_s/parity_weights"] = report.check_seconds
        return report.findings

    def _harness_runner(self) -> HarnessRunner:
        """The harness's endpoint over this worker's rollout, started on first use; it stops when the worker
        object is dropped (the local backend's shutdown) or its process exits (Ray kills the actor)."""
        if self._harness is None:
            self._harness = HarnessRunner(self.rollout, self.rollout_cfg.agent, self.rollout_cfg.response_length)
            weakref.finalize(self, self._harness.close)
        return self._harness

    # --- log-probs ----------------------------------------------------------------
    @register(dispatch_mode=_ON_POLICY_MESH)
    def compute_log_prob(self, data: DataProto, *, temperature: float) -> DataProto:
        """Rows with input_ids/attention_mask/position_ids/responses -> old_log_probs [b, R], entropys [b, R],
        from logits divided by `temperature` (the rollout's sampling temperature)."""
        metrics: dict[str, float] = {}
        with operator_peak("old_log_prob", metrics):
            log_probs, entropy = self.actor.compute_log_probs(
                data.batch, self.actor_cfg.log_prob_micro(), temperature, calc_entropy=True
            )
        mask = data.batch[K.RESPONSE_MASK]
        metrics["actor/entropy"] = float(masked_mean(entropy, mask))
        return DataProto.from_dict(
            {K.OLD_LOG_PROBS: log_probs, K.ENTROPYS: entropy}, meta_info={K.META_METRICS: metrics}
        )

    @register(dispatch_mode=_ON_POLICY_MESH, blocking=False)
    def compute_ref_log_prob(self, data: DataProto, *, temperature: float) -> DataProto:
        """Rows as for compute_log_prob -> ref_log_prob [b, R] from the frozen reference policy, at `temperature`.

        Non-blocking (returns a future) so that with split placement it overlaps the actor.
        """
        if "ref" not in self.roles:
            raise RuntimeError(f"compute_ref_log_prob: this worker's role is {sorted(self.roles)}, which has no ref")
        engine = self.ref if self.ref is not None else self.actor
        metrics: dict[str, float] = {}
        with (
            operator_peak("ref_log_prob", metrics),
            self.actor.adapters_disabled() if self.ref is None else contextlib.nullcontext(),
        ):
            log_probs, _ = engine.compute_log_probs(data.batch, self.ref_cfg.log_prob_micro(), temperature)
        return DataProto.from_dict({K.REF_LOG_PROB: log_probs}, meta_info={K.META_METRICS: metrics})

    def _ref_is_actor_base(self) -> bool:
        """Whether the reference policy is this worker's actor with its adapters disabled (LoRA)."""
        return self.actor is not None and self.actor.has_adapters

    # --- training ----------------------------------------------------------------
    @register(dispatch_mode=_ON_POLICY_MESH)
    def update_actor(
        self,
        data: DataProto,
        *,
        temperature: float,
        own_old_log_prob: bool,
        parity_ratio: float | None = None,
        distillation: DistillationConfig | None = None,
    ) -> DataProto:
        """PPO epochs over mini-batches over micro-batches, log-probs at `temperature`; rows need advantages
        (+ ref_log_prob) and old_log_probs. With `own_old_log_prob` (the trainer's step plan, see
        ActorConfig.old_log_prob) the update must be one optimizer step, and takes the old log-probs
        from its own forward instead. `parity_ratio` (not None) asks for the log-prob parity numbers of the
        forward on the weights that generated (that one step, or with actor.old_log_prob=rollout the first
        optimizer step) against rows' rollout_log_probs (`actor/parity_*`, workers/losses.py). `distillation` (with
        signal=loss; rows need teacher_log_probs) adds its reverse-KL loss term (`actor/distillation_loss`).

        Returns no rows, only meta_info["metrics"] (lists with one value per optimizer step).
        """
        cfg = self.actor_cfg
        mini_rows = max(cfg.ppo_mini_batch_size * self.rollout_cfg.n // self.dp_size, 1)
        own = own_old_log_prob
        _check_old_log_probs(data, own, cfg.ppo_epochs, mini_rows)
        start, peak = time.perf_counter(), {}
        with operator_peak("update_actor", peak):
            step_metrics = run_ppo_update(
                self.actor,
                data,
                mini_rows,
                cfg.update_micro(),
                cfg.ppo_epochs,
                actor_loss_builder(cfg, own, parity_ratio, distillation),
                shuffle=cfg.shuffle,
                seed=self._update_calls,
                temperature=temperature,
                calc_entropy=cfg.entropy_coeff != 0 or own or cfg.old_log_prob == "rollout",  # actor/entropy
            )
        self._update_calls += 1
        lr = self.actor.lr_scheduler_step()
        self._rollout_stale = True
        metrics = {f"actor/{k}": v for k, v in step_metrics.items() if k != "lr"}
        metrics.update({"actor/lr": lr, "timing_s/update_actor_on_worker": time.perf_counter() - start, **peak})
        return DataProto(meta_info={K.META_METRICS: metrics})

    # --- weight transfer to a rollout on other workers (trainer.mode one_step_off / async) -------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open_weight_bridge(self, host: str | None, world: int) -> tuple[str, int, list] | None:
        """Actor ranks: gather the weights once to describe them (a collective); rank 0 also opens the
        bridge's rendezvous store for `world` bridge ranks on `host` (None: this node's address). Returns
        (host, port, manifest) on rank 0, None on the others (hybridflow/rollout/bridge.py)."""

        state = self.actor.full_state_dict(dtype=self.rollout_cfg.torch_dtype)
        if self.rank != 0:
            return None
        if host is None:
            import ray  # noqa: PLC0415  (lazy: the local backend runs without Ray)

            host = ray.util.get_node_ip_address()
        self._bridge_store, port = open_store(host, world, collective_timeout_s())
        return host, port, manifest_of(state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_bridge(self, host: str, port: int, world: int, manifest: list | None = None) -> None:
        """Join the bridge group: actor rank 0 as bridge rank 0, rollout rank r as 1 + r (other actor ranks
        take no part). Blocks until every bridge rank joined: issue both pools' calls before waiting."""

        if "actor" not in self.roles:
            self._bridge_address = (host, port)
            self._bridge = WeightBridge(host, port, 1 + self.rank, world, collective_timeout_s())
            self._bridge_manifest = manifest
        elif self.rank == 0:
            self._bridge = WeightBridge(host, port, 0, world, collective_timeout_s(), store=self._bridge_store)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def transfer_weights(self, step: int | None = None) -> dict[str, Any]:
        """Actor ranks: gather the current weights in the rollout dtype (a collective), rank 0 broadcasts them
        (and, with rollout.weight_fingerprints, their fingerprints) over the bridge; rollout ranks receive, load
        and check them. `step`: the update pushed. Returns this rank's seconds (the sender: and bytes sent; the
        receivers: their weight-sync parity findings under keys.META_PARITY)."""
        start = time.perf_counter()
        if "actor" not in self.roles:
            if step in self._inline_pushes:  # a partial generation took it already (rollout/partial.py)
                return self._inline_pushes.pop(step)
            return self._receive_weights(start, step)
        if self.rank == 0 and step is not None:  # a partial generation on the rollout workers takes it mid-way
            self._bridge.announce(step)
        state = self.actor.full_state_dict(dtype=self.rollout_cfg.torch_dtype)
        if self.rank != 0:
            return {"timing_s/weight_transfer": time.perf_counter() - start, "weight_transfer/bytes": 0.0}
        check_start = time.perf_counter()
        prints = list(prints_once(state).values()) if self.rollout_cfg.weight_fingerprints else None
        check_s = time.perf_counter() - check_start
        sent = self._bridge.send(state)
        if prints is not None:
            self._bridge.send_prints(prints)
        return {
            "timing_s/weight_transfer": time.perf_counter() - start,
            "weight_transfer/bytes": float(sent),
            "timing_s/parity_weights": check_s,
        }

    def _receive_weights(self, start: float, step: int | None) -> dict[str, Any]:
        cfg, manifest = self.rollout_cfg, self._bridge_manifest
        state = self._bridge.receive(manifest)
        prints = self._bridge.receive_prints(len(manifest)) if cfg.weight_fingerprints else []
        self.rollout.sync_step = step
        replaced = BEFORE_LOAD(state=state, rollout=self.rollout, engine=None, step=step, path="bridge")
        if not SKIP_LOAD(rollout=self.rollout, step=step, path="bridge"):
            self.rollout.load_weights(state if replaced is None else replaced)
        LOADED(rollout=self.rollout, step=step, path="bridge")
        if step is not None:
            self._pushed_version = step
        check = WeightCheck(self.rollout, SyncSite(cfg.name, "bridge", step), cfg.weight_fingerprints)
        sent = dict(zip((name for name, _, _ in manifest), prints))
        findings = check.compare(check.timed(bridge_expected, self.rollout, state, sent))
        return {
            "timing_s/weight_transfer": time.perf_counter() - start,
            "timing_s/parity_weights": check.seconds,
            K.META_PARITY: findings,
        }

    # --- checkpoints ----------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded actor checkpoint (model, optimizer, LR schedule, update counter) under `path`/actor."""
        self.actor.save_checkpoint(Path(path) / "actor", extra={"update_calls": self._update_calls})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote; the rollout copy is refreshed before the next generation."""
        extra = self.actor.load_checkpoint(Path(path) / "actor")
        self._update_calls = int(extra.get("update_calls", 0))
        self._rollout_stale = True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> None:
        """Write the current actor as a full Hugging Face directory (collective gather; rank 0 writes)."""

        export_hf(self.actor, out_dir, self.tokenizer)


def _check_old_log_probs(data: DataProto, own: bool, epochs: int, mini_rows: int) -> None:
    """Refuse an update whose old log-probs are missing or cannot be its own."""
    if own and (epochs > 1 or len(data) > mini_rows):
        raise ValueError(
            "update_actor: own_old_log_prob=True needs exactly one optimizer step, but "
            f"ppo_epochs={epochs} and {len(data)} rows > {mini_rows} rows per mini-batch on this worker; "
            "call compute_log_prob first"
        )
    if not own and K.OLD_LOG_PROBS not in data.batch.keys():
        raise ValueError(
            f"update_actor: rows lack {K.OLD_LOG_PROBS!r}; call compute_log_prob first, or set "
            "own_old_log_prob=True for a single-step update"
        )
