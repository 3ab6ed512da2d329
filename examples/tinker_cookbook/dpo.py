"""DPO with tinker-cookbook's trainer (`tinker_cookbook.preference.train_dpo`) against `hybridflow tinker`.

The cookbook's DPO command line only names datasets on the hub; this script hands its trainer a local JSONL of
comparisons instead (`ComparisonBuilderFromJsonl`: one `{"comparison": {"prompt_conversation", "completion_A",
"completion_B"}, "label": "A" | "B"}` per line; `comparisons.jsonl` beside this file by default). Every
comparison goes in one batch and each step trains on that batch again, so the per-step `margin` metric
(beta * (chosen log-ratio - rejected log-ratio), 0 at the reference) shows whether the preference is learned.
The reference is the adapter at step 0, which the trainer keeps as a sampler snapshot.

    hybridflow tinker --api-key tml-local --port 8000 &          # prints the base model's directory
    TINKER_API_KEY=tml-local python examples/tinker_cookbook/dpo.py --base-url http://127.0.0.1:8000 \\
        --model ~/.cache/hybridflow/models/SmolLM2-135M-Instruct --log-path /tmp/dpo-run

Metrics land in LOG_PATH/metrics.jsonl, one line per step. Needs tinker-cookbook (`./scripts/setup.sh --cookbook`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

HERE = Path(__file__).resolve().parent


def config(args: argparse.Namespace) -> train_dpo.Config:
    """The cookbook's DPO config for these arguments (one batch of every comparison, `--steps` epochs)."""
    rows = sum(1 for line in open(args.data) if line.strip())
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model,
        renderer_name=args.renderer,
        max_length=args.max_length,
        batch_size=rows,
    )
    return train_dpo.Config(
        log_path=args.log_path,
        model_name=args.model,
        recipe_name="hybridflow_example_dpo",
        renderer_name=args.renderer,
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=common, comparison_builder=ComparisonBuilderFromJsonl(train_path=str(args.data))
        ),
        learning_rate=args.learning_rate,
        lr_schedule="constant",
        num_epochs=args.steps,
        dpo_beta=args.dpo_beta,
        lora_rank=args.lora_rank,
        base_url=args.base_url,
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
        max_steps=args.steps,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the service's URL (hybridflow tinker prints it)")
    p.add_argument("--model", required=True, help="the base model's name in the service (its directory)")
    p.add_argument("--log-path", required=True, help="where the cookbook writes metrics.jsonl and its logs")
    p.add_argument("--data", type=Path, default=HERE / "comparisons.jsonl", help="comparisons JSONL")
    p.add_argument("--renderer", default="qwen3_instruct", help="cookbook renderer (qwen3_instruct: ChatML)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--dpo-beta", type=float, default=0.1)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--max-length", type=int, default=256)
    return p.parse_args(argv)


if __name__ == "__main__":
    train_dpo.main(config(parse()))
