"""On-policy distillation with tinker-cookbook's trainer (`tinker_cookbook.distillation.train_on_policy`)
against `hybridflow tinker`, with a teacher that is the same base model under another adapter.

The cookbook's distillation command line only names prompt sets on the hub; this script gives its trainer a
local list of prompts. The teacher: unless `--teacher-path` names a sampler checkpoint, the script first trains
one with a few plain `cross_entropy` steps (the `tinker` SDK, no cookbook trainer) to give each prompt its
short answer in `PROMPTS` (or `--teacher-answer` to every prompt), and saves it as `tinker://.../sampler_weights/teacher`. Then the student (a fresh adapter
on the base) samples answers, the teacher scores them (`compute_logprobs` on that snapshot), and the student
trains on the per-token reverse KL as its advantage (`importance_sampling`). The per-step `teacher_kl` metric
(the sampled tokens' student minus teacher log-probs, averaged) falls as the student moves towards the teacher.

    hybridflow tinker --api-key tml-local --port 8000 &          # prints the base model's directory
    TINKER_API_KEY=tml-local python examples/tinker_cookbook/distill.py --base-url http://127.0.0.1:8000 \\
        --model ~/.cache/hybridflow/models/SmolLM2-135M-Instruct --log-path /tmp/distill-run

Metrics land in LOG_PATH/metrics.jsonl, one line per step. Needs tinker-cookbook (`./scripts/setup.sh --cookbook`).
"""

from __future__ import annotations

import argparse
import asyncio

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDatasetBuilder
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer

PROMPTS = {
    "What is your favourite colour?": "Blue.",
    "Name a fruit.": "Apple.",
    "What should I name my cat?": "Whiskers.",
    "Say something about the sea.": "The sea is deep.",
}
"""The prompts and the trained teacher's answer to each: answers the base model itself gives some probability, so
the student's own samples meet the teacher's choices from the first step."""


@chz.chz
class LocalPrompts(RLDatasetBuilder):
    """The prompts, `groups_per_batch` to a batch, over and over for `batches` batches."""

    prompts: tuple[str, ...]
    groups_per_batch: int
    group_size: int
    batches: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self) -> tuple[PromptOnlyDataset, None]:
        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        per_batch = [self.prompts[i % len(self.prompts)] for i in range(self.groups_per_batch)]
        prompts = per_batch * self.batches
        return PromptOnlyDataset(prompts, self.groups_per_batch, self.group_size, renderer, tokenizer), None


def train_teacher(args: argparse.Namespace) -> str:
    """A sampler checkpoint of an adapter trained to answer each prompt as `PROMPTS` (or `--teacher-answer`) says."""
    service = tinker.ServiceClient(base_url=args.base_url)
    trainer = service.create_lora_training_client(base_model=args.model, rank=args.lora_rank).result()
    renderer = renderers.get_renderer(args.renderer, tokenizer=trainer.get_tokenizer())
    data = [
        conversation_to_datum(
            [{"role": "user", "content": p}, {"role": "assistant", "content": args.teacher_answer or a}], renderer, 256
        )
        for p, a in PROMPTS.items()
    ]
    for _ in range(args.teacher_steps):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(tinker.AdamParams(learning_rate=args.teacher_learning_rate))
    path = trainer.save_weights_for_sampler(f"teacher-{args.teacher_steps}").result().path
    service.close("success").result()
    return path


def config(args: argparse.Namespace, teacher_path: str) -> train_on_policy.Config:
    """The cookbook's on-policy distillation config for these arguments."""
    dataset = LocalPrompts(
        prompts=tuple(PROMPTS),
        groups_per_batch=args.groups_per_batch,
        group_size=args.group_size,
        batches=args.steps,
        model_name_for_tokenizer=args.model,
        renderer_name=args.renderer,
    )
    teacher = TeacherConfig(base_model=args.model, load_checkpoint_path=teacher_path)
    return train_on_policy.Config(
        learning_rate=args.learning_rate,
        dataset_configs=[
            DistillationDatasetConfig(
                dataset_builder=dataset, teacher_config=teacher, groups_per_batch=args.groups_per_batch
            )
        ],
        model_name=args.model,
        recipe_name="hybridflow_example_distill",
        renderer_name=args.renderer,
        max_tokens=args.max_tokens,
        lora_rank=args.lora_rank,
        kl_penalty_coef=1.0,
        loss_fn="importance_sampling",
        log_path=args.log_path,
        base_url=args.base_url,
        eval_every=0,
        save_every=0,
        max_steps=args.steps,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the service's URL (hybridflow tinker prints it)")
    p.add_argument("--model", required=True, help="the base model's name in the service (its directory)")
    p.add_argument("--log-path", required=True, help="where the cookbook writes metrics.jsonl and its logs")
    p.add_argument("--teacher-path", default=None, help="a tinker://.../sampler_weights/NAME teacher (else trained)")
    p.add_argument("--teacher-answer", help="one answer the teacher gives every prompt (default: PROMPTS' own)")
    p.add_argument("--teacher-steps", type=int, default=3)
    p.add_argument("--teacher-learning-rate", type=float, default=1e-3)
    p.add_argument("--renderer", default="qwen3_instruct", help="cookbook renderer (qwen3_instruct: ChatML)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups-per-batch", type=int, default=4)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    teacher_path = args.teacher_path or train_teacher(args)
    print(f"teacher: {teacher_path}", flush=True)
    asyncio.run(train_on_policy.main(config(args, teacher_path)))


if __name__ == "__main__":
    main()
