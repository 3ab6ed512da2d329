"""SmolLM2 as judge on the arithmetic task: how often its verdict agrees with the rule reward, on held-out rows.

Run: .venv/bin/python bench/judge_agreement.py [--rows 128] [--templates reference_yes_no yes_no]

Inference only, through the production path: the policy (the bundled SmolLM2-135M-Instruct, untrained) samples one
response per held-out prompt of the main job's task (temperature 1, 32 tokens, the native rollout), the rule scorer
scores it, and a `JudgeWorker` (the same SmolLM2, greedy, judge.parser=yes_no) judges every row in one call per
template. Two row sets:
- policy: the policy's own responses (mostly wrong: the base model's held-out accuracy is low);
- balanced: per prompt, "The answer is <truth>." and "The answer is <truth + 1>." (half right, half wrong), to see
  whether the judge tells them apart at all.
For each set and template it prints the confusion matrix against the rule (judge pass = verdict "yes"), agreement,
balanced accuracy (mean of the judge's recall on rule-correct and on rule-wrong rows: 0.5 is chance), the invalid
verdicts, and the judge call's seconds beside the policy's generate seconds (same process, same run).
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.data.tasks import make_difficulty, make_rows
from hybridflow.models import default_model_dir, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rewards.arithmetic import compute_score
from hybridflow.rollout import RolloutConfig, build_rollout
from hybridflow.train.judge_step import judge_inputs
from hybridflow.utils.hardware import describe_cpu
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.judge import QUESTION, RESPONSE, SCORES, STATUS, STATUSES, JudgeWorker
from hybridflow.workers.judge_config import JudgeConfig


def held_out(rows: int, seed: int) -> list[dict]:
    """The main job's held-out arithmetic rows (its default difficulty, the test split)."""
    return make_rows("arithmetic", rows, "test", seed, make_difficulty("arithmetic"))


def policy_batch(tokenizer, rows: list[dict], seed: int) -> tuple[DataProto, float]:
    """One sampled response per row from the untrained SmolLM2 (temperature 1, 32 tokens), and its seconds."""
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    prompts = DataProto.from_dict(
        {K.INPUT_IDS: enc["input_ids"], K.ATTENTION_MASK: enc["attention_mask"], K.POSITION_IDS: pos}
    )
    cfg = RolloutConfig(prompt_length=enc["input_ids"].shape[1], response_length=32, seed=seed, dtype="fp32")
    rollout = build_rollout(cfg, default_model_dir(), tokenizer)
    start = time.perf_counter()
    out = rollout.generate_sequences(prompts)
    seconds = time.perf_counter() - start
    out.non_tensor_batch[K.RAW_PROMPT] = _objects([r["prompt"] for r in rows])
    out.non_tensor_batch[K.GROUND_TRUTH] = _objects([r["reward_model"]["ground_truth"] for r in rows])
    return out, seconds


def _objects(values: list) -> object:
    import numpy as np

    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def balanced_rows(rows: list[dict]) -> DataProto:
    """Per prompt one right and one wrong answer, stated plainly."""
    questions, responses, truths = [], [], []
    for r in rows:
        truth = r["reward_model"]["ground_truth"]
        for answer in (truth, str(int(truth) + 1)):
            questions.append(r["prompt"][-1]["content"])
            responses.append(f"The answer is {answer}.")
            truths.append(truth)
    return DataProto.from_dict(
        {"judge_row": torch.arange(len(questions))},
        non_tensors={QUESTION: questions, RESPONSE: responses, K.GROUND_TRUTH: truths},
    )


def report(name: str, template: str, out: DataProto, rule: list[float], seconds: float, gen_seconds: float) -> None:
    status = out.batch[STATUSES]
    ok = status == STATUS["ok"]
    judge_yes = (out.batch[SCORES] >= 0.5) & ok
    rule_ok = torch.tensor(rule) >= 0.5
    tp = int((judge_yes & rule_ok).sum())
    fp = int((judge_yes & ~rule_ok & ok).sum())
    fn = int((~judge_yes & rule_ok & ok).sum())
    tn = int((~judge_yes & ~rule_ok & ok).sum())
    valid = int(ok.sum())
    agree = (tp + tn) / valid if valid else float("nan")
    recall_pos = tp / (tp + fn) if tp + fn else float("nan")
    recall_neg = tn / (tn + fp) if tn + fp else float("nan")
    print(
        f"{name:9s} {template:17s} rows {len(rule):4d}  rule-correct {int(rule_ok.sum()):4d}  invalid "
        f"{len(rule) - valid:4d}  TP {tp:4d} FP {fp:4d} FN {fn:4d} TN {tn:4d}  agreement {agree:.3f}  "
        f"balanced acc {(recall_pos + recall_neg) / 2:.3f}  yes-rate {int(judge_yes.sum()) / max(valid, 1):.3f}  "
        f"judge {seconds:.1f} s ({seconds / gen_seconds:.2f}x the policy's generate of {gen_seconds:.1f} s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--templates", nargs="+", default=["reference_yes_no", "yes_no"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(describe_cpu(), flush=True)
    tokenizer = load_tokenizer(default_model_dir())
    rows = held_out(args.rows, args.seed)
    batch, gen_seconds = policy_batch(tokenizer, rows, args.seed)
    lengths = batch.batch[K.RESPONSE_MASK].sum(-1).tolist()
    texts = tokenizer.batch_decode(
        [r[:n].tolist() for r, n in zip(batch.batch[K.RESPONSES], lengths)], skip_special_tokens=True
    )
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    rule = [compute_score(t, g) for t, g in zip(texts, truths)]
    print(f"policy: {sum(rule):.0f} of {len(rule)} held-out responses rule-correct; generate {gen_seconds:.1f} s")
    balanced = balanced_rows(rows)
    balanced_rule = [1.0, 0.0] * len(rows)
    for template in args.templates:
        cfg = JudgeConfig(
            enable=True,
            model=ModelConfig(path="default"),
            rollout=RolloutConfig(do_sample=False, n=1, prompt_length=384, response_length=8, dtype="fp32"),
            template=template,
            parser="yes_no",
        )
        judge = LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(JudgeWorker, cfg))
        judge.init_model()
        for name, data, scores in (("policy", judge_inputs(batch, tokenizer), rule), ("balanced", balanced, None)):
            start = time.perf_counter()
            out = judge.judge(data)
            report(name, template, out, scores or balanced_rule, time.perf_counter() - start, gen_seconds)
            if name == "policy":
                shown = [(t[:40], v) for t, v in zip(texts[:4], out.non_tensor_batch["judge_verdicts"][:4])]
                print(f"  e.g. (response, verdict): {shown}", flush=True)


if __name__ == "__main__":
    main()
