"""`auto` compute dtype: a matmul probe decides bf16 vs fp32 once per machine, and the resolve stage fills it in."""

import json

import pytest

from hybridflow.utils import hardware
from hybridflow.utils.dtypes import check_dtype, dtype_of, resolve_dtype


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    hardware.auto_compute_dtype.cache_clear()
    yield tmp_path
    hardware.auto_compute_dtype.cache_clear()


@pytest.mark.parametrize(
    ("bf16", "fp32", "choice"),
    [(300.0, 170.0, "bf16"), (240.0, 170.0, "fp32"), (255.0, 170.0, "bf16"), (20.0, 160.0, "fp32")],
)
def test_bf16_is_chosen_only_where_it_pays_1_5x(monkeypatch, bf16, fp32, choice):
    rates = {"torch.bfloat16": bf16, "torch.float32": fp32}
    monkeypatch.setattr(hardware, "matmul_gflops", lambda dtype, shape, repeats: rates[str(dtype)])
    assert hardware.probe_compute_dtype(1)["choice"] == choice


def test_probe_runs_once_per_machine_and_is_kept_on_disk(cache_home, monkeypatch):
    calls = []
    monkeypatch.setattr(
        hardware,
        "probe_compute_dtype",
        lambda threads: calls.append(threads) or {"bf16": 9.0, "fp32": 1.0, "choice": "bf16"},
    )
    assert hardware.auto_compute_dtype("cpu", 1) == "bf16"
    hardware.auto_compute_dtype.cache_clear()  # a new process: reads the file, does not probe again
    assert hardware.auto_compute_dtype("cpu", 1) == "bf16"
    assert calls == [1]
    cached = json.loads((cache_home / "dtype_probe.json").read_text())
    assert [v["choice"] for v in cached.values()] == ["bf16"] and "1 threads" in next(iter(cached))


def test_real_probe_gives_a_known_dtype(cache_home):
    probe = hardware.probe_compute_dtype(1)
    assert probe["choice"] in ("bf16", "fp32") and probe["bf16"] > 0 and probe["fp32"] > 0
    assert str(dtype_of("auto")).removeprefix("torch.") in ("bfloat16", "float32")


def test_auto_is_a_compute_dtype_only():
    check_dtype("engine.param_dtype", "auto")
    with pytest.raises(ValueError, match="engine.reduce_dtype must be one of"):
        check_dtype("engine.reduce_dtype", "auto", allow_auto=False)
    assert resolve_dtype("fp32", "cpu", 1) == "fp32"


def test_resolve_fills_in_every_auto_dtype(cache_home, monkeypatch):
    from hybridflow.config.run import RunConfig
    from hybridflow.utils.config_loader import load_config
    from tests.resolve_helpers import resolve_here

    monkeypatch.setattr(hardware, "probe_compute_dtype", lambda threads: {"bf16": 1.0, "fp32": 1.0, "choice": "fp32"})
    cfg = load_config(RunConfig, None, ["ref.param_dtype=bf16"])
    run = resolve_here(cfg, steps_per_epoch=4, cpu_count=2).config
    assert (run.actor.engine.param_dtype, run.rollout.dtype, run.reward_model.param_dtype) == ("fp32",) * 3
    assert run.ref.param_dtype == "bf16"  # a user value is kept


def test_a_cpu_with_another_isa_is_probed_again(cache_home, monkeypatch):
    """Machines of one kind all say "AMD EPYC": the cache key holds what decides the kernels' speed."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # a shell that capped the ISA already
    monkeypatch.setattr(hardware, "probe_compute_dtype", lambda threads: {"bf16": 9.0, "fp32": 1.0, "choice": "bf16"})
    assert hardware.auto_compute_dtype("cpu", 1) == "bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # as on an avx2-only CPU, where bf16 is ~0.3 GFLOP/s
    monkeypatch.setattr(hardware, "probe_compute_dtype", lambda threads: {"bf16": 0.3, "fp32": 9.0, "choice": "fp32"})
    hardware.auto_compute_dtype.cache_clear()
    assert hardware.auto_compute_dtype("cpu", 1) == "fp32"
    keys = list(json.loads((cache_home / "dtype_probe.json").read_text()))
    assert len(keys) == 2 and "oneDNN <= AVX2" in keys[1] and "family" in keys[0]
    assert torch_isa() in keys[0]


def torch_isa() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()
