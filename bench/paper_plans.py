"""The plans the placement search picks for the HybridFlow paper's PPO settings, on named GPU specs.

PPO with actor, critic, reference and reward model of one Llama size (7B/13B/34B/70B) on 16-128 GPUs
(8 per node), 1024 prompts of 1024 tokens, 1024-token responses. For each setting: the best plan
(planner/gpu_search.py), the paper's baseline placements (colocate, split, standalone) and their
predicted slow-down against the best, and trainer.mode=one_step_off's predicted step (issue 17: the
rollout on its own GPUs, overlapping training). Predictions from the analytic roofline model of
planner/gpu.py (assumed efficiencies), not measurements: nothing here ran on a GPU.

    .venv/bin/python bench/paper_plans.py [--spec a100-80gb] [--gpus 16,32,64,128]   # ~2 s
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridflow.planner.gpu import SHAPES, SPECS, RLWorkload  # noqa: E402
from hybridflow.planner.gpu_search import evaluate, named_placements, one_step_off, search  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="a100-80gb", choices=sorted(SPECS))
    parser.add_argument("--gpus", default="16,32,64,128")
    parser.add_argument("--shapes", default="llama-7b,llama-13b,llama-34b,llama-70b")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=1024)
    args = parser.parse_args()
    spec = SPECS[args.spec]
    work = RLWorkload(args.prompts, args.prompt_len, args.response_len)
    print(
        f"spec {spec.name}: {spec.bf16_flops / 1e12:.0f} TFLOP/s bf16, {spec.memory_bytes / 1e9:.0f} GB, "
        f"HBM {spec.hbm_bytes_per_s / 1e12:.2f} TB/s, NVLink {spec.intra_node_bytes_per_s / 1e9:.0f} GB/s, "
        f"network {spec.inter_node_bytes_per_s / 1e9:.0f} GB/s per GPU; {work.prompts} prompts x "
        f"{work.prompt_len}+{work.response_len} tokens"
    )
    print(
        f"{'model':10} {'GPUs':>4} {'plans':>5} {'best s/step':>11}  {'colocate':>8} {'split':>6} {'standalone':>10} "
        f"{'1-step-off':>10}  best plan"
    )
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for n in (int(g) for g in args.gpus.split(",")):
            ranked = search(shape, work, spec, n)
            if not ranked:
                print(f"{name:10} {n:>4} {0:>5} {'-':>11}  nothing fits ({shape.params / 1e9:.0f}B x 4 roles)")
                continue
            best = ranked[0]

            def rel(plan, best=best) -> str:
                return f"{plan.step_s / best.step_s:.2f}x" if plan else "-"

            named = {
                k: evaluate(blocks, sizes, shape, work, spec)
                for k, (blocks, sizes) in named_placements(n, spec).items()
            }
            off = one_step_off(shape, work, spec, n)
            off_s = f"{best.step_s / off[0]:.2f}x" if off else "-"
            print(
                f"{name:10} {n:>4} {len(ranked):>5} {best.step_s:>11.1f}  {rel(named.get('colocate')):>8} "
                f"{rel(named.get('split')):>6} {rel(named.get('standalone')):>10} {off_s:>10}  {best.describe()}"
            )
    print(
        "colocate/split/standalone: predicted step time relative to the best plan (1.00x = it is the best); "
        "1-step-off: predicted speedup of trainer.mode=one_step_off over the best synchronous plan"
    )


if __name__ == "__main__":
    main()
