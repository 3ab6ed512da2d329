"""On-policy distillation end to end: the teacher role on Ray workers scores like a direct transformers forward,
a teacher with another tokenizer is refused naming both, config problems fail at load with one message (hybridflow's
keys and verl's), and `hybridflow train` with a teacher lowers the teacher KL (Ray workers) and runs the multi-turn
loop (tool replies carry no signal: tests/test_algos_distillation.py checks the masking by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config.run import RunConfig
from hybridflow.models import tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.utils.config_loader import ConfigError, load_config
from hybridflow.workers.config import TeacherConfig
from hybridflow.workers.teacher import TeacherWorker, check_teacher_tokenizer
from tests.engine_helpers import make_batch, reference_log_probs
from tests.test_trainer_cli import base_overrides, read_metrics, run_cli


def sharpened_copy(out: Path, scale: float) -> Path:
    """The tiny Llama with its final norm's weight times `scale`: logits times `scale` (its distribution at
    temperature 1/scale), with the same tokenizer. Cached per path."""
    if not (out / "config.json").exists():
        src = tiny_model_dir("llama")
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        with torch.no_grad():
            model.model.norm.weight.mul_(scale)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def test_teacher_log_probs_on_ray_workers_equal_a_direct_forward(ray_local, tmp_path: Path):
    from hybridflow.controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    teacher = sharpened_copy(tmp_path / "teacher", 3.0)
    cfg = TeacherConfig(path=str(teacher), param_dtype="fp32", log_prob_micro_batch_size_per_device=2)
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="teacher_")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(TeacherWorker, cfg), name_prefix="teacher")
    try:
        group.init_model()
        batch = make_batch(6, 8, 6, seed=3)  # 3 rows per worker, 2 micro-batches on each
        out = group.compute_teacher_log_prob(DataProto.from_dict(batch), temperature=0.7).get()
    finally:
        group.shutdown()
        pool.remove()
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    expected, _ = reference_log_probs(model, batch, temperature=0.7)
    got = out.batch[K.TEACHER_LOG_PROBS]
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().max() > 1.0  # real log-probs, not zeros


def other_vocab_teacher(out: Path) -> Path:
    """The tiny model with one token added to its tokenizer: another vocabulary."""
    src = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens(["<teacher_only>"])
    tok.save_pretrained(out)
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(out)
    return out


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path: Path):
    src = tiny_model_dir("llama")
    other = other_vocab_teacher(tmp_path / "other_vocab")
    student = AutoTokenizer.from_pretrained(src)
    with pytest.raises(ValueError) as err:
        check_teacher_tokenizer(str(other), student, str(src))
    message = str(err.value)
    assert f"distillation.teacher.path={str(other)!r}" in message
    assert f"{str(other)!r} (" in message and f"{str(src)!r} (" in message  # both tokenizers named
    assert "49153 tokens" in message and "49152 tokens" in message and "cross-tokenizer" in message
    check_teacher_tokenizer(str(sharpened_copy(tmp_path / "same", 2.0)), student, str(src))  # same vocabulary: fine


def test_the_cli_refuses_another_tokenizer_before_any_worker_starts(tmp_path: Path, capsys, monkeypatch):
    from hybridflow.cli.train import main as train_main

    other = other_vocab_teacher(tmp_path / "other_vocab")
    monkeypatch.chdir(tmp_path)
    args = [*base_overrides(str(tiny_model_dir("llama")), tmp_path), "distillation.enabled=true"]
    code = train_main([*args, f"distillation.teacher.path={other}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("hybridflow train: error:") and "cross-tokenizer" in err[-1]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distillation.enabled=true"], "distillation.enabled=true needs a teacher: set distillation.teacher.path"),
        (["distillation.signal=reward"], "distillation.signal='reward' is unknown; valid: ['advantage', 'loss']"),
        (["distillation.kl_estimator=forward_kl_topk"], "distillation.kl_estimator='forward_kl_topk' is unknown"),
        (
            [
                "distillation.enabled=true",
                "distillation.teacher.path=default",
                "distillation.signal=loss",
                "distillation.kl_estimator=k1",
            ],
            "distillation.signal=loss with distillation.kl_estimator=k1",
        ),
        (
            ["distillation.enabled=true", "distillation.teacher.path=default", "distillation.coef=0"],
            "distillation.coef must be > 0",
        ),
        (["distillation.kl_clamp=-1"], "distillation.kl_clamp must be > 0 or null"),
        (["distillation.teacher.param_dtype=fp16"], "distillation.teacher.param_dtype"),
        (["distillation.teacher.log_prob_micro_batch_size_per_device=0"], "must be >= 1, got 0"),
        (
            ["distillation.teacher_models.a.model_path=x", "distillation.teacher_models.b.model_path=y"],
            "distillation.teacher_models.* names 2 entries (a, b); hybridflow distills from one teacher",
        ),
        (["distillation.distillation_loss.use_policy_gradient=maybe"], "use_policy_gradient='maybe' is not one of"),
    ],
)
def test_config_problems_fail_at_load_naming_the_keys(overrides: list[str], message: str):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, overrides)
    assert message in str(err.value)


def test_verl_distillation_keys_set_hybridflow_keys():
    cfg = load_config(
        RunConfig,
        None,
        [
            "distillation.enabled=true",
            "distillation.teacher_models.big.model_path=default",
            "distillation.teacher_models.big.inference.tensor_model_parallel_size=2",  # no effect: logged
            "distillation.distillation_loss.loss_mode=k3",
            "distillation.distillation_loss.use_policy_gradient=false",
            "distillation.distillation_loss.distillation_loss_coef=0.25",
            "distillation.distillation_loss.use_task_rewards=false",
            "distillation.distillation_loss.loss_max_clamp=5.0",
        ],
    ).distillation
    assert cfg.enabled and cfg.teacher.path == "default" and cfg.signal == "loss" and cfg.estimator == "k3"
    assert (cfg.coef, cfg.use_task_rewards, cfg.kl_clamp) == (0.25, False, 5.0)
    older = load_config(RunConfig, None, ["distillation.teacher_model.model_path=/x"]).distillation
    assert older.teacher.path == "/x" and older.signal == "advantage" and older.estimator == "k1"


def _distill_args(tmp_path: Path, student: Path, teacher: Path) -> list[str]:
    return [
        *base_overrides(str(student), tmp_path),
        "distillation.enabled=true",
        f"distillation.teacher.path={teacher}",
        "trainer.val_before_train=false",
    ]


@pytest.mark.slow
def test_distillation_on_ray_workers_lowers_the_teacher_kl(tmp_path: Path):
    """Student: the tiny model at temperature 1/12 (entropy 2.8 nats on its first step's samples); teacher: the
    same at 1/16, sharper. The teacher-KL advantage alone (no task reward) moves the student towards the teacher:
    the KL of the last three steps is well under the first step's (0.44 -> ~0.1 in a local-backend run)."""
    student = sharpened_copy(tmp_path / "student", 12.0)
    teacher = sharpened_copy(tmp_path / "teacher", 16.0)
    args = [
        *_distill_args(tmp_path, student, teacher),
        "distillation.use_task_rewards=false",
        "data.gen_train_size=64",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_device=8",
        "rollout.n=4",
        "actor.optim.lr=1e-3",
        "trainer.total_training_steps=8",
        "trainer.test_freq=-1",
    ]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "distillation/teacher_kl" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    kl = [r["distillation/teacher_kl"] for r in steps]
    assert kl[0] > 0.2, kl
    assert sum(kl[-3:]) / 3 < 0.6 * kl[0], kl
    for r in steps:
        assert r["distillation/advantage_mean"] == pytest.approx(-r["distillation/teacher_kl"], abs=1e-5)
        assert r["distillation/log_prob_gap_abs"] >= abs(r["distillation/teacher_kl"]) - 1e-6
        assert r["distillation/teacher_log_prob"] < 0 and "memory/peak_gb/teacher_log_prob" in r


@pytest.mark.slow
def test_multi_turn_trains_with_a_teacher_as_a_loss_term(tmp_path: Path):
    teacher = sharpened_copy(tmp_path / "teacher", 2.0)
    args = [
        *_distill_args(tmp_path, tiny_model_dir("llama"), teacher),
        "data.task=tool_arithmetic",
        "data.max_prompt_length=256",
        "data.max_response_length=32",
        "rollout.multi_turn.enable=true",
        "distillation.signal=loss",
        "trainer.backend=local",
        "trainer.n_workers_per_node=1",
    ]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["agent/turns/mean"] >= 1 and r["distillation/teacher_kl"] != 0
        assert r["actor/distillation_loss"] > 0  # k3 >= 0, and the teacher differs from the student
