"""`JudgeWorker`: a judge model served through a rollout backend, scoring responses by a generated verdict.

The controller sends the rows' texts (question, response, ground truth, extra_info: `judge_inputs`); each worker
renders its rows with judge.template, tokenizes them with the judge's own tokenizer and chat template, generates
every verdict in ONE call of its rollout (greedy by default) and parses each with judge.parser. It returns per row
a score and a status (`STATUS`); the controller turns them into rewards (hybridflow/train/judge_step.py).

No row fails its neighbours: a template that raises on a row, or a rendered prompt over judge.rollout.prompt_length,
marks that row only; a generate call that raises or outlives judge.timeout_s marks every row of the call
"failed" and the worker lives on. The timed-out generation cannot be interrupted: it keeps its thread, and later
calls are marked failed until it ends (the rollout is not re-entered while it runs).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.models.loading import load_config
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rewards.judge import JUDGE_PARSERS, JUDGE_TEMPLATES, as_messages
from hybridflow.rollout import build_rollout
from hybridflow.utils.plugins import import_plugins
from hybridflow.workers.judge_config import JudgeConfig

STATUS = {"ok": 0, "invalid": 1, "overlong": 2, "failed": 3}
"""A row's judge status code: a parsed verdict, an unparseable one, a prompt over the judge's prompt_length, or no
verdict (the template raised on the row, or the generate call failed / timed out)."""

QUESTION, RESPONSE = "judge_question", "judge_response"
"""The non-tensor columns of a judge call: the row's question and decoded response (with GROUND_TRUTH and
EXTRA_INFO)."""
SCORES, STATUSES, VERDICTS = "judge_scores", "judge_status", "judge_verdicts"
"""The columns a judge call returns: [b] float32 score (NaN unless ok), [b] int64 `STATUS` code, [b] str verdict."""
ERROR = "judge_error"
"""meta_info of a judge call's output: why its generation failed, when it did."""


def judge_context(cfg: JudgeConfig, tokenizer: Any, max_question: int, max_response: int) -> int:
    """Judge tokens of a prompt with a `max_question`-token question and a `max_response`-token response (counted
    in the policy's tokens: exact when the judge shares the policy's tokenizer), measured on the template with
    empty fields; raises ValueError naming the keys when it exceeds judge.rollout.prompt_length, or when that plus
    judge.rollout.response_length exceeds the judge model's context."""
    empty = render_prompt(cfg, tokenizer, "", "", "", None)
    need = len(empty) + max_question + max_response
    r = cfg.rollout
    if need > r.prompt_length:
        raise ValueError(
            f"judge prompts can be {need} tokens (judge.template={cfg.template!r}: {len(empty)} tokens of its own, "
            f"+ data.max_prompt_length={max_question} + data.max_response_length={max_response}), more than "
            f"judge.rollout.prompt_length={r.prompt_length}; raise judge.rollout.prompt_length to at least {need}"
        )
    context = getattr(load_config(cfg.model.path), "max_position_embeddings", None)
    if context is not None and r.prompt_length + r.response_length > context:
        raise ValueError(
            f"judge.rollout.prompt_length={r.prompt_length} + judge.rollout.response_length={r.response_length} is "
            f"more than the judge model's context ({context} tokens, judge.model.path={cfg.model.path!r}); "
            "lower them or use a judge with a longer context"
        )
    return need


def render_prompt(cfg: JudgeConfig, tokenizer: Any, question: str, response: str, truth: str, extra: Any) -> list[int]:
    """The judge's prompt token ids for one row: judge.template, then the judge's chat template."""
    messages = as_messages(JUDGE_TEMPLATES.get(cfg.template)(question, response, truth, extra))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the chat template holds the special tokens


def left_padded(rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / position_ids of `rows`, left-padded to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return {K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0)}


