"""The Registry helper, and every named registry of the package built on it."""

from __future__ import annotations

import pytest

from hybridflow.utils.registry import Registry, UnknownNameError


def make() -> Registry:
    return Registry("widget", "model.widget", "add one with WIDGETS.register")


def test_register_as_call_and_as_decorator():
    reg = make()

    @reg.register("b")
    def b() -> str:
        return "b"

    def a() -> str:
        return "a"

    assert reg.register("a", a) is a  # a plain call returns the entry
    assert b() == "b"  # the decorator returns the function unchanged
    assert reg.get("a") is a and reg["b"] is b
    assert reg.names() == ["a", "b"] and list(reg) == ["a", "b"] and len(reg) == 2
    assert "a" in reg and "c" not in reg


def test_duplicate_names_are_refused_unless_override():
    reg = make()
    first, second = object(), object()
    reg.register("x", first)
    reg.register("x", first)  # the same object again: a no-op
    with pytest.raises(ValueError, match="widget 'x' is already registered; pass override=True"):
        reg.register("x", second)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x")(second)
    assert reg.get("x") is first
    reg.register("x", second, override=True)
    assert reg.get("x") is second


def test_unknown_name_error_names_key_name_known_names_and_hint():
    reg = make()
    reg.register("beta", 2)
    reg.register("alpha", 1)
    with pytest.raises(UnknownNameError) as info:
        reg.get("gamma")
    assert str(info.value) == (
        "model.widget='gamma' is not a registered widget; known: alpha, beta (add one with WIDGETS.register)"
    )
    # Callers that caught either the old KeyError or the old ValueError still do.
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_unregister_removes_and_returns_the_entry():
    reg = make()
    reg.register("x", 1)
    assert reg.unregister("x") == 1 and "x" not in reg
    with pytest.raises(KeyError, match="model.widget='x'"):
        reg.unregister("x")


def test_load_hook_runs_once_before_the_first_lookup():
    calls = []

    def load() -> None:
        calls.append(1)
        reg.register("builtin", "b")

    reg: Registry[str] = Registry("widget", "model.widget", load=load)
    reg.register("user", "u")  # registering does not load
    assert calls == []
    assert reg.names() == ["builtin", "user"] and reg.get("builtin") == "b" and "user" in reg
    assert calls == [1]


def test_load_hook_is_retried_after_a_failure():
    attempts = []

    def load() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise ImportError("first try fails")
        reg.register("builtin", "b")

    reg: Registry[str] = Registry("widget", "model.widget", load=load)
    with pytest.raises(ImportError):
        reg.names()
    assert reg.get("builtin") == "b" and len(attempts) == 2


def _ported() -> dict[str, tuple[Registry, list[str]]]:
    from hybridflow.algos.adv_spec import ADV_ESTIMATORS
    from hybridflow.algos.kl import KL_CONTROLLERS, KL_ESTIMATORS
    from hybridflow.algos.losses import POLICY_LOSSES
    from hybridflow.controller.decorator import DISPATCH_MODES
    from hybridflow.data.tasks import TASKS
    from hybridflow.rewards.registry import SCORERS
    from hybridflow.utils.tracking import BACKENDS
    from hybridflow.workers.engines import ENGINES

    return {
        "algorithm.adv_estimator": (ADV_ESTIMATORS, ["gae", "grpo", "rloo", "remax"]),
        "actor.policy_loss_mode": (POLICY_LOSSES, ["vanilla", "gspo", "clip_cov", "kl_cov"]),
        "kl_type": (KL_ESTIMATORS, ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]),
        "algorithm.kl_ctrl.type": (KL_CONTROLLERS, ["fixed", "adaptive"]),
        "data_source": (SCORERS, ["arithmetic", "openai/gsm8k", "countdown", "lighteval/MATH"]),
        "data.task": (TASKS, ["arithmetic", "gsm8k", "countdown"]),
        "engine.backend": (ENGINES, ["fsdp", "fsdp_tp"]),
        "trainer.logger": (BACKENDS, ["console", "jsonl", "tensorboard", "wandb", "mlflow"]),
        "dispatch_mode": (DISPATCH_MODES, ["ONE_TO_ALL", "DP_COMPUTE_PROTO", "DP_COMPUTE_METRIC"]),
    }


@pytest.mark.parametrize("key", list(_ported()))
def test_every_ported_registry_is_a_registry_and_resolves_its_builtins(key):
    reg, builtins = _ported()[key]
    assert isinstance(reg, Registry) and reg.key == key
    for name in builtins:
        assert name in reg and reg.get(name) is not None
    with pytest.raises(UnknownNameError, match=f"{key}='no_such_name'"):
        reg.get("no_such_name")


def test_public_wrappers_resolve_through_the_registries():
    from hybridflow.algos import get_advantage_estimator, get_policy_loss_fn, list_advantage_estimators
    from hybridflow.algos.adv_spec import ADV_ESTIMATORS
    from hybridflow.algos.losses import POLICY_LOSSES
    from hybridflow.controller.decorator import DISPATCH_MODES, Dispatch, get_dispatch_mode
    from hybridflow.data import get_task
    from hybridflow.data.tasks import TASKS
    from hybridflow.rewards import default_compute_score

    assert get_advantage_estimator("grpo") is ADV_ESTIMATORS.get("grpo").fn
    assert list_advantage_estimators() == ADV_ESTIMATORS.names()
    assert get_policy_loss_fn("vanilla") is POLICY_LOSSES.get("vanilla")
    assert get_task("countdown") is TASKS.get("countdown")
    assert get_dispatch_mode(Dispatch.ONE_TO_ALL) is DISPATCH_MODES.get("ONE_TO_ALL")
    assert default_compute_score("arithmetic", "The answer is 4", "4") in (0.0, 1.0)


def test_register_scorer_refuses_a_taken_data_source_unless_override():
    from hybridflow.rewards import default_compute_score, register_scorer
    from hybridflow.rewards.registry import SCORERS

    def always_one(solution: str, truth: str) -> float:
        return 1.0

    register_scorer("test/always_one", always_one)
    try:
        assert default_compute_score("test/always_one", "x", "y") == 1.0
        with pytest.raises(ValueError, match="rule scorer 'test/always_one' is already registered"):
            register_scorer("test/always_one", lambda s, t: 0.0)
        register_scorer("test/always_one", lambda s, t: 0.0, override=True)
        assert default_compute_score("test/always_one", "x", "y") == 0.0
    finally:
        SCORERS.unregister("test/always_one")


def test_lookups_from_other_threads_wait_for_the_builtins_to_load():
    import threading
    import time

    def slow_load() -> None:
        time.sleep(0.2)  # the import of the built-in modules, as harness threads race on a fresh worker
        reg.register("a", 1)

    reg: Registry[int] = Registry("thing", "thing name", load=slow_load)
    errors: list[Exception] = []

    def look() -> None:
        try:
            assert reg.get("a") == 1
        except Exception as err:  # noqa: BLE001  (collected for the assertion below)
            errors.append(err)

    threads = [threading.Thread(target=look) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
