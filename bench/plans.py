"""Predicted vs measured step time of every plan that fits 2 CPU workers, for GRPO and for PPO with a critic.

Per job (grpo: the main job; ppo: the same with algorithm.adv_estimator=gae, so a critic), runs
`hybridflow train` once per plan, one after the other, each for --steps steps (the first is a warm-up
and is not timed):
- colocate_2x1: every role on 2 workers of 1 thread (the calibration run: its profile.json gives the
  per-token operator costs the cost model starts from);
- colocate_1x2: every role on 1 worker of 2 threads;
- fsdp_2x1: as colocate_2x1, with FSDP sharding the models over the 2 workers (engine.fsdp_size=-1:
  parameters gathered per pass, gradients reduce-scattered) instead of each worker holding them whole;
- split_1+1: the actor on one worker, the critic on the other (ppo only: grpo has no second role);
- tp2: colocate on 2 workers, actor / critic / rollout tensor-parallel over both (refused for models whose
  heads 2 does not divide, e.g. SmolLM2's 9 / 3: skipped with the reason);
- sp2: colocate on 2 workers, actor / critic Ulysses sequence-parallel over both (generation: dp 2).
The cost model (planner/cost.py) predicts each plan's step time from the calibration profile, a
device profile (`hybridflow profile`: thread speedups, gloo all-reduce costs; measured first unless
--device-profile names one) and the model's sizes. Printed: predicted and measured s/step per plan,
Kendall tau between them, the largest relative error, and whether the predicted best is the measured
best (bars: tau >= 0.8, error <= 25%, same best). The calibration plan's prediction fits by construction
except for its controller share; the other plans are true predictions.

    .venv/bin/python bench/plans.py --tiny --steps 2          # smoke: tiny random model, seconds per run
    .venv/bin/python bench/plans.py --steps 7 --warmup 3 --response-length 64 --batch 8 --keep runs/plans   # ~35 min
    .venv/bin/python bench/plans.py --jobs grpo --rounds 2 --steps 7 --warmup 3 --response-length 64 --batch 8
    .venv/bin/python bench/plans.py --replay runs/plans --steps 7 --warmup 3 --response-length 64 --batch 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PLANS = {  # name -> (overrides, threads per worker)
    "colocate_2x1": (["trainer.placement=colocate", "trainer.n_workers_per_node=2", "trainer.cpus_per_worker=1"], 1),
    "colocate_1x2": (["trainer.placement=colocate", "trainer.n_workers_per_node=1", "trainer.cpus_per_worker=2"], 2),
    "fsdp_2x1": (
        [
            "trainer.placement=colocate",
            "trainer.n_workers_per_node=2",
            "trainer.cpus_per_worker=1",
            "actor.engine.fsdp_size=-1",
            "critic.engine.fsdp_size=-1",
        ],
        1,
    ),
    "split_1+1": (["trainer.placement=split", "trainer.n_workers_per_node=2", "trainer.cpus_per_worker=1"], 1),
    "tp2": (
        [
            "trainer.placement=colocate",
            "trainer.n_workers_per_node=2",
            "trainer.cpus_per_worker=1",
            "actor.engine.tensor_parallel_size=2",
            "critic.engine.tensor_parallel_size=2",
            "rollout.tensor_model_parallel_size=2",
        ],
        1,
    ),
    "sp2": (
        [
            "trainer.placement=colocate",
            "trainer.n_workers_per_node=2",
            "trainer.cpus_per_worker=1",
            "actor.engine.ulysses_sequence_parallel_size=2",
            "critic.engine.ulysses_sequence_parallel_size=2",
        ],
        1,
    ),
}
JOBS = {"grpo": [], "ppo": ["algorithm.adv_estimator=gae"]}


def job_args(args: argparse.Namespace, job: str, tmp: Path) -> list[str]:
    """The job's overrides (main job or tiny variant, with the bench's size options)."""
    # ignore_eos: every response runs to max_response_length, so every plan does the same work step for step
    # (with EOS the sampled lengths differ by plan and step, by 5-15% of the tokens, which is noise here)
    out = [
        *JOBS[job],
        "trainer.logger=[console,jsonl]",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={args.steps}",
        "rollout.ignore_eos=true",
    ]
    if args.response_length:
        out.append(f"data.max_response_length={args.response_length}")
    if args.batch:
        out += [
            f"data.train_batch_size={args.batch}",
            f"actor.ppo_mini_batch_size={args.batch}",
            f"critic.ppo_mini_batch_size={args.batch}",
        ]
    if args.tiny:
        from hybridflow.models import tiny_model_dir

        out += [
            f"model.path={tiny_model_dir('llama')}",
            f"data.task_dir={tmp / 'data'}",
            "data.gen_train_size=64",
            "data.gen_val_size=4",
            "rollout.n=2",
            "actor.ppo_micro_batch_size_per_device=2",
            "critic.ppo_micro_batch_size_per_device=2",
        ]
    return out + args.overrides


def plan_of(name: str, roles: tuple[str, ...]):
    """The planner's Plan for a bench plan on 2 workers."""
    from hybridflow.planner.plans import PlacementSet, Plan, RoleParallel

    if name == "split_1+1":
        sets = (PlacementSet(("actor_rollout",), 1), PlacementSet(roles[1:], 1))
        return Plan(sets, tuple((r, RoleParallel(1)) for r in roles))
    devices, par = {
        "colocate_2x1": (2, RoleParallel(2)),
        "colocate_1x2": (1, RoleParallel(1)),
        "fsdp_2x1": (2, RoleParallel(2)),
        "tp2": (2, RoleParallel(1, tp=2)),
        "sp2": (2, RoleParallel(1, sp=2)),
    }[name]
    return Plan((PlacementSet(roles, devices),), tuple((r, par) for r in roles))


