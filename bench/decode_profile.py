"""Where a native-rollout decode step goes, at 8-64 rows on SmolLM2-135M (issue 35's profile).

Run: .venv/bin/python bench/decode_profile.py [--rows 8 32 64] [--dtype fp32] [--context 128] [--steps 16]

For each row count the static decoder on its torch path (`fused=False`) prefills `rows` prompts of `context` tokens,
then times:
- `step`: one whole `StaticLlamaDecoder.step` (what the rollout calls per token);
- `lm_head`: the LM head's product on [rows, hidden] as the decoder holds it;
- `projections`: every layer's fused q/k/v, o, gate/up and down products on [rows, 1, hidden];
- `attention`: every layer's attention of one query per row over the cache;
- `rest`: step minus the three above (norms, rotary, SiLU, cache writes, embedding, Python and dispatch).
Then the same step through the fused decode step (rollout/native/fused_step.py, what the rollout runs where it can),
on a decoder built the same way, and its ratio to the torch path's step.
Each is the median of `steps` timed calls, measured in the same process one after another. With
`--compare`, the LM head and projections are also timed as plain `F.linear` (unpacked fp32), as
oneDNN-packed fp32 and as int8 dynamic quantization (`Int8Linear` below), so
the per-shape choice the decoder makes can be checked on the CPU at hand. `--int8-gap` measures what int8
would cost in accuracy: 16 chat prompts x 64 sampled tokens (fp32 rollout) are teacher-forced through the
fp32 decoder and through one with a part's products in int8, and the mean / max absolute gap of the tokens'
log-probs is printed per part (the trainer would see this gap as rollout/trainer mismatch); `--bf16-weights-gap`
does the same for weights rounded to bf16 with fp32 math (what a bf16-weight kernel would compute).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridflow.models import default_model_dir, load_causal_lm, load_tokenizer
from hybridflow.protocol.keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.rollout.native.decoder import StaticLlamaDecoder, _decode_attention
from hybridflow.rollout.native.linear import Linear
from hybridflow.utils.hardware import describe_cpu


class Int8Linear:
    """y = x W^T + b with W in int8 (symmetric, one scale per output row) and x quantized per call (per tensor,
    7-bit range: without VNNI x86's int8 product saturates at the full 8 bits); fp32 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        qw = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)


def median_ms(fn: Callable[[], object], steps: int) -> float:
    """Median wall time of `steps` calls of fn after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_ms(dec: StaticLlamaDecoder, rows: int, context: int, steps: int) -> float:
    """Median ms of one decode step of `rows` rows after a `context`-token prefill."""
    ids = torch.randint(0, 1000, (rows, context), generator=torch.Generator().manual_seed(rows))
    pos = torch.arange(context).expand(rows, -1)
    dec.prefill(ids, torch.ones_like(ids), pos, steps + 2)
    tok, at = ids[:, 0], torch.full((rows,), context)

    def one_step() -> None:
        dec.length = context  # every timed step writes the same cache slot: same width, same work
        dec.step(tok, at)

    with torch.no_grad():
        return median_ms(one_step, steps)


def profile_rows(dec: StaticLlamaDecoder, rows: int, context: int, steps: int, hidden: int) -> dict[str, float]:
    """The step's parts in ms (module docstring) for `rows` rows after a `context`-token prefill."""
    step = step_ms(dec, rows, context, steps)

    x2, x3 = torch.randn(rows, hidden, dtype=dec.dtype), torch.randn(rows, 1, hidden, dtype=dec.dtype)
    mid = torch.randn(rows, 1, dec.model.config.intermediate_size, dtype=dec.dtype)
    attn_o = torch.randn(rows, 1, dec.heads * dec.head_dim, dtype=dec.dtype)
    q = torch.randn(rows, dec.kv_heads, dec.heads // dec.kv_heads, dec.head_dim, dtype=dec.dtype)
    mask = dec.key_mask[:, None, None, : dec.k_cache.shape[3]]

    def projections() -> None:
        for w in dec.layers:
            w.qkv(x3), w.o(attn_o), w.gate_up(x3), w.down(mid)

    def attention() -> None:
        for i in range(len(dec.layers)):
            _decode_attention(q, dec.k_cache[i], dec.v_cache[i], mask, dec.scaling)

    with torch.no_grad():
        out = {
            "step": step,
            "lm_head": median_ms(lambda: dec.lm_head(x2), steps),
            "projections": median_ms(projections, steps),
            "attention": median_ms(attention, steps),
        }
    out["rest"] = out["step"] - out["lm_head"] - out["projections"] - out["attention"]
    return out


def compare_gemms(model, rows: int, steps: int) -> None:
    """Each distinct decode GEMM shape timed as F.linear, oneDNN-packed and int8 dynamic."""
    layer = model.model.layers[0]
    a, m = layer.self_attn, layer.mlp
    shapes = {
        "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
        "o": a.o_proj.weight,
        "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
        "down": m.down_proj.weight,
        "lm_head": model.lm_head.weight,
    }
    for name, w in shapes.items():
        w = w.detach().float().contiguous()
        x = torch.randn(rows, w.shape[1])
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        q = Int8Linear(w, None)
        with torch.no_grad():
            plain = median_ms(lambda w=w, x=x: F.linear(x, w), steps)
            onednn = median_ms(
                lambda p=packed, x=x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), steps
            )
            int8 = median_ms(lambda q=q, x=x: q(x), steps)
        print(
            f"  {rows:>3} rows {name:>8} {tuple(w.shape)}: F.linear {plain:7.2f} ms | oneDNN packed {onednn:7.2f} ms "
            f"({plain / onednn:4.2f}x) | int8 {int8:7.2f} ms ({plain / int8:4.2f}x)",
            flush=True,
        )


PARTS = ("qkv", "o", "gate_up", "down", "lm_head")


def bf16_weights(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """fp32 math on weights rounded to bf16: what a kernel storing bf16 weights and computing in fp32 returns."""
    return Linear(weight.detach().bfloat16().float(), bias)


def int8_decoder(model, parts: tuple[str, ...], make: Callable = Int8Linear) -> StaticLlamaDecoder:
    """The fp32 static decoder (torch path: the fused step multiplies its own panels) with the products named in
    `parts` swapped for `make(weight, bias)`."""
    dec = StaticLlamaDecoder(model, fused=False)
    for w, layer in zip(dec.layers, model.model.layers):
        a, m = layer.self_attn, layer.mlp
        full = {
            "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "o": a.o_proj.weight,
            "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            "down": m.down_proj.weight,
        }
        for name in set(parts) & set(full):
            setattr(w, name, make(full[name], None))
    if "lm_head" in parts:
        dec.lm_head = make(model.lm_head.weight, model.lm_head.bias)
    return dec


def teacher_forced_log_probs(dec: StaticLlamaDecoder, prompts, responses: torch.Tensor) -> torch.Tensor:
    """[B, R] log-probs of `responses` under `dec`, fed one token per step after the prompts' prefill."""
    ids, mask, pos = (prompts.batch[k] for k in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS))
    logits = dec.prefill(ids, mask, pos, responses.shape[1])
    out = []
    for t in range(responses.shape[1]):
        out.append(torch.log_softmax(logits, -1).gather(1, responses[:, t : t + 1])[:, 0])
        logits = dec.step(responses[:, t], pos[:, -1] + 1 + t)
    return torch.stack(out, 1)


def int8_gap(model, rows: int = 16, new_tokens: int = 64, make: Callable = Int8Linear, label: str = "int8") -> None:
    """Per part (and all together): mean / max |log-prob gap| of `make`'s products (int8 by default) vs fp32 on
    sampled chat responses."""
    from rollout import make_prompts  # bench/rollout.py, beside this file

    tokenizer = load_tokenizer(default_model_dir())
    prompts = make_prompts(tokenizer, rows)
    cfg = RolloutConfig(name="native", dtype="fp32", response_length=new_tokens, ignore_eos=True, seed=1)
    responses = build_rollout(cfg, model, tokenizer).generate_sequences(prompts).batch[RESPONSES]
    with torch.no_grad():
        ref = teacher_forced_log_probs(StaticLlamaDecoder(model, fused=False), prompts, responses)
        for parts in [(p,) for p in PARTS] + [PARTS]:
            gap = (teacher_forced_log_probs(int8_decoder(model, parts, make), prompts, responses) - ref).abs()
            print(
                f"  {label} {'+'.join(parts):>28}: log-prob gap mean {gap.mean():.4f}, max {gap.max():.3f}, "
                f"tokens with |ratio - 1| > 0.2: {((gap.exp() - 1) > 0.2).float().mean():.1%}",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--context", type=int, default=128, help="prompt tokens prefilled before the timed steps")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--compare", action="store_true", help="also time each GEMM shape three ways")
    p.add_argument("--int8-gap", action="store_true", help="also measure int8's log-prob gap per part")
    p.add_argument(
        "--bf16-weights-gap", action="store_true", help="the same gap for bf16 weights with fp32 math, per part"
    )
    args = p.parse_args()
    print(describe_cpu(), flush=True)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = load_causal_lm(default_model_dir(), dtype=dtype).eval()
    hidden = model.config.hidden_size
    for rows in args.rows:
        with torch.no_grad():
            dec, fused = StaticLlamaDecoder(model, fused=False), StaticLlamaDecoder(model, fused=True)
        parts = profile_rows(dec, rows, args.context, args.steps, hidden)
        share = "  ".join(f"{k} {v:6.1f} ms ({v / parts['step']:4.0%})" for k, v in parts.items() if k != "step")
        print(f"{args.dtype} {rows:>3} rows: step {parts['step']:6.1f} ms = {share}", flush=True)
        if fused.fused is None:
            print(f"{args.dtype} {rows:>3} rows: the fused decode step does not run here", flush=True)
        else:
            ms = step_ms(fused, rows, args.context, args.steps)
            print(
                f"{args.dtype} {rows:>3} rows: fused step {ms:6.1f} ms ({parts['step'] / ms:.2f}x faster)", flush=True
            )
        if args.compare:
            compare_gemms(model, rows, args.steps)
    if args.int8_gap:
        int8_gap(model)
    if args.bf16_weights_gap:
        int8_gap(model, make=bf16_weights, label="bf16 weights")


if __name__ == "__main__":
    main()
