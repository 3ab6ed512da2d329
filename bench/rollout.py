"""Native rollout vs transformers `generate` on SmolLM2-135M: generated tokens per second.

Run: .venv/bin/python bench/rollout.py [--batch 64] [--new-tokens 64] [--dtypes bf16 fp32] [--repeats 2]
     [--weight-dtype bf16]  (the fp32 native rollout with rollout.weight_dtype=bf16; `generate` stays fp32)

Both sample at temperature 1, top_p 1, no top-k, and both generate exactly
`new-tokens` tokens per sequence: EOS stopping is off for both (generate gets a
generation config without eos_token_id, the native rollout `ignore_eos=True`), so
they do the same work. The native time is the whole `generate_sequences` call
(DataProto in, DataProto out); transformers' is the bare `generate` call. Runs
alternate between the two, after one short warm-up each; best of `repeats`.
A third column runs the native rollout with compiled kernels (rollout.enforce_eager=False);
its compile time (warm-up call minus the eager one's) is printed beside it.

`--layouts dp tp --ranks N` instead runs only the native rollout on N gloo processes of 1 thread
each, per layout: dp, every rank generates batch / N of the rows with the whole model; tp
(rollout.tensor_model_parallel_size=N), every rank generates all rows with its 1/N of every layer
and two all-reduces per layer and step. Tokens/s = the batch's tokens / the slowest rank's time,
best of `repeats`. SmolLM2's 9 heads / 3 kv heads allow tp 3 only:

    .venv/bin/python bench/rollout.py --layouts dp tp --ranks 3 --dtypes bf16
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import replace

import torch

from hybridflow.models import default_model_dir, load_causal_lm, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.protocol.keys import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSES
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.utils.hardware import describe_cpu

QUESTIONS = [
    "What is 12 plus 7?",
    "Write a haiku about autumn.",
    "Explain what a prime number is.",
    "Name three colours of the rainbow.",
    "How many legs does a spider have?",
    "Give me a short greeting in French.",
    "What is the capital of Japan?",
    "Count from one to five.",
]


def make_prompts(tokenizer, batch: int) -> DataProto:
    """`batch` chat-templated questions, left-padded."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], tokenize=False, add_generation_prompt=True
        )
        for i in range(batch)
    ]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({INPUT_IDS: enc["input_ids"], ATTENTION_MASK: enc["attention_mask"], POSITION_IDS: pos})


