"""How fast a decode step's products read their weights, and what torch's weight-only low-precision kernels give.

Run: .venv/bin/python bench/decode_weights.py [--rows 8 32] [--repeats 5] [--repack [--pairs]]

A decode step runs every layer's four products (fused q/k/v, o, fused gate/up, down) on a few rows, so each
weight comes from memory once per step (SmolLM2-135M: 30 layers, 424 MB in fp32, more than any cache). For
SmolLM2's shapes and random weights, one sweep over the 30 layers' products is timed (median of `repeats`) as:
- `fp32 F.linear`: torch's fp32 product (MKL);
- `fp32 oneDNN packed`: the product on weights reordered once (rollout/native/linear.py's "packed");
- `fp32 panels`: hybridflow's kernel on 16-column panels (rollout/native/panel.py; rollout/native/linear.py's "panels"), the
  AVX-512 build where torch runs AVX-512, else the AVX2 one;
- `fp32 panels, AVX2 build`: where the line above is the AVX-512 build, the AVX2 build on the same panels;
- `bf16 panels, fp32 math`: the same kernel on the weights rounded to bf16 (rollout.weight_dtype=bf16);
- `bf16 oneDNN packed`: oneDNN's bf16 product on bf16 inputs, weights reordered once (a bf16 model's "packed");
- `bf16 pair panels, bf16 products`: `panel.DOT` (AVX512-BF16 CPUs only): bf16 products with fp32 sums on panels
  of column pairs, fp32 inputs rounded to bf16 (a bf16 model's "bf16_dot");
- `int8 weight-only, fp32 in` / `bf16 in`: `aten._weight_int8pack_mm` (one scale per output row);
- `int4 weight-only, fp32 in`: `aten._weight_int4pack_mm_for_cpu` (groups of 64);
- `stream read fp32` / `stream read bf16`: a sum over the same weights, no product: how fast this CPU streams
  them (the floor a product bound by weight reads would reach).
Each line gives the sweep's time and the weight bytes it read per second.

`--repack`: the layout change the decoder makes per generate call, for the 30 layers and the LM head
(49152 x 576): torch's strided copy into panels against panel.c's tiled transpose (`panel.to_panels`), every
panel kept until the sweep ends (as the decoder holds them), with a worker's malloc settings (utils/memory.py);
with `--pairs`, bf16 weights into panels of column pairs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from decode_profile import median_ms  # bench/decode_profile.py, beside this file

from hybridflow.rollout.native import panel
from hybridflow.utils.hardware import describe_cpu
from hybridflow.utils.memory import keep_freed_memory

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""SmolLM2-135M's fused products: (out, in) features."""
INT4_GROUP = 64


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def int4_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 weights and [groups, out, 2] (scale, zero) as `_weight_int4pack_mm_for_cpu` takes them."""
    n, k = w.shape
    g = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.clamp(torch.round((g - low) / scale), 0, 15).to(torch.int32).view(n, k)
    zero = low + 8 * scale
    pairs = torch.stack([scale.view(n, -1), zero.view(n, -1)], dim=-1).transpose(0, 1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), pairs


def sweeps(rows: int) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (one sweep over every layer's products, weight bytes it reads)."""
    weights = [{n: torch.randn(shape) * 0.02 for n, shape in SHAPES.items()} for _ in range(LAYERS)]
    xs = {n: torch.randn(rows, shape[1]) for n, shape in SHAPES.items()}
    fp32_bytes = sum(w.numel() * 4 for layer in weights for w in layer.values())
    packed = [{n: torch.ops.mkldnn._reorder_linear_weight(w, rows) for n, w in layer.items()} for layer in weights]
    int8 = [{n: int8_weights(w) for n, w in layer.items()} for layer in weights]
    int4 = [{n: int4_weights(w) for n, w in layer.items()} for layer in weights]
    panels = [{n: panel.to_panels(w) for n, w in layer.items()} for layer in weights]
    bf16_panels = [{n: panel.to_panels(w, dtype=torch.bfloat16) for n, w in layer.items()} for layer in weights]
    bf16 = [{n: w.bfloat16() for n, w in layer.items()} for layer in weights]
    xs16 = {n: x.bfloat16() for n, x in xs.items()}
    packed16 = [{n: torch.ops.mkldnn._reorder_linear_weight(w, rows) for n, w in layer.items()} for layer in bf16]
    dot = panel.kernel(panel.DOT)
    pairs = [{n: panel.to_panels(w, dtype=torch.bfloat16, pairs=True) for n, w in layer.items()} for layer in bf16]
    avx2 = panel._load(panel.FLAGS)[torch.float32] if panel.flags() != panel.FLAGS else None

    def run(per_product: Callable[[str, object], object], held: list[dict]) -> Callable[[], None]:
        return lambda: [per_product(n, w) for layer in held for n, w in layer.items()]

    return {
        "fp32 F.linear": (run(lambda n, w: F.linear(xs[n], w), weights), fp32_bytes),
        "fp32 oneDNN packed": (
            run(lambda n, p: torch.ops.mkldnn._linear_pointwise(xs[n], p, None, "none", [], ""), packed),
            fp32_bytes,
        ),
        "fp32 panels": (run(lambda n, pw: panel.panel_linear(xs[n], pw, None), panels), fp32_bytes),
        **(
            {
                "fp32 panels, AVX2 build": (
                    run(lambda n, pw: panel.panel_linear(xs[n], pw, None, avx2), panels),
                    fp32_bytes,
                )
            }
            if avx2 is not None
            else {}
        ),
        "bf16 panels, fp32 math": (
            run(lambda n, pw: panel.panel_linear(xs[n], pw, None), bf16_panels),
            fp32_bytes // 2,
        ),
        "bf16 oneDNN packed": (
            run(lambda n, p: torch.ops.mkldnn._linear_pointwise(xs16[n], p, None, "none", [], ""), packed16),
            fp32_bytes // 2,
        ),
        **(
            {
                "bf16 pair panels, bf16 products": (
                    run(lambda n, pw: panel.panel_linear(xs[n], pw, None, dot), pairs),
                    fp32_bytes // 2,
                )
            }
            if dot is not None
            else {}
        ),
        "int8 weight-only, fp32 in": (
            run(lambda n, qs: torch.ops.aten._weight_int8pack_mm(xs[n], *qs), int8),
            fp32_bytes // 4,
        ),
        "int8 weight-only, bf16 in": (
            run(lambda n, qs: torch.ops.aten._weight_int8pack_mm(xs16[n], qs[0], qs[1].bfloat16()), int8),
            fp32_bytes // 4,
        ),
        "int4 weight-only, fp32 in": (
            run(lambda n, qs: torch.ops.aten._weight_int4pack_mm_for_cpu(xs[n], qs[0], INT4_GROUP, qs[1]), int4),
            fp32_bytes // 8,
        ),
        "stream read fp32": (run(lambda n, w: w.sum(), weights), fp32_bytes),
        "stream read bf16": (run(lambda n, w: w.sum(), bf16), fp32_bytes // 2),
    }


def repacks(pairs: bool = False) -> tuple[dict[str, Callable[[], None]], int]:
    """name -> one layout change of every layer's weights and the LM head into panels; the bytes they hold.
    `pairs`: bf16 weights into panels of column pairs (a bf16 model's "bf16_dot")."""
    dtype = torch.bfloat16 if pairs else torch.float32
    shapes = [shape for _ in range(LAYERS) for shape in SHAPES.values()] + [(49152, 576)]
    weights = [torch.randn(shape, dtype=dtype) for shape in shapes]

    def strided_copy(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape[0] // panel.PANEL, w.shape[1]
        out = torch.empty(n, k, panel.PANEL, dtype=dtype)
        if pairs:
            out.view(n, k // 2, panel.PANEL, 2).copy_(w.reshape(n, panel.PANEL, k // 2, 2).transpose(1, 2))
        else:
            out.copy_(w.reshape(n, panel.PANEL, k).transpose(1, 2))
        return out

    def tiled(w: torch.Tensor) -> torch.Tensor:
        return panel.to_panels(w, dtype=dtype, pairs=pairs)

    assert torch.equal(tiled(weights[-1]), strided_copy(weights[-1]))
    runs = {"torch strided copy": strided_copy, "panel.c tiled transpose": tiled}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {name: lambda f=f: [f(w) for w in weights] for name, f in runs.items()}, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--repack", action="store_true", help="time the layout change into panels instead")
    p.add_argument("--pairs", action="store_true", help="with --repack: bf16 weights into panels of column pairs")
    args = p.parse_args()
    print(describe_cpu(), flush=True)
    if args.repack:
        keep_freed_memory()  # the malloc settings of a CPU worker, whose decoder repacks into reused heap memory
        runs, nbytes = repacks(args.pairs)
        for _ in range(2):  # the two in turn, twice: the machine's load drifts
            for name, run in runs.items():
                ms = median_ms(run, args.repeats)
                print(
                    f"{name:<24} {ms:6.1f} ms for {nbytes / 1e6:.0f} MB  {2 * nbytes / ms / 1e6:5.1f} GB/s read + write"
                )
        return
    for rows in args.rows:
        with torch.no_grad():
            for name, (sweep, nbytes) in sweeps(rows).items():
                ms = median_ms(sweep, args.repeats)
                print(
                    f"{rows:>3} rows  {name:<32} {ms:8.1f} ms per sweep of {LAYERS} layers  "
                    f"{nbytes / ms / 1e6:6.1f} GB/s of weights",
                    flush=True,
                )


if __name__ == "__main__":
    main()