class JudgeWorker(Worker):
    """Serves the judge model through a rollout backend (judge.rollout.name)."""

    def __init__(self, config: JudgeConfig, plugins: Sequence[str] = ()) -> None:
        """`plugins`: the run's trainer.plugins, imported here first (in the worker process)."""
        super().__init__()
        import_plugins(plugins)
        self.cfg = config
        self.rollout = None
        self.tokenizer = None
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge")
        self._running: cf.Future | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the judge's tokenizer and its rollout (the template and parser are looked up first, so a bad
        plugin path fails here, not at the first step)."""
        JUDGE_TEMPLATES.get(self.cfg.template)
        JUDGE_PARSERS.get(self.cfg.parser)
        path = resolve_model_path(self.cfg.model.path)
        self.tokenizer = load_tokenizer(self.cfg.model.tokenizer_path or path)
        seed = self.cfg.rollout.seed + self.rank
        self.rollout = build_rollout(dataclasses.replace(self.cfg.rollout, seed=seed), path, self.tokenizer)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def judge(self, data: DataProto) -> DataProto:
        """Rows with judge_question / judge_response / ground_truth / extra_info -> judge_scores, judge_status,
        judge_verdicts (see the module docstring)."""
        n = len(data)
        scores = torch.full((n,), float("nan"), dtype=torch.float32)
        status = torch.full((n,), STATUS["ok"], dtype=torch.long)
        verdicts = [""] * n
        prompts = self._render(data, status)
        todo = [i for i in range(n) if status[i] == STATUS["ok"]]
        error = None
        if todo:
            texts, error = self._generate([prompts[i] for i in todo])
            if error is not None:
                status[todo] = STATUS["failed"]
            else:
                parse = JUDGE_PARSERS.get(self.cfg.parser)
                for i, text in zip(todo, texts):
                    verdicts[i] = text
                    score = _parsed(parse, text)
                    if score is None:
                        status[i] = STATUS["invalid"]
                    else:
                        scores[i] = score
        out = DataProto.from_dict({SCORES: scores, STATUSES: status}, non_tensors={VERDICTS: verdicts})
        out.meta_info[ERROR] = error
        return out

    def _render(self, data: DataProto, status: torch.Tensor) -> list[list[int] | None]:
        """Each row's judge prompt ids; a row whose template raises is marked failed, one over the judge's
        prompt_length overlong."""
        nt = data.non_tensor_batch
        extras = nt[K.EXTRA_INFO] if K.EXTRA_INFO in nt else [None] * len(data)
        prompts: list[list[int] | None] = []
        for i, (q, r, t, e) in enumerate(zip(nt[QUESTION], nt[RESPONSE], nt[K.GROUND_TRUTH], extras)):
            try:
                ids = render_prompt(self.cfg, self.tokenizer, str(q), str(r), str(t), e)
            except Exception:  # a plugin template failing on one row must not fail its neighbours
                status[i] = STATUS["failed"]
                ids = None
            if ids is not None and len(ids) > self.cfg.rollout.prompt_length:
                status[i] = STATUS["overlong"]
            prompts.append(ids)
        return prompts

    def _generate(self, prompts: list[list[int]]) -> tuple[list[str], str | None]:
        """The verdict texts of `prompts`, generated in one call, or ([], why) when the call failed, timed out,
        or an earlier timed-out call still runs."""
        if self._running is not None and not self._running.done():
            return [], "an earlier judge call that timed out is still generating"
        self._running = self._pool.submit(self._verdicts, prompts)
        try:
            return self._running.result(timeout=self.cfg.timeout_s), None
        except cf.TimeoutError:
            return [], f"the judge's generate call took more than judge.timeout_s={self.cfg.timeout_s:g} s"
        except Exception as err:  # the judge backend failing is scored, not raised: it must not stop the run
            return [], f"the judge's generate call failed: {type(err).__name__}: {err}"

    def _verdicts(self, prompts: list[list[int]]) -> list[str]:
        pad = self.tokenizer.pad_token_id
        batch = DataProto.from_dict(left_padded(prompts, pad))
        out = self.rollout.generate_sequences(batch, self.cfg.rollout.sampling_params())
        lengths = out.batch[K.RESPONSE_MASK].sum(-1).tolist()
        rows = [row[:length].tolist() for row, length in zip(out.batch[K.RESPONSES], lengths)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)


def _parsed(parse: Any, text: str) -> float | None:
    """The parser's score of `text`; None when it gives none, raises, or gives a non-finite number."""
    try:
        score = parse(text)
    except Exception:  # a plugin parser raising on odd text is an unreadable verdict, not a failed step
        return None
    if score is None:
        return None
    score = float(score)
    return score if score == score and abs(score) != float("inf") else None