def hf_generate(model, prompts: DataProto, new_tokens: int, pad_id: int) -> int:
    """Sample with transformers generate; returns the number of generated tokens."""
    gc = copy.deepcopy(model.generation_config)
    gc.update(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    ids = prompts.batch[INPUT_IDS]
    with torch.inference_mode():
        seqs = model.generate(ids, attention_mask=prompts.batch[ATTENTION_MASK], generation_config=gc)
    return (seqs.shape[1] - ids.shape[1]) * seqs.shape[0]


def native_generate(rollout, prompts: DataProto) -> int:
    """Sample with the native rollout; returns the number of generated tokens."""
    return rollout.generate_sequences(prompts).batch[RESPONSES].numel()


def timed(fn) -> tuple[float, int]:
    """(seconds, tokens) of one call of fn."""
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def bench_dtype(dtype: str, args, tokenizer) -> dict[str, float]:
    """Best tokens/s of transformers generate, the native rollout, and the native rollout with compiled
    kernels (rollout.enforce_eager=False) in one dtype; also "compile_s", the compiled rollout's warm-up
    call minus the eager one's (the compilation, paid once per process)."""
    cfg = RolloutConfig(
        name="native",
        dtype=dtype,
        response_length=args.new_tokens,
        ignore_eos=True,
        max_batch_size=args.batch,
        prompt_length=256,
        weight_dtype=args.weight_dtype if dtype == "fp32" else None,
    )
    model = load_causal_lm(default_model_dir(), dtype=cfg.torch_dtype).eval()
    rollouts = {"native": build_rollout(cfg, model, tokenizer)}
    prompts = make_prompts(tokenizer, args.batch)
    hf_generate(model, prompts, 4, tokenizer.pad_token_id)
    warm_s = {}
    for name, eager in (("native", True), ("compiled", False)):
        warm = replace(cfg, response_length=4, enforce_eager=eager)
        warm_s[name], _ = timed(lambda warm=warm: native_generate(build_rollout(warm, model, tokenizer), prompts))
    rollouts["compiled"] = build_rollout(replace(cfg, enforce_eager=False), model, tokenizer)
    if not rollouts["compiled"].kernels.compiled:
        print("  torch.compile is unavailable here: the compiled row runs eagerly")
    best = {"hf": 0.0, "native": 0.0, "compiled": 0.0, "compile_s": warm_s["compiled"] - warm_s["native"]}
    calls = [("hf", lambda: hf_generate(model, prompts, args.new_tokens, tokenizer.pad_token_id))]
    calls += [(name, lambda r=r: native_generate(r, prompts)) for name, r in rollouts.items()]
    for rep in range(args.repeats):
        for name, fn in calls:
            seconds, tokens = timed(fn)
            assert tokens == args.batch * args.new_tokens, (name, tokens)
            best[name] = max(best[name], tokens / seconds)
            print(f"  {dtype} rep {rep} {name:>8}: {seconds:6.2f} s, {tokens / seconds:7.1f} tokens/s", flush=True)
    return best


def _layout_rank(rank: int, args, layout: str, port: int, out: str) -> None:
    """One rank of a `--layouts` run: build the rollout in `layout`, time `repeats` calls, write its times."""
    import json
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    tp = args.ranks if layout == "tp" else 1
    cfg = RolloutConfig(
        name="native",
        dtype=args.dtypes[0],
        response_length=args.new_tokens,
        ignore_eos=True,
        max_batch_size=args.batch,
        prompt_length=256,
        tensor_model_parallel_size=tp,
    )
    tokenizer = load_tokenizer(default_model_dir())
    rollout = build_rollout(cfg, default_model_dir(), tokenizer)
    prompts = make_prompts(tokenizer, args.batch)
    if layout == "dp":
        rows = args.batch // args.ranks
        prompts = prompts[rank * rows : (rank + 1) * rows]
    native_generate(rollout, prompts[:4])  # warm-up
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        times.append(timed(lambda: native_generate(rollout, prompts))[0])
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


def run_layouts(args) -> None:
    """Tokens/s of the native rollout per layout on `args.ranks` processes (see the module docstring)."""
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    print(
        f"SmolLM2-135M native rollout, batch {args.batch}, {args.new_tokens} new tokens, {args.dtypes[0]}, "
        f"{args.ranks} processes x 1 thread",
        flush=True,
    )
    results = {}
    for layout in args.layouts:
        with tempfile.TemporaryDirectory() as out, socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            mp.spawn(_layout_rank, args=(args, layout, port, out), nprocs=args.ranks, join=True)
            per_rank = [json.load(open(f"{out}/{r}.json")) for r in range(args.ranks)]
        best = min(max(ts) for ts in zip(*per_rank))
        results[layout] = args.batch * args.new_tokens / best
        print(f"  {layout}{args.ranks}: best {best:.2f} s, {results[layout]:.1f} tokens/s", flush=True)
    if "dp" in results:
        print("  " + ", ".join(f"{k}{args.ranks} {v / results['dp']:.2f}x dp" for k, v in results.items()))


def main() -> None:
    """Print tokens/s of both and their ratio for each dtype."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--weight-dtype", choices=["bf16"], help="fp32 native rollout: rollout.weight_dtype (bf16 weights, fp32 math)"
    )
    parser.add_argument("--layouts", nargs="+", choices=["dp", "tp"], help="native rollout on --ranks processes")
    parser.add_argument("--ranks", type=int, default=3)
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    if args.layouts:
        return run_layouts(args)
    tokenizer = load_tokenizer(default_model_dir())
    print(
        f"SmolLM2-135M, batch {args.batch}, {args.new_tokens} new tokens, sampling T=1, "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    rows = [(dtype, bench_dtype(dtype, args, tokenizer)) for dtype in args.dtypes]
    print(
        f"{'dtype':>6} {'generate tok/s':>15} {'native tok/s':>13} {'ratio':>6} {'compiled tok/s':>15} "
        f"{'ratio':>6} {'compile s':>10}"
    )
    for dtype, b in rows:
        print(
            f"{dtype:>6} {b['hf']:15.1f} {b['native']:13.1f} {b['native'] / b['hf']:6.2f} {b['compiled']:15.1f} "
            f"{b['compiled'] / b['hf']:6.2f} {b['compile_s']:10.1f}"
        )


if __name__ == "__main__":
    main()
