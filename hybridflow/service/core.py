"""The Tinker service's operations, transport-free: each state-changing call returns a request id at once and
queues its work on the scheduler; the work's result (or error) ends that request's future.

Bad input never raises out of a submit: it becomes a failed future with category "user", which the SDK raises
as `RequestFailedError` (a 4xx answer would be retried by the SDK for minutes, a 409 or 5xx too).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.rollout.config import SamplingParams
from hybridflow.service import checkpoints as ckpt
from hybridflow.service.errors import UserError
from hybridflow.service.futures import FutureStore, Outcome
from hybridflow.service.models import ModelRegistry
from hybridflow.service.sampler import SampleArgs, Sampler, Snapshot
from hybridflow.service.scheduler import Scheduler
from hybridflow.service.sessions import SessionTable
from hybridflow.service.wire import ForwardBackwardBody, encode_forward_backward_output, encode_sample_response

log = logging.getLogger(__name__)

NOT_SERVED_SAMPLE_FIELDS = (
    "topk_prompt_logprobs",
    "topk_sample_logprobs",
    "target_prompt_logprobs",
    "prompt_alt_tokens_k",
    "prompt_logprobs_last_n",
    "record_stability_info",
)
"""asample fields the service refuses when set (each a user error naming it)."""


@dataclass
class SamplingSession:
    """What a sampling session samples from (None: the base model)."""

    snapshot: Snapshot | None
    model_path: str | None
    session_id: str


class TinkerService:
    """The models, the sampler, checkpoints, futures and sessions of one served base model."""

    def __init__(
        self,
        model_path: str | Path,
        state_dir: str | Path,
        name: str | None = None,
        aliases: tuple[str, ...] = (),
        max_tokens: int = 2048,
        session_timeout_s: float = 300.0,
    ) -> None:
        self.name = name or str(model_path)
        """The base model's name in the API. The model directory by default: the SDK loads the tokenizer by this
        name (`AutoTokenizer.from_pretrained`), which a local directory satisfies offline."""
        self.aliases = {self.name, str(model_path), *aliases}
        """Every base_model a client may pass for this model."""
        self.futures = FutureStore()
        self.scheduler = Scheduler(self.futures)
        # Loading, like every call after it, runs on the scheduler's one worker thread: torch's OpenMP gives each
        # thread that computes its own thread team, and with two teams on few cores libgomp cuts their spin-waits
        # short, which made forward_backward ~40% slower (BENCHMARKS.md, "A tinker-cookbook math_rl step").
        try:
            self.registry, self.sampler = self.scheduler.call(lambda: self._load(model_path, max_tokens))
        except BaseException:
            self.scheduler.stop()
            raise
        self.checkpoints = ckpt.CheckpointStore(state_dir)
        self.sessions = SessionTable(session_timeout_s)
        self.sampling: dict[str, SamplingSession] = {}
        self._snapshots: dict[str, Snapshot] = {}

    def _load(self, model_path: str | Path, max_tokens: int) -> tuple[ModelRegistry, Sampler]:
        registry = ModelRegistry(model_path, self.name)
        sampler = Sampler(
            model_path, max_tokens, registry.vocab_size, registry.context_length, registry.merged, registry.probe
        )
        return registry, sampler

    # ---- helpers

    def _submit(self, job, lane: str | None = None, seq_id: int | None = None) -> str:
        rid = self.futures.new()
        if lane is not None and seq_id is not None:
            self.scheduler.submit_seq(lane, seq_id, rid, job)
        else:
            self.scheduler.submit(rid, job)
        return rid

    def failed(self, message: str, category: str = "user") -> str:
        """A request id whose future has already failed with `message`."""
        rid = self.futures.new()
        self.futures.fail(rid, message, category)
        return rid

    def check_base_model(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in self.aliases:
            raise UserError(f"unknown base_model {base_model!r}: this service serves {self.name!r} only")

    def reap_sessions(self) -> None:
        """Free what finished or silent sessions held (their checkpoints stay)."""
        for s in self.sessions.reap():
            for sid in s.samplers:
                self.sampling.pop(sid, None)
            for mid in s.models:
                self.scheduler.drop_lane(mid)
                self.scheduler.submit(self.futures.new(), lambda mid=mid: self._free(mid))
            if s.models:
                log.info("session %s ended: freed %d training clients", s.session_id, len(s.models))

    def _free(self, model_id: str) -> Outcome:
        self.registry.free(model_id)
        return Outcome(json={})

    # ---- models

    def create_model(self, body: dict[str, Any]) -> str:
        session = self.sessions.get(body.get("session_id", ""))
        if session is None:
            return self.failed(f"unknown session_id {body.get('session_id')!r}: create a session first")
        try:
            self.check_base_model(body.get("base_model"))
            lora = body.get("lora_config") or {}
            if "rank" not in lora:
                raise UserError("create_model needs lora_config with a rank: the service trains LoRA adapters only")
            opt = (body.get("optimizer_config") or {}).get("type", "adamw")
            if opt != "adamw":
                raise UserError(f"optimizer_config type {opt!r} is not served; use Adam (the default)")
            targets = self.registry.targets(
                lora.get("train_attn", True), lora.get("train_mlp", True), lora.get("train_unembed", True)
            )
        except UserError as err:
            return self.failed(str(err))
        model_id = f"{session.session_id}:train:{int(body.get('model_seq_id', 0))}"
        session.models.add(model_id)

        def job() -> Outcome:
            self.registry.create(model_id, session.session_id, int(lora["rank"]), targets, lora.get("seed"))
            return Outcome(json={"model_id": model_id, "type": "create_model"})

        return self._submit(job)

    def get_info(self, model_id: str) -> dict[str, Any]:
        model = self.registry.get(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": type(self.registry.base).__name__,
                "model_name": self.name,
                "tokenizer_id": str(self.registry.path),
            },
            "is_lora": True,
            "lora_rank": model.spec.rank,
            "model_name": self.name,
        }

    # ---- training

    def forward_backward(self, body: ForwardBackwardBody) -> str:
        def job() -> Outcome:
            outputs, metrics = self.registry.forward_backward(body)
            return Outcome(proto=encode_forward_backward_output(outputs, metrics))

        return self._seq(body.model_id, body.seq_id, job)

    def _seq(self, model_id: str, seq_id: int | None, job) -> str:
        if model_id not in self.registry.models:
            return self.failed(f"unknown model_id {model_id!r}: create it with create_model (or it was freed)")
        if seq_id is None:
            return self._submit(job)
        return self._submit(job, lane=model_id, seq_id=int(seq_id))

    def optim_step(self, body: dict[str, Any]) -> str:
        params = body.get("adam_params")
        if params is None:
            return self.failed("optim_step: only Adam is served (send adam_params)")

        def job() -> Outcome:
            metrics = self.registry.optim_step(
                body["model_id"],
                lr=float(params.get("learning_rate", 1e-4)),
                betas=(float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95))),
                eps=float(params.get("eps", 1e-12)),
                wd=float(params.get("weight_decay", 0.0)),
                clip=float(params.get("grad_clip_norm", 0.0)),
            )
            return Outcome(json={"metrics": metrics})

        return self._seq(body.get("model_id", ""), body.get("seq_id"), job)

    # ---- checkpoints

    def save_weights(self, body: dict[str, Any]) -> str:
        model_id = body.get("model_id", "")
        name = body.get("path") or f"step-{uuid.uuid4().hex[:8]}"

        def job() -> Outcome:
            ckpt.check_name(name)
            path = ckpt.CheckpointPath(model_id, "weights", name)
            model = self.registry.get(model_id)
            meta = {**self._meta(model), "probe_logprobs": self.registry.probe_logprobs(model_id).tolist()}
            opt = model.optimizer.state_dict()
            self._forget(path)
            self.checkpoints.save(path, self.registry.adapter_state(model_id), meta, opt, bool(body.get("overwrite")))
            return Outcome(json={"path": str(path), "type": "save_weights"})

        return self._seq(model_id, body.get("seq_id"), job)

    def _meta(self, model) -> dict[str, Any]:
        return {
            "base_model": self.name,
            "rank": model.spec.rank,
            "targets": model.spec.targets,
            "scaling": model.spec.scaling,
        }

    def save_weights_for_sampler(self, body: dict[str, Any]) -> str:
        model_id = body.get("model_id", "")
        name = body.get("path")
        owner = model_id.split(":train:")[0]

        def job() -> Outcome:
            model = self.registry.get(model_id)
            state = self.registry.adapter_state(model_id)
            probe = self.registry.probe_logprobs(model_id)
            if name is None:  # an unnamed snapshot: a sampling session only, kept in memory
                sid = f"{owner}:sample:{body.get('sampling_session_seq_id', uuid.uuid4().hex[:8])}"
                self._add_sampling(sid, Snapshot(sid, state, model.spec.scaling, probe), None, owner)
                return Outcome(json={"sampling_session_id": sid, "type": "save_weights_for_sampler"})
            ckpt.check_name(name)
            path = ckpt.CheckpointPath(model_id, "sampler_weights", name)
            self.checkpoints.save(path, state, {**self._meta(model), "probe_logprobs": probe.tolist()})
            return Outcome(json={"path": str(path), "type": "save_weights_for_sampler"})

        return self._seq(model_id, body.get("seq_id"), job)

    def _add_sampling(self, sid: str, snapshot: Snapshot | None, model_path: str | None, owner: str) -> None:
        self.sampling[sid] = SamplingSession(snapshot, model_path, owner)
        session = self.sessions.get(owner)
        if session is not None:
            session.samplers.add(sid)

    def _snapshot(self, model_path: str) -> Snapshot:
        """The saved adapter at `model_path`, read from disk once."""
        path = ckpt.parse(model_path)
        if str(path) not in self._snapshots:
            state, meta, _ = self.checkpoints.load(path)
            if meta.get("base_model") != self.name:
                raise UserError(f"checkpoint {path} was trained on {meta.get('base_model')!r}, not {self.name!r}")
            probe = meta.get("probe_logprobs")
            self._snapshots[str(path)] = Snapshot(
                str(path), state, float(meta["scaling"]), None if probe is None else np.asarray(probe, np.float32)
            )
        return self._snapshots[str(path)]

    def _forget(self, path: ckpt.CheckpointPath) -> None:
        """Drop what was read of a checkpoint about to be overwritten."""
        self._snapshots.pop(str(path), None)
        if self.sampler.loaded == str(path):
            self.sampler.loaded = None

    def load_weights(self, body: dict[str, Any]) -> str:
        model_id = body.get("model_id")
        if model_id is None:  # create_training_client_from_state: a new client, then the load
            return self._create_from_state(body)

        def job() -> Outcome:
            self._load_into(model_id, body["path"], bool(body.get("optimizer")))
            return Outcome(json={"path": body["path"], "model_id": model_id, "type": "load_weights"})

        return self._seq(model_id, body.get("seq_id"), job)

    def _load_into(self, model_id: str, tinker_path: str, with_optimizer: bool) -> None:
        path = ckpt.parse(tinker_path)
        state, _, opt = self.checkpoints.load(path)
        self.registry.load_adapter_state(model_id, state)
        if with_optimizer:
            if opt is None:
                raise UserError(f"checkpoint {path} holds no optimizer state (a sampler checkpoint?)")
            self.registry.get(model_id).optimizer.load_state_dict(opt)

    def _create_from_state(self, body: dict[str, Any]) -> str:
        session = self.sessions.get(body.get("session_id", ""))
        if session is None:
            return self.failed(f"unknown session_id {body.get('session_id')!r}: create a session first")
        model_id = f"{session.session_id}:train:{int(body.get('model_seq_id', 0))}"
        session.models.add(model_id)

        def job() -> Outcome:
            path = ckpt.parse(body.get("path", ""))
            _, meta, _ = self.checkpoints.load(path)
            self.registry.create(model_id, session.session_id, int(meta["rank"]), list(meta["targets"]), None)
            self._load_into(model_id, str(path), bool(body.get("optimizer")))
            return Outcome(json={"path": str(path), "model_id": model_id, "type": "load_weights"})

        return self._submit(job)

    def list_checkpoints(self, run: str) -> dict[str, Any]:
        return {"checkpoints": self.checkpoints.list(run)}

    # ---- sampling

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self.sessions.get(body.get("session_id", ""))
        if session is None:
            raise UserError(f"unknown session_id {body.get('session_id')!r}")
        model_path = body.get("model_path")
        if model_path is None:
            self.check_base_model(body.get("base_model") or self.name)
        snapshot = self._snapshot(model_path) if model_path else None
        sid = f"{session.session_id}:sample:{int(body.get('sampling_session_seq_id', 0))}"
        self._add_sampling(sid, snapshot, model_path, session.session_id)
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    def get_sampler(self, sid: str) -> dict[str, Any]:
        s = self.sampling.get(sid)
        if s is None:
            raise UserError(f"unknown sampler {sid!r}")
        return {"sampler_id": sid, "base_model": self.name, "model_path": s.model_path}

    def asample(self, body: dict[str, Any]) -> str:
        try:
            snapshot = self._sample_source(body)
            args = self._sample_args(body)
            self.sampler.check(args)
        except UserError as err:
            return self.failed(str(err))
        rid = self.futures.new()
        weights = None if snapshot is None else snapshot.key
        key = (weights, args.temperature, args.top_p, args.top_k, rid if args.seed is not None else None)

        def run_batch(batch: list[SampleArgs]) -> list[Outcome]:
            self.sampler.load(snapshot)
            return [Outcome(proto=encode_sample_response(seqs, lp)) for seqs, lp in self.sampler.sample(batch)]

        self.scheduler.submit_batchable(rid, key, args, run_batch)
        return rid

    def _sample_source(self, body: dict[str, Any]) -> Snapshot | None:
        sid = body.get("sampling_session_id")
        if sid is not None:
            s = self.sampling.get(sid)
            if s is None:
                raise UserError(f"unknown sampling_session_id {sid!r} (never created, or its session ended)")
            return s.snapshot
        if body.get("model_path"):
            return self._snapshot(body["model_path"])
        self.check_base_model(body.get("base_model") or self.name)
        return None

    def _sample_args(self, body: dict[str, Any]) -> SampleArgs:
        chunks = (body.get("prompt") or {}).get("chunks") or []
        prompt: list[int] = []
        for c in chunks:
            if c.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"prompt chunks of type {c.get('type')!r} are not served (text tokens only)")
            prompt += [int(t) for t in c["tokens"]]
        p = body.get("sampling_params") or {}
        for unsupported in NOT_SERVED_SAMPLE_FIELDS:
            if body.get(unsupported):
                raise UserError(f"{unsupported} is not served by this service (docs/guides/tinker.md)")
        top_k = int(p.get("top_k", -1))
        temperature, top_p = float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0))
        try:  # the rollout's own checks, here so that a bad request fails alone, before it joins a batch
            SamplingParams(temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k or -1)
        except ValueError as err:
            raise UserError(str(err).replace("sampling.", "sampling_params.")) from None
        stop = p.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        max_tokens = p.get("max_tokens")
        if max_tokens is None:  # as many as fit: the service's limit, within the model's context
            max_tokens = min(self.sampler.backend.max_tokens, self.registry.context_length - len(prompt))
        return SampleArgs(
            prompt=prompt,
            num_samples=int(body.get("num_samples", 1)),
            max_tokens=int(max_tokens),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k or -1,
            stop_ids=tuple(int(s) for s in stop if isinstance(s, int)),
            stop_strings=tuple(s for s in stop if isinstance(s, str)),
            seed=p.get("seed"),
            prompt_logprobs=bool(body.get("prompt_logprobs")),
        )

    def close(self) -> None:
        self.scheduler.stop()
