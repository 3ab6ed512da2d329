"""Engine training: LR schedules, skipped non-finite steps, gradient checkpointing, config checks."""

import contextlib
import math

import pytest
import torch

from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engine.optim import build_lr_scheduler, lr_factor
from hybridflow.models import tiny_model_dir
from hybridflow.protocol import keys
from tests.engine_helpers import make_batch


def test_constant_schedule_with_warmup():
    cfg = OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.2, total_training_steps=10)
    assert [lr_factor(s, cfg) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_cosine_schedule_hits_peak_and_floor():
    cfg = OptimConfig(
        lr=1.0, lr_scheduler="cosine", lr_warmup_steps_ratio=0.1, min_lr_ratio=0.1, total_training_steps=20
    )
    assert lr_factor(0, cfg) == pytest.approx(0.5)
    assert lr_factor(2, cfg) == pytest.approx(1.0)
    assert lr_factor(11, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(20, cfg) == pytest.approx(0.1)
    assert lr_factor(50, cfg) == pytest.approx(0.1)


def verl_warmup_factor(step: int, warmup: int) -> float:
    """verl's get_constant_schedule_with_warmup (verl/utils/torch_functional.py), written out."""
    return step / max(1.0, warmup) if step < warmup else 1.0


@pytest.mark.parametrize(
    "warmup_steps, ratio, total, factors",
    [
        (-1, 0.2, 10, [0.5, 1.0, 1.0, 1.0]),  # verl's default -1: the ratio decides, 0.2 * 10 = 2 steps
        (0, 0.2, 10, [0.5, 1.0, 1.0, 1.0]),  # 0 and null: the ratio too (verl's documented meaning)
        (None, 0.2, 10, [0.5, 1.0, 1.0, 1.0]),
        (4, 0.2, 10, [0.25, 0.5, 0.75, 1.0, 1.0]),  # > 0 wins over the ratio
        (3, 0.0, None, [1 / 3, 2 / 3, 1.0, 1.0]),  # a step count needs no run length
        (-1, 0.0, None, [1.0, 1.0]),
    ],
)
def test_lr_warmup_steps_as_verl_reads_them(warmup_steps, ratio, total, factors):
    cfg = OptimConfig(lr=1.0, lr_warmup_steps=warmup_steps, lr_warmup_steps_ratio=ratio, total_training_steps=total)
    assert [lr_factor(s, cfg) for s in range(len(factors))] == pytest.approx(factors)
    warmup = round(1 / factors[0]) if factors[0] < 1 else 0
    # verl's factor one step later: ours starts at 1/warmup where verl's first update runs at lr 0
    assert [lr_factor(s, cfg) for s in range(len(factors))] == [
        verl_warmup_factor(s + 1, warmup) for s in range(len(factors))
    ]
    build_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), cfg)  # total not needed


def test_cosine_after_a_warmup_step_count():
    cfg = OptimConfig(
        lr=1.0, lr_scheduler="cosine", lr_warmup_steps=2, lr_warmup_steps_ratio=0.5, total_training_steps=10
    )
    assert lr_factor(1, cfg) == 1.0 and lr_factor(2, cfg) == 1.0  # 2 steps, not the ratio's 5
    assert lr_factor(6, cfg) == pytest.approx(0.5)  # (6 - 2) / (10 - 2): half way down the half cosine
    assert lr_factor(10, cfg) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(lr_scheduler="linear"), "lr_scheduler"),
        (dict(lr_warmup_steps_ratio=1.5), "lr_warmup"),
        (dict(min_lr_ratio=-0.1), "min_lr_ratio"),
    ],
)
def test_bad_optim_config_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        OptimConfig(**kwargs)


