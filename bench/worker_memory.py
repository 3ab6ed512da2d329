"""Memory of the 1x2 worker's cycle (generate -> actor update), phase by phase, in one process without Ray.

The shapes of bench/vs_trl.py's 8-completion run (2 prompts x 4 samples, 64 + 32 tokens, SmolLM2 fp32): the
engine and the native rollout built as the worker builds them (the rollout shares the engine's tensors), random
prompts. At each mark it prints RSS, the RSS high-water since the previous mark (VmHWM, reset at each mark),
malloc's bytes in use (glibc mallinfo2: heap in use + mmapped chunks) and the highest in-use figure sampled every
millisecond since the previous mark, in MiB. Linux + glibc only.

    PYTHONPATH=. python bench/worker_memory.py [--steps 2] [--phases] [--trim] [--gradient-checkpointing]
        [--no-keep-freed]

--phases: marks inside the update (after forward, after backward, after the optimizer step); --trim: malloc_trim
after each operator (what RSS is left once freed heap memory is handed back). --no-keep-freed: glibc's thresholds
as the environment sets them (MALLOC_MMAP_THRESHOLD_=...), not hybridflow.utils.memory's; with another malloc
preloaded (LD_PRELOAD) the in-use columns read 0 (mallinfo2 counts glibc's heap only).
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import torch

from hybridflow.engine.config import EngineConfig, OptimConfig
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rollout import build_rollout
from hybridflow.rollout.config import RolloutConfig
from hybridflow.rollout.sync import share_engine_weights
from hybridflow.utils.memory import release_freed_memory
from hybridflow.workers.engines import build_engine

_libc = ctypes.CDLL("libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


_libc.mallinfo2.restype = _MallInfo2
_peak = [0.0]


def _in_use_mib() -> float:
    mi = _libc.mallinfo2()
    return (mi.uordblks + mi.hblkhd) / 2**20


def _sample_in_use() -> None:
    while True:
        _peak[0] = max(_peak[0], _in_use_mib())
        time.sleep(0.001)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))


def mark(label: str, trim: bool = False) -> None:
    """Print the figures since the previous mark, then reset the high-water marks."""
    if trim:
        release_freed_memory()
    rss, hwm = _status_mib("VmRSS:"), _status_mib("VmHWM:")
    print(
        f"{label:28s} rss {rss:6.0f} hwm {hwm:6.0f} in_use {_in_use_mib():6.0f} in_use_peak {_peak[0]:6.0f}", flush=True
    )
    _peak[0] = 0.0
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _instrument(engine, trim: bool) -> None:
    fwd, opt = engine.forward_micro_batch, engine._optimizer_step

    def forward(*a, **k):
        mark("  (update starts)", trim)
        out = fwd(*a, **k)
        mark("  forward")
        return out

    def optimizer_step(*a, **k):
        mark("  backward")
        out = opt(*a, **k)
        mark("  optimizer step")
        return out

    engine.forward_micro_batch, engine._optimizer_step = forward, optimizer_step


def _loss(out, micro):
    mask = micro[K.RESPONSE_MASK]
    return -(out["log_probs"] * mask).sum() / mask.sum() + 0 * out["entropy"].sum(), {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--phases", action="store_true")
    p.add_argument("--trim", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--no-keep-freed", action="store_true", help="leave glibc's malloc thresholds to the environment")
    args = p.parse_args()
    torch.set_num_threads(2)
    threading.Thread(target=_sample_in_use, daemon=True).start()
    path = resolve_model_path("default")
    mark("start")
    engine = build_engine(
        path,
        EngineConfig(
            param_dtype="fp32",
            gradient_checkpointing=args.gradient_checkpointing,
            cpu_keep_freed_memory=not args.no_keep_freed,
        ),
        OptimConfig(),
    )
    rollout = build_rollout(
        RolloutConfig(prompt_length=64, response_length=32, n=4, dtype="fp32"), path, load_tokenizer(path)
    )
    if share_engine_weights(rollout, engine):
        release_freed_memory()
    mark("built")
    if args.phases:
        _instrument(engine, args.trim)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        ids = torch.randint(100, 20000, (2, 64), generator=g)
        pos = torch.arange(64).expand(2, 64).clone()
        prompts = DataProto.from_dict({K.INPUT_IDS: ids, K.ATTENTION_MASK: torch.ones_like(ids), K.POSITION_IDS: pos})
        start = time.perf_counter()
        out = rollout.generate_sequences(prompts)
        mark(f"generate {step} ({time.perf_counter() - start:.1f} s)", args.trim)
        micro = {k: v.clone() for k, v in out.batch.items()}  # inference tensors -> autograd-usable
        start = time.perf_counter()
        engine.train_step([micro], _loss, calc_entropy=True)
        mark(f"update {step} ({time.perf_counter() - start:.1f} s)", args.trim)


if __name__ == "__main__":
    main()
