"""The agent loop on a tensor-parallel native rollout (rollout.tensor_model_parallel_size=2, two gloo ranks): both
ranks run the same trajectories, the trained ids are the sampled ids, and the rollout's log-probs are the full
model's; an environment that answers differently on the two ranks fails on both, naming the cause."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.agent.loop.env import Environment, StepResult
from hybridflow.agent.loop.runner import AgentLoopConfig, run_agent_loop
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.config import SamplingParams
from tests.test_agent_rollout import stopping_model
from tests.test_partial_rollout import ThreeTurns, teacher_forced

ROWS = [{"q": f"question {i}" + " more" * i} for i in range(4)]
LOOP = AgentLoopConfig(response_length=48, max_turn_tokens=8, max_assistant_turns=3)


class RankDependent(ThreeTurns):
    """Replies with this process's rank: the two ranks' contexts differ after the first turn."""

    def step(self, text):
        return StepResult([{"role": "tool", "content": f"rank {os.environ['RANK']}"}])


def _run(model: str, env: type[Environment]) -> list:
    tok = load_tokenizer(model)
    cfg = RolloutConfig(dtype="fp32", prompt_length=64, response_length=48, tensor_model_parallel_size=2)
    rollout = build_rollout(cfg, model, tok)
    with rollout.turn_generator(SamplingParams()) as generate:
        return run_agent_loop(ROWS, env, generate, tok, LOOP, rollout.eos_ids)


def _worker(rank: int, port: int, model: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    trajs = _run(model, ThreeTurns)
    try:
        _run(model, RankDependent)
        diverged = "no error"
    except RuntimeError as exc:
        diverged = str(exc)
    torch.save({"trajs": [vars(t) for t in trajs], "diverged": diverged}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow  # two processes building a split rollout
def test_the_agent_loop_runs_on_a_tensor_parallel_rollout(tmp_path: Path):
    model, _ = stopping_model(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, model, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["trajs"] == ranks[1]["trajs"]  # the same tokens on both ranks of the group
    trajs = ranks[0]["trajs"]
    assert max(t["assistant_turns"] for t in trajs) >= 2
    scorer = load_causal_lm(model).eval()
    for t in trajs:
        assert [i for i, m in zip(t["response_ids"], t["response_mask"]) if m] == t["sampled_ids"]
        mask = torch.tensor(t["response_mask"]).bool()
        forced = teacher_forced(scorer, t["prompt_ids"] + t["response_ids"], len(t["prompt_ids"]))
        torch.testing.assert_close(torch.tensor(t["rollout_log_probs"])[mask], forced[mask], atol=2e-4, rtol=0)
    for r in ranks:
        assert "ranks of a tensor-parallel group reached a round of the agent loop with different" in r["diverged"]