def test_bad_engine_config_names_the_key():
    with pytest.raises(ValueError, match="param_dtype"):
        EngineConfig(param_dtype="fp16")
    with pytest.raises(TypeError, match="micro_batch_size_per_device"):  # removed: it was never read
        EngineConfig(micro_batch_size_per_device=0)
    with pytest.raises(ValueError, match="fsdp_size"):
        EngineConfig(fsdp_size=0)
    with pytest.raises(ValueError, match=r"engine.fsdp_size=3 must divide the number of ranks \(4\)"):
        EngineConfig(fsdp_size=3).resolve_fsdp_size(torch.device("cpu"), 4)
    assert EngineConfig().resolve_fsdp_size(torch.device("cpu"), 4) == 1
    assert EngineConfig().resolve_fsdp_size(torch.device("cuda"), 4) == 4


def test_cosine_without_run_length_is_rejected():
    with pytest.raises(ValueError, match="total_training_steps"):
        FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig(), OptimConfig(lr_scheduler="cosine"))


def _pg_loss(out, micro):
    mask = micro[keys.ATTENTION_MASK][:, -micro[keys.RESPONSES].shape[1] :].float()
    return -(out["log_probs"] * mask).sum() / mask.sum() / 2, {"seen": 1.0}


def _train_once(gc: bool, data: dict, math_max_len: int = 128) -> tuple[dict, dict]:
    config = EngineConfig(param_dtype="fp32", gradient_checkpointing=gc, cpu_math_attention_max_len=math_max_len)
    engine = FSDPEngine.from_pretrained(
        tiny_model_dir("qwen2"), config, OptimConfig(lr=1e-3, lr_warmup_steps_ratio=0.5, total_training_steps=4)
    )
    metrics = engine.train_step(
        [{k: v[:2] for k, v in data.items()}, {k: v[2:] for k, v in data.items()}], _pg_loss, calc_entropy=True
    )
    metrics["next_lr"] = engine.lr_scheduler_step()
    return metrics, engine.full_state_dict()


def test_gradient_checkpointing_gives_the_same_update():
    data = make_batch(4, 7, 5, seed=5)
    m_plain, w_plain = _train_once(False, data)
    m_gc, w_gc = _train_once(True, data)
    assert m_plain["update_skipped"] == 0.0 and m_plain["seen"] == 1.0
    assert m_plain["lr"] == pytest.approx(0.5e-3) and m_plain["next_lr"] == pytest.approx(1e-3)
    assert m_gc["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)
    for k in w_plain:
        torch.testing.assert_close(w_gc[k], w_plain[k], atol=1e-6, rtol=1e-5)


def test_cpu_math_attention_gives_the_same_update_as_the_default_kernel():
    data = make_batch(4, 7, 5, seed=5)
    m_math, w_math = _train_once(True, data, math_max_len=128)
    m_default, w_default = _train_once(True, data, math_max_len=0)
    assert m_math["grad_norm"] == pytest.approx(m_default["grad_norm"], rel=1e-5)
    for k in w_math:
        # Kernels sum in different orders; Adam's first step (~lr * sign(g)) amplifies that on tiny gradients.
        torch.testing.assert_close(w_math[k], w_default[k], atol=1e-5, rtol=1e-4)


def test_cpu_math_attention_is_chosen_only_for_short_micro_batches():
    engine = FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig(cpu_math_attention_max_len=8))
    short, wide = make_batch(1, 4, 4, seed=1), make_batch(1, 6, 6, seed=1)
    assert not isinstance(engine._training_attention(short), contextlib.nullcontext)
    assert isinstance(engine._training_attention(wide), contextlib.nullcontext)
    with pytest.raises(ValueError, match="cpu_math_attention_max_len"):
        EngineConfig(cpu_math_attention_max_len=-1)


def test_non_finite_gradient_skips_the_update():
    engine = FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig(param_dtype="fp32"), OptimConfig(lr=1e-2))
    before = engine.full_state_dict()
    data = make_batch(2, 6, 4, seed=6)
    metrics = engine.train_step([data], lambda out, micro: (out["log_probs"].sum() * float("nan"), {}))
    assert metrics["update_skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    metrics = engine.train_step([data], lambda out, micro: (-out["log_probs"].sum(), {}))
    assert metrics["update_skipped"] == 0.0
    assert any(not torch.equal(before[k], engine.full_state_dict()[k]) for k in before)
