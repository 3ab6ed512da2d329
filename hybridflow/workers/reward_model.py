"""`RewardModelWorker`: a model-based reward, scored at each response's last valid token.

The reward model is read from a local directory saved from a one-label
`*ForSequenceClassification` model (the usual trained reward model) or
`*ForTokenClassification` model (a value model); see `hybridflow.models.value`. A
plain causal LM is refused: its score head would be random. The reward model must
share the policy's tokenizer, since it scores the same token ids the policy
generated (re-tokenising for another vocabulary is not done).

A row's score is the head's output AT its last valid response token, which is what
transformers' sequence classifier returns for the unpadded sequence (`score_inputs`
explains how the critic-aligned engine is made to produce it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.dispatch import make_nd_compute_dataproto_dispatch_fn
from hybridflow.controller.worker import Worker
from hybridflow.models import resolve_model_path
from hybridflow.models.loading import load_config
from hybridflow.models.value import has_trained_head
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.utils.plugins import import_plugins
from hybridflow.workers.config import RewardModelConfig
from hybridflow.workers.engines import build_engine, declare_engine_mesh

REWARD_MESH = "reward_model"
"""The mesh the reward model declares for the N-D dispatch: dp x sp by reward_model.ulysses_sequence_parallel_size."""
_ON_REWARD_MESH = make_nd_compute_dataproto_dispatch_fn(REWARD_MESH)

_FIX = (
    "point reward_model.model.path at a directory saved (save_pretrained) from a "
    "*ForSequenceClassification or *ForTokenClassification model with num_labels=1"
)


def check_reward_model_dir(path: Path) -> None:
    """Raise ValueError unless the HF directory `path` holds a trained one-label scalar head."""

    config = load_config(path)
    if not has_trained_head(config):
        raise ValueError(
            f"reward_model.model.path={str(path)!r} holds a {config.architectures or 'model'} "
            f"checkpoint with no trained score head, so its scores would be random; {_FIX}"
        )
    if config.num_labels != 1:
        raise ValueError(
            f"reward_model.model.path={str(path)!r} holds a classifier with num_labels={config.num_labels}; {_FIX}"
        )


def score_inputs(batch) -> dict[str, torch.Tensor]:
    """The model inputs of `batch` plus one column, so that the engine's values reach the last token.

    The engine aligns values like a critic's: response column i gets the output at the
    token BEFORE response token i, so the output at the last valid token (column L - 1,
    L = response length) would fall on column L, past the response. One dummy real token
    is placed right after each row's response (at a new final column when the response
    fills the row); response column L then holds the output at the last valid token.
    Causal attention keeps the dummy token from changing any earlier output.
    """
    ids, attn, resp = batch[K.INPUT_IDS], batch[K.ATTENTION_MASK], batch[K.RESPONSES]
    rows, prompt_len = ids.shape[0], ids.shape[1] - resp.shape[1]
    lengths = attn[:, prompt_len:].long().sum(-1)  # every real response token (multi-turn: observations too)
    ids = torch.cat([ids, ids.new_zeros(rows, 1)], -1)
    attn = torch.cat([attn, attn.new_zeros(rows, 1)], -1)
    attn[torch.arange(rows), prompt_len + lengths] = 1
    out = {K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.RESPONSES: ids[:, prompt_len:]}
    if K.POSITION_IDS in batch.keys():  # the dummy token's position is irrelevant: nothing attends to it
        pos = batch[K.POSITION_IDS]
        out[K.POSITION_IDS] = torch.cat([pos, pos[:, -1:] + 1], -1)
    return out


def last_token_scores(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[b, R + 1] values of `score_inputs` -> [b, R]: the output at each row's last valid token, 0 elsewhere."""
    lengths = response_mask.long().sum(-1)
    out = values.new_zeros(response_mask.shape, dtype=torch.float32)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] = values[rows, lengths[rows]].float()
    return out


class RewardModelWorker(Worker):
    """Scores whole responses with a reward model."""

    def __init__(self, config: RewardModelConfig, plugins: Sequence[str] = ()) -> None:
        """`plugins`: the run's trainer.plugins, imported here first (in the worker process)."""
        super().__init__()
        import_plugins(plugins)
        self.cfg = config
        self.engine = None
        declare_engine_mesh(self, REWARD_MESH, config.engine_config(), "reward_model.")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Check the reward-model directory, form the process group and load it (inference only)."""

        path = resolve_model_path(self.cfg.model.path)
        check_reward_model_dir(path)
        self.init_process_group()
        self.engine = build_engine(path, self.cfg.engine_config(), value_model=True)

    @register(dispatch_mode=_ON_REWARD_MESH)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """Rows with input_ids/attention_mask/position_ids/responses/response_mask -> rm_scores [b, R]."""
        values = self.engine.compute_values(score_inputs(data.batch), self.cfg.micro_batch_size_per_device)
        width = data.batch[K.RESPONSES].shape[1]
        real = data.batch[K.ATTENTION_MASK][:, -width:]  # = response_mask, but for multi-turn observations
        return DataProto.from_dict({K.RM_SCORES: last_token_scores(values, real)})