def train(name: str, overrides: list[str], out: Path, replay: bool = False) -> list[dict] | None:
    """Run one plan; its training-step records, or None when the run refused its config at resolve
    (e.g. a tp size the model's heads do not allow; the reason is printed). Any other failure aborts.
    `replay`: read the records an earlier run of the bench left in `out` (--keep) instead of running."""
    logs = out / "logs"
    if replay:
        return _step_records(logs) if (logs / "metrics.jsonl").exists() else None
    out.mkdir(parents=True)
    env = {**os.environ, "HYBRIDFLOW_NO_PROGRESS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli.train",
        *overrides,
        f"trainer.log_dir={logs}",
        f"trainer.default_local_dir={out / 'ckpt'}",
        f"trainer.experiment_name={name}",
    ]
    with (out / "console.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        lines = (out / "console.log").read_text().strip().splitlines()
        if proc.returncode == 2 and lines:  # the CLI's exit code for a refused config
            print(f"{name}: refused ({lines[-1]})", flush=True)
            return None
        sys.exit(f"{name} failed ({proc.returncode}); see {out / 'console.log'}")
    return _step_records(logs)


def _step_records(logs: Path) -> list[dict]:
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "timing_s/step" in r]


def kendall_tau(a: list[float], b: list[float], tied: set[tuple[int, int]] = frozenset()) -> float:
    """Kendall's tau-a between two equally long lists: (concordant - discordant) / pairs. With `tied` (pairs
    (i, j), i < j, that `b` cannot order) those pairs are left out of both counts: Goodman and Kruskal's
    gamma over the pairs `b` orders (1.0 when it orders none)."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a)) if (i, j) not in tied]
    if not pairs:
        return 1.0
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return score / len(pairs)


def unseparated(steps: list[list[float]], z: float = 2.0) -> set[tuple[int, int]]:
    """Pairs of plans (i < j) whose measured medians differ by less than `z` standard errors of the
    difference (each plan's s.e.: the stdev of its timed steps / sqrt(their number)): the measurement does
    not order them."""
    se = [statistics.stdev(s) / math.sqrt(len(s)) if len(s) > 1 else 0.0 for s in steps]
    med = [statistics.median(s) for s in steps]
    return {
        (i, j)
        for i in range(len(steps))
        for j in range(i + 1, len(steps))
        if abs(med[i] - med[j]) < z * math.hypot(se[i], se[j])
    }


def predict(name: str, cfg, calib: list[dict], device, threads: int) -> float:
    """The cost model's step time of plan `name` from the calibration run's steps (after the warm-up)."""
    from dataclasses import asdict, replace

    from hybridflow.config.plan_inputs import fsdp_sharded, run_roles, run_shape
    from hybridflow.models.loading import load_config as load_model_config
    from hybridflow.planner.auto import run_workers
    from hybridflow.planner.cost import costs_from_profile, predict_step_time, without_dp_sync
    from hybridflow.planner.inputs import forward_ops
    from hybridflow.planner.profile import build_profile
    from hybridflow.planner.search import model_params

    rows = [asdict(p) for p in build_profile(calib)]
    by = {r["metric"]: r for r in rows}
    tokens, response = by["timing_s/step"]["tokens_per_step"], by["timing_s/gen"]["tokens_per_step"]
    calib_cfg = replace(cfg, trainer=replace(cfg.trainer, n_workers_per_node=2, placement="colocate"))
    mc = load_model_config(cfg.model.path)
    w = run_workers(
        run_shape(cfg),
        device,
        threads,
        1,
        model_params(cfg.model.path),
        layers=mc.num_hidden_layers,
        hidden=mc.hidden_size,
        activation_bytes=4,
        decode_steps=cfg.data.max_response_length,
    )
    calib_w = replace(
        w,
        sharded=fsdp_sharded(
            replace(calib_cfg, actor=replace(cfg.actor, engine=replace(cfg.actor.engine, fsdp_size=None)))
        ),
    )  # colocate_2x1: the engine's default
    costs = without_dp_sync(costs_from_profile(rows, 2, forward_ops(run_shape(calib_cfg))), 2, tokens, calib_w)
    return predict_step_time(plan_of(name, run_roles(cfg)), costs, tokens, response, w)


def bench_job(args: argparse.Namespace, job: str, tmp: Path, device) -> list[tuple[str, float, float, list[float]]]:
    """(plan, predicted s, measured s, timed step times) for every plan of `job` that its config accepts.

    With --rounds R every plan runs R times, the order reversed every other round (A B C, C B A, ...), and
    each plan's timed steps are pooled: the machine's speed drifts by more than the plans differ over the
    minutes a round takes (sp2 measured 17% slower than colocate_2x1 in one bench, 3% faster in the next),
    and alternating orders cancel a steady drift."""
    from hybridflow.config.run import RunConfig
    from hybridflow.utils.config_loader import load_config

    base = job_args(args, job, tmp)
    cfgs = {}
    for name in [p for p in args.plans.split(",") if p in PLANS]:
        try:
            cfgs[name] = load_config(RunConfig, None, base + PLANS[name][0])
        except ValueError as err:
            print(f"{job} {name}: refused by the config ({err})", flush=True)
    timed: dict[str, list[dict]] = {name: [] for name in cfgs}
    for r in range(args.rounds):
        for name in list(timed) if r % 2 == 0 else list(timed)[::-1]:
            run_dir = tmp / job / (name if r == 0 else f"{name}.r{r}")
            records = train(f"{job}-{name}", base + PLANS[name][0], run_dir, replay=bool(args.replay))
            if records is None:  # refused at resolve (first round): not a plan of this job
                del timed[name]
                continue
            timed[name] += records[args.warmup :] or records
    calib = next(iter(timed.values()))  # the first plan (colocate_2x1) calibrates the rest
    out = []
    for name, records in timed.items():
        steps = [rec["timing_s/step"] for rec in records]
        out.append((name, predict(name, cfgs[name], calib, device, PLANS[name][1]), statistics.median(steps), steps))
        print(f"{job} {name}: predicted {out[-1][1]:.2f} s, measured {out[-1][2]:.2f} s", flush=True)
    return out


def report(job: str, results: list[tuple[str, float, float, list[float]]]) -> None:
    """The per-plan table and the three bars; tau both over all pairs and over the pairs the measurement
    orders (medians more than 2 standard errors apart)."""
    print(f"\n{job}: {'plan':<14}{'predicted s':>12}{'measured s':>12}{'error':>8}{'s.e. s':>8}")
    for name, p, m, steps in results:
        se = statistics.stdev(steps) / math.sqrt(len(steps)) if len(steps) > 1 else 0.0
        print(f"{'':<{len(job) + 2}}{name:<14}{p:>12.2f}{m:>12.2f}{(p - m) / m:>+8.0%}{se:>8.2f}")
    pred, meas = [r[1] for r in results], [r[2] for r in results]
    ties = unseparated([r[3] for r in results])
    worst = max(abs(p - m) / m for p, m in zip(pred, meas))
    same = min(results, key=lambda r: r[1])[0] == min(results, key=lambda r: r[2])[0]
    n = len(results) * (len(results) - 1) // 2
    print(
        f"  Kendall tau {kendall_tau(pred, meas):.2f} over all {n} pairs (bar 0.8); "
        f"{kendall_tau(pred, meas, ties):.2f} over the {n - len(ties)} pair(s) the measurement orders (medians "
        f"more than 2 s.e. apart; within: {', '.join(f'{results[i][0]}~{results[j][0]}' for i, j in sorted(ties)) or 'none'})"
    )
    print(f"  max relative error {worst:.0%} (bar 25%), predicted best {'==' if same else '!='} measured best")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random model: proves every plan runs")
    parser.add_argument("--steps", type=int, default=3, help="steps per plan, the first --warmup untimed")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed steps per plan (SmolLM2's second step is still ~40%% slow: use 2)",
    )
    parser.add_argument("--response-length", type=int, help="data.max_response_length (default: the job's)")
    parser.add_argument("--batch", type=int, help="data.train_batch_size = ppo_mini_batch_size (default: the job's)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every plan this many times, alternating the order, and pool their steps",
    )
    parser.add_argument("--jobs", default="grpo,ppo")
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated; colocate_2x1 must come first")
    parser.add_argument(
        "--profile-repeats",
        type=int,
        default=3,
        help="interleaved rounds of the device profile (each point: best over the rounds)",
    )
    parser.add_argument(
        "--profile-shape", help="ROWSxTOKENS of the device profile's point (default 8 x the runs' rows)"
    )
    parser.add_argument("--device-profile", help="a `hybridflow profile` JSON to use instead of measuring one")
    parser.add_argument("--keep", help="keep the runs and the device profile in this directory (for --replay)")
    parser.add_argument("--replay", help="no runs: predict again from the runs and device profile --keep left here")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    from hybridflow.planner.device import DeviceProfile
    from hybridflow.planner.measure import profile_device
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(2), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-plans-") as tmp_name:
        tmp = Path(args.replay or args.keep or tmp_name)
        saved = tmp / "device_profile.json"
        if args.device_profile or args.replay:
            device = DeviceProfile.load(Path(args.device_profile or saved))
        else:
            from hybridflow.config.run import RunConfig
            from hybridflow.utils.config_loader import load_config

            cfg = load_config(RunConfig, None, job_args(args, "grpo", tmp))
            from hybridflow.config.measure import profile_dtype
            from hybridflow.models import resolve_model_path

            # one update micro-batch of the runs: its rows of a response plus the task's prompt (the arithmetic
            # prompts are 44-46 tokens: metrics prompt_length/mean); thread speedups grow with the rows
            rows_len = (cfg.actor.ppo_micro_batch_size_per_device, cfg.data.max_response_length + 46)
            shapes = (
                [(2, 32)]
                if args.tiny
                else [tuple(int(x) for x in args.profile_shape.split("x")) if args.profile_shape else rows_len]
            )
            # decode as the layouts do: the batch's rows over 2 cores (32 rows at 1 thread, 64 at 2)
            device = profile_device(
                str(resolve_model_path(cfg.model.path)),
                (1, 2),
                shapes,
                dtype=profile_dtype(cfg, 1),
                repeats=args.profile_repeats,
                decode_rows_per_thread=cfg.data.train_batch_size * cfg.rollout.n // 2,
            )
            print(
                f"device profile ({device.dtype}): "
                + ", ".join(f"{k} x{device.speedup(k, 2):.2f}" for k in ("forward", "train", "decode"))
                + " at 2 threads; "
                f"all-reduce {device.allreduce_latency_s * 1e6:.0f} us + {device.allreduce_s_per_byte * 1e9:.2f} s/GB",
                flush=True,
            )
            if args.keep:
                tmp.mkdir(parents=True, exist_ok=True)
                device.save(saved)
        results = {job: bench_job(args, job, tmp, device) for job in args.jobs.split(",")}
    for job, rows in results.items():
        report(job, rows)


if __name__ == "__main__":
    main()
