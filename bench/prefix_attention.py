"""Attention alone on the shared-prompt row: the dense [N, N] masked product against prefix_attention.

Run: .venv/bin/python bench/prefix_attention.py [--repeats 10]

SmolLM2's attention shape (9 query heads, 3 kv heads, head dim 64), random q/k/v, forward + backward of one
layer's attention scaled to its 30 layers, on the shared-prompt rows of three batches (all responses at full
length): bench/vs_trl.py's 8 and 32 completions (2 or 8 prompts x 4 samples, 64 prompt + 32 response tokens) and
one main-job micro-batch (2 prompts x 8 samples, 45 + 23). `dense` is transformers' SDPA over the row's mask (what
the engine ran before engine/prefix_attention.py), `prefix` the two batched calls over the visible pairs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from decode_profile import median_ms  # bench/decode_profile.py, beside this file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybridflow.engine.prefix import pack_shared_prompts  # noqa: E402
from hybridflow.engine.prefix_attention import LAYOUT_KWARG, prefix_attention  # noqa: E402
from hybridflow.protocol import keys  # noqa: E402
from hybridflow.utils.hardware import describe_cpu  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
BATCHES = {"8 completions": (2, 4, 64, 32), "32 completions": (8, 4, 64, 32), "main job micro-batch": (2, 8, 45, 23)}


def shared_row(prompts: int, n: int, prompt: int, response: int):
    ids = torch.randint(0, 1000, (prompts * n, prompt + response))
    ids[:, :prompt] = ids[::n, :prompt].repeat_interleave(n, dim=0)
    mask = torch.ones_like(ids)
    return pack_shared_prompts(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: mask.cumsum(-1) - 1,
            keys.RESPONSES: ids[:, prompt:],
        }
    )


def time_batch(prompts: int, n: int, prompt: int, response: int, repeats: int) -> tuple[int, float, float]:
    """(row length, dense ms, prefix ms) for the 30 layers' attention, forward + backward."""
    packed = shared_row(prompts, n, prompt, response)
    length = packed.input_ids.shape[1]
    q, k, v = (torch.randn(1, h, length, HEAD_DIM, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS))
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS)

    def dense() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=packed.attention_mask, enable_gqa=True).sum().backward()

    def prefix() -> None:
        prefix_attention(module, q, k, v, None, **{LAYOUT_KWARG: packed.prefix})[0].sum().backward()

    return length, median_ms(dense, repeats) * LAYERS, median_ms(prefix, repeats) * LAYERS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(describe_cpu(), flush=True)
    for name, shape in BATCHES.items():
        length, dense, prefix = time_batch(*shape, args.repeats)
        print(
            f"{name:<22} N={length:<5} dense {dense:7.0f} ms  prefix {prefix:6.0f} ms  ({dense / prefix:.1f}x) "
            f"forward + backward, {LAYERS} layers",
            flush=True,
        )


if __name__ == "__main__":
    main()
