"""Actor update step on SmolLM2-135M: achieved FLOP/s next to a bf16 matmul measured in the same run.

One training step = forward + backward + AdamW step of FSDPEngine.train_step on a
batch of `--batch` rows x `--seq` tokens (prompt + response, no padding), loss =
token-mean of -log p(response). Achieved FLOP/s = 6 * params * tokens / step time
(the usual dense-training count; it includes the LM head on prompt tokens, which the
engine skips, so it slightly overstates the work done — see the printout).

With `--lora-rank R` the same batch is then timed on a LoRA engine (adapters of rank R on
every linear layer), and the full-update / LoRA-update step-time ratio is printed.

With `--layout dp|tp|sp|pp --ranks N` the same global batch is timed on N gloo processes of
`--threads` threads each: dp splits the rows over the ranks (FSDP2), tp splits every decoder
layer (tensor_parallel_size=N), sp splits every micro-batch's packed tokens (Ulysses,
ulysses_sequence_parallel_size=N), pp splits the decoder layers into N stages that run the
micro-batches as a pipeline (pipeline_model_parallel_size=N; one micro-batch, the default
`--micro 8`, leaves one stage idle while the other runs: `--micro 2` gives the schedule 4).
Steps are timed on every rank; a step counts as its slowest rank's. Each rank's peak RSS over
the warm-up and timed steps (the high-water mark reset after the engine is built) is printed.

    .venv/bin/python bench/train_step.py            # defaults: 8 x 256, bf16, 2 threads
    .venv/bin/python bench/train_step.py --lora-rank 8 --lora-alpha 16
    .venv/bin/python bench/train_step.py --layout sp --ranks 2 --threads 1
    .venv/bin/python bench/train_step.py --layout pp --ranks 2 --threads 1 --micro 2

With `--profile` one more step is run under torch.profiler and FlopCounterMode: the ops with the most
self time, and the GEMMs' (aten::mm / bmm) FLOPs, time and rate beside the matmul figure, i.e. how much
of a step is GEMM work and how close to the machine's GEMM peak it runs.
    .venv/bin/python bench/train_step.py --batch 32 --seq 80 --response 32 --micro 16 --profile
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from hybridflow.engine import EngineConfig, FSDPEngine, LoraConfig, OptimConfig
from hybridflow.models import default_model_dir
from hybridflow.protocol import keys
from hybridflow.utils.hardware import describe_cpu, matmul_gflops
from hybridflow.utils.peak_memory import operator_peak


def make_batch(rows: int, prompt_len: int, resp_len: int) -> dict[str, torch.Tensor]:
    """A full (unpadded) batch of random token ids."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (rows, prompt_len + resp_len), generator=g)
    mask = torch.ones_like(ids)
    return {
        keys.INPUT_IDS: ids,
        keys.ATTENTION_MASK: mask,
        keys.POSITION_IDS: mask.cumsum(-1) - 1,
        keys.RESPONSES: ids[:, prompt_len:],
    }


def token_mean_nll(total_tokens: int):
    """-sum(log p) / total_tokens per micro-batch (global-token normalisation, one rank)."""

    def loss_fn(out, micro):
        mask = micro[keys.ATTENTION_MASK][:, -micro[keys.RESPONSES].shape[1] :]
        return -(out["log_probs"] * mask).sum() / total_tokens, {}

    return loss_fn


def time_steps(engine: FSDPEngine, micro: list[dict], loss_fn, steps: int) -> tuple[list[float], dict]:
    """Step times of `steps` train steps after one warm-up step (allocations, oneDNN kernel selection)."""
    engine.train_step(micro, loss_fn)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = engine.train_step(micro, loss_fn)
        times.append(time.perf_counter() - t0)
    return times, metrics


def build_engine(args, lora: LoraConfig | None = None) -> FSDPEngine:
    """SmolLM2-135M on a one-rank FSDP2 engine with the flags' dtype and checkpointing."""
    config = EngineConfig(param_dtype=args.dtype, gradient_checkpointing=args.gc)
    return FSDPEngine.from_pretrained(default_model_dir(), config, OptimConfig(lr=1e-5), lora=lora)


