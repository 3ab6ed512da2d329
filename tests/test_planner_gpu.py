"""The GPU-cluster planner (planner/gpu.py, planner/gpu_search.py): hand-computed operator times,
the enumeration counts, memory pruning and the `hybridflow plan --cluster` command."""

from __future__ import annotations

import pytest

from hybridflow.cli.main import main as cli_main
from hybridflow.planner.gpu import (
    SHAPES,
    SPECS,
    GpuSpec,
    ModelShape,
    RLWorkload,
    forward_seconds,
    generate_seconds,
    reshard_seconds,
    train_seconds,
)
from hybridflow.planner.gpu_search import PPO_ROLES, evaluate, named_placements, one_step_off, search

SPEC = GpuSpec(
    "test",
    bf16_flops=100e12,
    memory_bytes=80e9,
    hbm_bytes_per_s=1e12,
    intra_node_bytes_per_s=100e9,
    inter_node_bytes_per_s=10e9,
    gpus_per_node=8,
    collective_latency_s=0.0,
)
SHAPE = ModelShape("test", layers=2, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=1000)
WORK = RLWorkload(prompts=64, prompt_len=100, response_len=50)


def test_shape_params_and_kv_by_hand():
    # per layer: q,o 2*1024^2 + k,v 2*1024*1024 + mlp 3*1024*4096; embeddings 2*1000*1024
    assert SHAPE.params == 2 * (4 * 1024**2 + 3 * 1024 * 4096) + 2 * 1000 * 1024
    assert SHAPE.kv_bytes_per_token == 2 * 2 * 8 * 128 * 2
    assert SHAPES["llama-7b"].params == pytest.approx(6.7e9, rel=0.02)
    assert SHAPES["llama-70b"].params == pytest.approx(69e9, rel=0.02)


def test_train_and_forward_seconds_by_hand():
    tokens = 64 * 150
    compute = 6 * SHAPE.params * tokens / (4 * 100e12 * 0.40)
    fsdp = (4 - 1) / 4 * 3 * 2 * SHAPE.params / 100e9  # all-gather x2 + reduce-scatter of bf16 params, NVLink
    assert train_seconds(SHAPE, WORK, SPEC, dp=4, tp=1) == pytest.approx(max(compute, fsdp))
    ar = 2 * (2 - 1) / 2 * (tokens / 2 * 1024 * 2) / 100e9  # one ring all-reduce of the activations
    fwd = max(2 * SHAPE.params * tokens / (4 * 100e12 * 0.5), (4 - 1) / 4 * 2 * SHAPE.params / 2 / 100e9)
    assert forward_seconds(SHAPE, WORK, SPEC, dp=2, tp=2) == pytest.approx(fwd + 2 * 2 * ar)


def test_generate_waves_when_the_kv_cache_does_not_fit():
    kv_per_seq = 150 * SHAPE.kv_bytes_per_token
    one_wave = generate_seconds(SHAPE, WORK, SPEC, devices=1, tp=1, free_bytes=64 * kv_per_seq)
    two_waves = generate_seconds(SHAPE, WORK, SPEC, devices=1, tp=1, free_bytes=32 * kv_per_seq)
    prefill = 2 * SHAPE.params * 64 * 100 / (100e12 * 0.5)
    read = lambda b: (2 * SHAPE.params + b * 125 * SHAPE.kv_bytes_per_token) / (1e12 * 0.7)  # noqa: E731
    assert one_wave == pytest.approx(prefill + 50 * read(64))
    assert two_waves == pytest.approx(prefill + 2 * 50 * read(32))
    assert generate_seconds(SHAPE, WORK, SPEC, devices=1, tp=1, free_bytes=kv_per_seq / 2) is None


def test_hybrid_engine_reshard_moves_only_the_generation_shard():
    full = 2 * SHAPE.params
    assert reshard_seconds(SHAPE, SPEC, devices=8, tp_gen=4, hybrid_engine=False) == pytest.approx(7 / 8 * full / 100e9)
    # each rank gathers its quarter from the 2 ranks holding it (one per generation tp group)
    assert reshard_seconds(SHAPE, SPEC, devices=8, tp_gen=4) == pytest.approx(1 / 2 * full / 4 / 100e9)
    # across nodes the group's members are spread over all 16 GPUs: the network's bandwidth
    assert reshard_seconds(SHAPE, SPEC, devices=16, tp_gen=8) == pytest.approx(1 / 2 * full / 8 / 10e9)


@pytest.mark.parametrize("gpus, expected", [(16, 1 + 7), (32, 1 + 7 * 3 + 6 * 3 + 1)])
def test_every_partition_and_node_allocation_once(gpus, expected):
    # 4 roles: S(4,1)=1, S(4,2)=7, S(4,3)=6, S(4,4)=1 partitions; C(nodes-1, sets-1) node allocations each
    plans = search(SHAPES["llama-7b"], RLWorkload(), SPECS["a100-80gb"], gpus)
    assert len(plans) == expected
    assert len({p.describe() for p in plans}) == expected
    assert [p.step_s for p in plans] == sorted(p.step_s for p in plans)


def test_memory_pruning():
    spec, work = SPECS["a100-80gb"], RLWorkload()
    assert search(SHAPES["llama-70b"], work, spec, 16) == []  # 2 x 70B trained x 16 B/param > 16 x 72 GB
    blocks, sizes = named_placements(32, spec)["standalone"]
    assert evaluate(blocks, sizes, SHAPES["llama-34b"], work, spec) is None  # the actor alone on 8 GPUs: 34B x 16 B
    assert evaluate(blocks, sizes, SHAPES["llama-13b"], work, spec) is not None
    assert all(s.memory_bytes <= spec.memory_bytes for p in search(SHAPES["llama-34b"], work, spec, 32) for s in p.sets)


def test_more_gpus_predict_faster_steps_and_one_step_off_is_bounded():
    spec, shape, work = SPECS["a100-80gb"], SHAPES["llama-13b"], RLWorkload()
    steps = [search(shape, work, spec, n)[0].step_s for n in (16, 32, 64)]
    assert steps[0] > steps[1] > steps[2]
    off = one_step_off(shape, work, spec, 64)
    assert off is not None and 0 < off[1] < 64
    assert set(off[2].sets[0].roles) == set(PPO_ROLES)


def test_cli_plan_on_a_cluster_spec(capsys):
    assert cli_main(["plan", "--cluster", "a100-80gb:16", "--shape", "llama-7b", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith(" 1.") and "actor_rollout" in out[0]
    assert cli_main(["plan", "--cluster", "tpu:16", "--shape", "llama-7b"]) == 2
    assert "expected SPEC:GPUS" in capsys.readouterr().err
