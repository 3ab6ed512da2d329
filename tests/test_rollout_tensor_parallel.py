"""The native rollout split over 2 gloo ranks (rollout.tensor_model_parallel_size=2) generates what one
process generates: the same greedy tokens and the same log-probs within float tolerance, Llama and Qwen2."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.protocol.keys import RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.backends import check_backend
from hybridflow.rollout.native.decoder import StaticLlamaDecoder
from tests.rollout_helpers import prompt_batch

ARCHS = ("llama", "qwen2")


def _config(tp: int) -> RolloutConfig:
    return RolloutConfig(
        do_sample=False, n=1, response_length=12, dtype="fp32", calculate_log_probs=True, tensor_model_parallel_size=tp
    )


def _generate(arch: str, tp: int) -> dict[str, torch.Tensor]:
    path = tiny_model_dir(arch)
    rollout = build_rollout(_config(tp), path, load_tokenizer(path))
    if tp > 1:
        dec = StaticLlamaDecoder(rollout.model, tp_group=rollout.tp_group)
        assert dec.heads * tp == rollout.model.config.num_attention_heads  # really split
    out = rollout.generate_sequences(prompt_batch(load_tokenizer(path)))
    return {k: out.batch[k] for k in (RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS)}


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    res = {arch: _generate(arch, tp=2) for arch in ARCHS}
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_tp2_native_rollout_generates_as_one_process(tmp_path):
    for arch in ARCHS:
        tiny_model_dir(arch)  # build the caches before the workers race for them
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for arch in ARCHS:
        want = _generate(arch, tp=1)
        assert int(want[RESPONSE_MASK].sum()) > 3 * 4  # responses long enough to compare
        for got in (r[arch] for r in ranks):
            assert torch.equal(got[RESPONSES], want[RESPONSES]), arch
            assert torch.equal(got[RESPONSE_MASK], want[RESPONSE_MASK]), arch
            torch.testing.assert_close(got[ROLLOUT_LOG_PROBS], want[ROLLOUT_LOG_PROBS], atol=1e-5, rtol=1e-5)


def test_tp_rollout_refused_for_other_backends_and_bad_sizes():
    with pytest.raises(ValueError, match="not supported by rollout.name='hf'; use rollout.name=native"):
        check_backend(RolloutConfig(name="hf", tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be >= 1"):
        RolloutConfig(tensor_model_parallel_size=0)
