"""What checking a checkpoint costs: the manifest check (SHA-256 of every file) against the whole load.

Saves one engine checkpoint (model + Adam state) of the chosen model, then, in alternation, times the check
alone (`checkpoint_files.damage`) and the full `load_checkpoint` (which runs the check on rank 0, reads the DCP
index through the restricted unpickler and the shards with weights_only); prints both and their ratio.

    .venv/bin/python bench/checkpoint_integrity.py                  # the tiny test model
    .venv/bin/python bench/checkpoint_integrity.py --model default  # SmolLM2-135M (~1.6 GB checkpoint)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (the llama test model), 'default' or a path")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from hybridflow.utils.hardware import describe_cpu

    print(describe_cpu(os.cpu_count() or 2), flush=True)
    from hybridflow.engine import EngineConfig, FSDPEngine, OptimConfig
    from hybridflow.engine import checkpoint_files as F
    from hybridflow.models import resolve_model_path, tiny_model_dir

    path = tiny_model_dir("llama") if args.model == "tiny" else resolve_model_path(args.model)
    engine = FSDPEngine.from_pretrained(path, EngineConfig(param_dtype="fp32"), OptimConfig(lr=1e-5))
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ckpt = engine.save_checkpoint(Path(tmp) / "global_step_1", extra={"update_calls": 1})
        save_s = time.perf_counter() - start
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        check, load = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            assert F.damage(ckpt) is None
            check.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.load_checkpoint(ckpt)
            load.append(time.perf_counter() - start)
    c, full = statistics.median(check), statistics.median(load)
    print(f"model {path}: checkpoint {size / 1e6:.1f} MB, save {save_s:.2f} s (hashes included)")
    print(f"manifest check {c:.3f} s ({size / 1e9 / c:.2f} GB/s), full load {full:.3f} s (check included)")
    print(f"check / load = {c / full:.2f} (median of {args.repeats})")


if __name__ == "__main__":
    main()
