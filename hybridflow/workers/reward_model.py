"""`RewardModelWorker`: a model-based reward, scored at each response's last valid token.

The reward model is a value model (causal-LM backbone + scalar head) read from a
local directory; it must share the policy's tokenizer, since it scores the same
token ids the policy generated (re-tokenising for another vocabulary is not done).
"""

from __future__ import annotations

import torch

from hybridflow import keys as K
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.engine.config import EngineConfig
from hybridflow.protocol import DataProto
from hybridflow.workers.config import RewardModelConfig
from hybridflow.workers.engines import build_engine


def last_token_scores(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[b, R] per-token values -> [b, R] with the value at each row's last valid token, 0 elsewhere."""
    lengths = response_mask.long().sum(-1)
    out = torch.zeros_like(values)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] = values[rows, lengths[rows] - 1]
    return out


class RewardModelWorker(Worker):
    """Scores whole responses with a reward model."""

    def __init__(self, config: RewardModelConfig) -> None:
        super().__init__()
        self.cfg = config
        self.engine = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Form the process group and load the reward model (inference only)."""
        from hybridflow.models import resolve_model_path

        self.init_process_group()
        path = resolve_model_path(self.cfg.model.path)
        self.engine = build_engine(path, EngineConfig(), value_model=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """Rows with input_ids/attention_mask/position_ids/responses/response_mask -> rm_scores [b, R]."""
        values = self.engine.compute_values(data.batch, self.cfg.micro_batch_size_per_device)
        return DataProto.from_dict({K.RM_SCORES: last_token_scores(values, data.batch[K.RESPONSE_MASK])})