LAYOUT_KEYS = {
    "tp": "tensor_parallel_size",
    "sp": "ulysses_sequence_parallel_size",
    "pp": "pipeline_model_parallel_size",
}
"""--layout -> the EngineConfig field set to --ranks (dp sets none)."""


def _layout_rank(rank: int, args, port: int, out_dir: str) -> None:
    """One rank of a --layout run: its share of the batch, timed steps saved to out_dir."""
    from hybridflow.workers.engines import build_engine as build

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(args.threads)
    extra = {LAYOUT_KEYS[args.layout]: args.ranks} if args.layout in LAYOUT_KEYS else {}
    config = EngineConfig(param_dtype=args.dtype, gradient_checkpointing=args.gc, **extra)
    engine = build(default_model_dir(), config, OptimConfig(lr=1e-5))
    dp = config.dp_size(args.ranks)
    rows = args.batch // dp
    data = {
        k: v[rank // (args.ranks // dp) * rows :][:rows]
        for k, v in make_batch(args.batch, args.seq - args.response, args.response).items()
    }
    micro = [{k: v[i : i + args.micro] for k, v in data.items()} for i in range(0, rows, args.micro)]
    base = token_mean_nll(args.batch * args.response)
    peak: dict[str, float] = {}
    with operator_peak("steps", peak):
        times, metrics = time_steps(engine, micro, lambda out, m: (base(out, m)[0] * dp, {}), args.steps)
    result = {"times": times, "metrics": metrics, "peak_gb": peak["memory/peak_gb/steps"]}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_layout(args) -> None:
    """Time --steps train steps on --ranks processes laid out as --layout; print the slowest rank's times."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_layout_rank, args=(args, port, tmp), nprocs=args.ranks, join=True)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(args.ranks)]
    times = [max(step) for step in zip(*(r["times"] for r in ranks))]
    # dp: each rank's loss is its rows' share x dp, so the mean over ranks is the batch's; tp / sp / pp ranks agree
    m = {k: sum(r["metrics"][k] for r in ranks) / len(ranks) for k in ("loss", "grad_norm")}
    tokens = args.batch * args.seq
    print(describe_cpu(args.threads))
    print(
        f"layout {args.layout} x {args.ranks} ranks x {args.threads} threads  batch {args.batch}x{args.seq} "
        f"({args.response} response tokens/row)  micro-batch {args.micro}  compute {args.dtype}  gc {args.gc}"
    )
    print(
        f"step time  best {min(times):.2f} s  mean {sum(times) / len(times):.2f} s  over {len(times)} steps  "
        f"(slowest rank; loss {m['loss']:.3f}, grad_norm {m['grad_norm']:.2f}, means over ranks)"
    )
    print(f"tokens/s   {tokens / min(times):.0f} at the best step, {tokens * len(times) / sum(times):.0f} at the mean")
    print(
        "peak RSS   "
        + "  ".join(f"rank {i} {r['peak_gb']:.2f} GB" for i, r in enumerate(ranks))
        + "  (during the steps)"
    )


def main() -> None:
    """Parse flags, time the steps, print step time, FLOP/s and the ratio to the matmul figure."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--response", type=int, default=128, help="response tokens per row (rest is prompt)")
    ap.add_argument("--micro", type=int, default=8, help="micro-batch size")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gc", action="store_true", help="gradient checkpointing")
    ap.add_argument("--lora-rank", type=int, default=0, help="also time a LoRA update of this rank (0: full only)")
    ap.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (updates scaled by alpha / rank)")
    ap.add_argument("--profile", action="store_true", help="also profile one step: top ops, GEMM FLOPs and rate")
    ap.add_argument(
        "--layout",
        choices=["dp", "tp", "sp", "pp"],
        default=None,
        help="time on --ranks gloo processes: rows split (dp), layers split (tp), tokens split (sp), stages (pp)",
    )
    ap.add_argument("--ranks", type=int, default=2, help="processes of a --layout run")
    args = ap.parse_args()
    if args.layout:
        run_layout(args)
        return
    torch.set_num_threads(args.threads)

    engine = build_engine(args)
    params = sum(p.numel() for p in engine.model.parameters())  # global sizes; tied embedding once
    data = make_batch(args.batch, args.seq - args.response, args.response)
    micro = [{k: v[i : i + args.micro] for k, v in data.items()} for i in range(0, args.batch, args.micro)]
    loss_fn = token_mean_nll(args.batch * args.response)
    times, metrics = time_steps(engine, micro, loss_fn, args.steps)
    mm = matmul_gflops(torch.bfloat16 if args.dtype == "bf16" else torch.float32, repeats=10) * 1e9
    print(describe_cpu(args.threads))
    _report(args, params, times, mm, metrics)
    if args.profile:
        profile_step(engine, micro, loss_fn, mm)
    if args.lora_rank > 0:
        del engine  # one model in memory at a time
        lora = build_engine(args, LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha))
        lora_times, lora_metrics = time_steps(lora, micro, loss_fn, args.steps)
        trainable = sum(p.numel() for p in lora.model.parameters() if p.requires_grad)
        _report_lora(args, trainable / params, times, lora_times, lora_metrics)


