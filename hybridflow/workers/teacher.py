"""`TeacherWorker`: the frozen teacher of on-policy distillation, scoring the tokens the student sampled.

Like the reference policy it is a forward-only causal LM on the `Engine` interface, computing log-probs of
the batch's response tokens (hybridflow/algos/distillation.py turns them into the signal). It lives in the
worker set of the reference policy: in every worker process with trainer.placement=colocate, on the second
half of the workers with split. The teacher must share the student's tokenizer, since it scores the same
token ids: `check_teacher_tokenizer` refuses another one on the controller, before any worker starts
(cross-tokenizer distillation is not done).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from hybridflow.controller.worker import Worker
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.utils.peak_memory import operator_peak
from hybridflow.utils.plugins import import_plugins
from hybridflow.workers.config import TeacherConfig
from hybridflow.workers.engines import build_engine, declare_engine_mesh

TEACHER_MESH = "teacher"
"""The mesh the teacher declares for the N-D dispatch (plain data parallel)."""
_ON_TEACHER_MESH = make_nd_compute_dataproto_dispatch_fn(TEACHER_MESH)


def _describe(tokenizer: Any, path: str) -> str:
    return f"{path!r} ({type(tokenizer).__name__}, {len(tokenizer)} tokens)"


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """What differs between two tokenizers in what log-prob scoring reads (the token of every id, the special
    token ids), or None when they agree."""
    if len(student) != len(teacher):
        return f"vocabulary sizes {len(student)} and {len(teacher)}"
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        token = next(t for t in s_vocab if t_vocab.get(t) != s_vocab[t])
        return f"token {token!r} is id {s_vocab[token]} in the student's and {t_vocab.get(token)} in the teacher's"
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)} and {getattr(teacher, name)}"
    return None


def check_teacher_tokenizer(teacher_path: str, student_tokenizer: Any, student_path: str) -> None:
    """Raise ValueError naming both tokenizers unless the teacher at `teacher_path` uses the student's."""
    teacher = load_tokenizer(resolve_model_path(teacher_path))
    diff = tokenizer_difference(student_tokenizer, teacher)
    if diff is not None:
        raise ValueError(
            f"distillation.teacher.path={teacher_path!r}: the teacher's tokenizer {_describe(teacher, teacher_path)} "
            f"is not the student's {_describe(student_tokenizer, student_path)} ({diff}); the teacher scores the "
            "student's token ids, so it must share the student's tokenizer (cross-tokenizer distillation is not "
            "supported): pick a teacher trained from the same base vocabulary"
        )


class TeacherWorker(Worker):
    """Computes the teacher's log-probs of the sampled response tokens."""

    def __init__(self, config: TeacherConfig, plugins: Sequence[str] = ()) -> None:
        """`plugins`: the run's trainer.plugins, imported here first (in the worker process)."""
        super().__init__()
        import_plugins(plugins)
        self.cfg = config
        self.engine = None
        declare_engine_mesh(self, TEACHER_MESH, config.engine_config(), "distillation.teacher.")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Form the process group and load the teacher (inference only)."""
        self.init_process_group()
        self.engine = build_engine(resolve_model_path(self.cfg.path), self.cfg.engine_config())

    @register(dispatch_mode=_ON_TEACHER_MESH, blocking=False)
    def compute_teacher_log_prob(self, data: DataProto, *, temperature: float) -> DataProto:
        """Rows with input_ids/attention_mask/position_ids/responses -> teacher_log_probs [b, R], from the teacher's
        logits divided by `temperature` (the student's sampling temperature, as its own log-probs are).

        Non-blocking (returns a future) so that with split placement it overlaps the actor."""
        metrics: dict[str, float] = {}
        with operator_peak("teacher_log_prob", metrics):
            log_probs, _ = self.engine.compute_log_probs(
                data.batch, self.cfg.log_prob_micro_batch_size_per_device, temperature
            )
        return DataProto.from_dict({K.TEACHER_LOG_PROBS: log_probs}, meta_info={K.META_METRICS: metrics})