def _report(args, params: int, times: list[float], mm: float, metrics: dict) -> None:
    tokens = args.batch * args.seq
    best = min(times)
    achieved = 6 * params * tokens / best
    print(
        f"model params {params:,}  batch {args.batch}x{args.seq} ({args.response} response tokens/row)  "
        f"micro-batch {args.micro}  compute {args.dtype}  threads {args.threads}  gc {args.gc}"
    )
    print(
        f"step time  best {best:.2f} s  mean {sum(times) / len(times):.2f} s  over {len(times)} steps  "
        f"(loss {metrics['loss']:.3f}, grad_norm {metrics['grad_norm']:.2f})"
    )
    print(f"achieved   {achieved / 1e9:.0f} GFLOP/s  (6 * params * tokens / best step time)")
    print(f"matmul     {mm / 1e9:.0f} GFLOP/s  ({args.dtype} 2048^3, best of 10, same run)")
    mean_achieved = 6 * params * tokens / (sum(times) / len(times))
    print(f"ratio      {achieved / mm:.1%} at the best step, {mean_achieved / mm:.1%} at the mean step  (bar: >= 40%)")


def profile_step(engine: FSDPEngine, micro: list[dict], loss_fn, mm: float, top: int = 8) -> None:
    """One step under torch.profiler (op self times) and one under FlopCounterMode (GEMM FLOPs): where the
    step's time goes, and the GEMMs' achieved rate against the matmul figure `mm` (FLOP/s)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        engine.train_step(micro, loss_fn)
    flops = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.train_step(micro, loss_fn)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    print(f"profiled step {total:.2f} s of op self time; top ops:")
    for e in ops[:top]:
        print(
            f"  {e.key:<28} {e.self_cpu_time_total / 1e6:6.2f} s  {e.self_cpu_time_total / 1e6 / total:5.1%}  "
            f"{e.count} calls"
        )
    gemm_s = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm", "aten::bmm")) / 1e6
    gemm_flops = sum(n for op, n in flops.items() if op in ("mm", "bmm"))
    print(
        f"GEMMs      {gemm_flops / 1e12:.3f} TFLOP in {gemm_s:.2f} s = {gemm_flops / gemm_s / 1e9:.0f} GFLOP/s, "
        f"{gemm_flops / gemm_s / mm:.0%} of the matmul figure; at 100% they would take {gemm_flops / mm:.2f} s"
    )


def _report_lora(args, trainable_fraction: float, full: list[float], lora: list[float], metrics: dict) -> None:
    print(
        f"lora       rank {args.lora_rank} alpha {args.lora_alpha:g} on all linear layers, "
        f"{trainable_fraction:.2%} of the params trainable"
    )
    print(
        f"lora step  best {min(lora):.2f} s  mean {sum(lora) / len(lora):.2f} s  over {len(lora)} steps  "
        f"(loss {metrics['loss']:.3f}, grad_norm {metrics['grad_norm']:.2f})"
    )
    print(
        f"full/lora  {min(full) / min(lora):.2f}x at the best step, "
        f"{sum(full) / sum(lora):.2f}x at the mean step (same batch, same run)"
    )


if __name__ == "__main__":
    main()
