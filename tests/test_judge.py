"""The judge (a generative reward model served through the rollout engine), exactly on a tiny random judge.

The tiny random Llama's greedy verdict is fixed (newlines), so every expected value is known: the verdicts are
checked against transformers' own greedy generate on the same prompt, the parser plugin (tests/judge_plugins.py)
turns them into a known score, and each row's reward, status and the step's metrics follow by hand. Rows whose
template raises, whose prompt is too long, a judge backend that raises and one that stalls past judge.timeout_s are
each scored judge.invalid_score and counted; none fails its neighbours. One 2-step run on the Ray backend checks the
whole path: timing, metrics, rewards and the profile row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer_cli import base_overrides, read_metrics, run_cli
from transformers import AutoModelForCausalLM

from hybridflow.cli.train import check_judge_prompts
from hybridflow.config.run import RunConfig
from hybridflow.controller.local import LocalResourcePool, LocalWorkerGroup
from hybridflow.controller.resource_pool import ClassWithInitArgs
from hybridflow.models import load_tokenizer, tiny_model_dir
from hybridflow.protocol import DataProto
from hybridflow.protocol import keys as K
from hybridflow.rewards import RewardManager
from hybridflow.rewards.judge import as_messages, parse_score_0_10, parse_yes_no, question_of
from hybridflow.rollout.config import RolloutConfig
from hybridflow.train.judge_step import judge_inputs, judge_rewards
from hybridflow.utils.config_loader import ConfigError, load_config
from hybridflow.workers.config import ModelConfig
from hybridflow.workers.judge import QUESTION, RESPONSE, STATUS, JudgeWorker, judge_context, render_prompt
from hybridflow.workers.judge_config import JudgeConfig

PLUGINS = str(Path(__file__).resolve().parent / "judge_plugins.py")
NEWLINES = f"{PLUGINS}:newline_parser"
VERDICT_TOKENS = 6
FIXED_SCORE = VERDICT_TOKENS / 10  # newline_parser of the tiny judge's verdict: six newlines


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(tiny_model_dir("llama"))


def _config(model: str, **kw) -> JudgeConfig:
    rollout = RolloutConfig(
        name=kw.pop("backend", "native"), do_sample=False, prompt_length=160, response_length=VERDICT_TOKENS
    )
    return JudgeConfig(enable=True, model=ModelConfig(path=model), rollout=rollout, **{"parser": NEWLINES, **kw})


def _local_judge(cfg: JudgeConfig) -> LocalWorkerGroup:
    group = LocalWorkerGroup(LocalResourcePool(), ClassWithInitArgs(JudgeWorker, cfg))
    group.init_model()
    return group


def _rows(questions: list[str]) -> DataProto:
    return DataProto.from_dict(
        {"judge_row": torch.arange(len(questions))},
        non_tensors={QUESTION: questions, RESPONSE: ["7"] * len(questions), K.GROUND_TRUTH: ["7"] * len(questions)},
    )


def test_builtin_parsers_and_templates():
    assert [parse_yes_no(v) for v in ("Yes.", " no, it is not", "YES", "maybe yes", "", "noway")] == [
        1.0,
        0.0,
        1.0,
        None,
        None,
        None,
    ]
    assert [parse_score_0_10(v) for v in ("7/10", "score: 10", "11", "-1", "none")] == [0.7, 1.0, None, None, None]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert question_of(chat) == "b" and question_of("plain") == "plain"
    assert as_messages("hi") == [{"role": "user", "content": "hi"}]
    with pytest.raises(TypeError, match="judge.template must return a string or a list"):
        as_messages(3)


def test_verdicts_are_the_judges_greedy_text_and_each_row_is_scored_alone(tiny):
    """The native rollout's verdicts equal transformers' greedy generate; a raising template and an overlong
    prompt mark their row only."""
    cfg = _config(tiny, template=f"{PLUGINS}:raising_template")
    questions = ["What is 3 + 4?", "What is 10 - 3?", "RAISE on this row", "x " * 400, "What is 1 + 6?"]
    out = _local_judge(cfg).judge(_rows(questions))
    status = out.batch["judge_status"].tolist()
    assert status == [STATUS["ok"], STATUS["ok"], STATUS["failed"], STATUS["overlong"], STATUS["ok"]]
    tokenizer = load_tokenizer(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for i in (0, 1, 4):
        ids = torch.tensor([render_prompt(cfg, tokenizer, questions[i], "7", "7", None)])
        with torch.no_grad():
            ref = model.generate(
                ids, max_new_tokens=VERDICT_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        expected = tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)
        assert out.non_tensor_batch["judge_verdicts"][i] == expected
    scores = out.batch["judge_scores"]
    assert scores[[0, 1, 4]].tolist() == pytest.approx([FIXED_SCORE] * 3)
    assert torch.isnan(scores[[2, 3]]).all()
    assert out.meta_info["judge_error"] is None


def _policy_batch(tokenizer, responses: list[str], truths: list[str]) -> DataProto:
    """A generated batch as the trainer holds it: right-padded responses of different lengths."""
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(i) for i in ids) + 2
    resp = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(resp)
    for row, i in enumerate(ids):
        resp[row, : len(i)], mask[row, : len(i)] = torch.tensor(i), 1
    prompts = [[{"role": "user", "content": f"What is 3 + {t[-1]}?"}] for t in truths]
    return DataProto.from_dict(
        {K.RESPONSES: resp, K.RESPONSE_MASK: mask},
        non_tensors={
            K.RAW_PROMPT: prompts,
            K.GROUND_TRUTH: truths,
            K.DATA_SOURCE: ["arithmetic"] * len(ids),
            K.EXTRA_INFO: [{}] * len(ids),
        },
    )


@pytest.mark.parametrize("combine", ["replace", "add"])
def test_rewards_per_row_with_an_unparseable_verdict(tiny, combine):
    """yes_no cannot read the tiny judge's verdict: every row gets judge.invalid_score, counted; newline_parser
    reads it: every row gets 0.6. Each lands on the row's last valid response token, replacing or adding to the
    rule score."""
    tokenizer = load_tokenizer(tiny)
    batch = _policy_batch(tokenizer, ["The answer is 7", "8", "#### 7 because three and four"], ["7", "7", "7"])
    rule = RewardManager(tokenizer)(batch)
    assert rule.scores == [1.0, 0.0, 1.0]
    last = batch.batch[K.RESPONSE_MASK].sum(-1) - 1
    for parser, per_row, invalid in (("yes_no", -0.5, 3.0), (NEWLINES, FIXED_SCORE, 0.0)):
        cfg = _config(tiny, parser=parser, invalid_score=-0.5, combine=combine)
        reward, metrics, verdicts = judge_rewards(_local_judge(cfg), batch, tokenizer, rule, cfg)
        expected = torch.zeros_like(rule.token_level_scores)
        for row, score in enumerate(rule.scores):
            expected[row, last[row]] = per_row + (score if combine == "add" else 0.0)
        assert torch.equal(reward.token_level_scores, expected)
        assert verdicts == ["\n" * VERDICT_TOKENS] * 3
        assert metrics["judge/invalid"] == invalid and metrics["judge/failed"] == metrics["judge/overlong"] == 0
        assert metrics["judge/score_mean"] == pytest.approx(per_row)
        if invalid == 0:  # every verdict 0.6 (a pass) against rule scores 1, 0, 1
            assert metrics["judge/yes_rate"] == 1.0 and metrics["judge/rule_agreement"] == pytest.approx(2 / 3)
        else:
            assert "judge/rule_agreement" not in metrics
        assert reward.metrics["reward/mean"] == pytest.approx(2 / 3)  # the rule's, still logged


def test_judge_inputs_hold_the_question_and_the_decoded_response(tiny):
    tokenizer = load_tokenizer(tiny)
    batch = _policy_batch(tokenizer, ["The answer is 7", "8"], ["7", "11"])
    rows = judge_inputs(batch, tokenizer)
    assert list(rows.non_tensor_batch[QUESTION]) == ["What is 3 + 7?", "What is 3 + 1?"]
    assert list(rows.non_tensor_batch[RESPONSE]) == ["The answer is 7", "8"]


@pytest.mark.slow
def test_a_failing_or_stalled_judge_on_ray_scores_every_row_invalid_and_the_worker_lives_on(tiny, ray_local):
    from hybridflow.controller.ray import RayResourcePool, RayWorkerGroup

    tokenizer = load_tokenizer(tiny)
    batch = _policy_batch(tokenizer, ["7", "8"], ["7", "7"])
    rule = RewardManager(tokenizer)(batch)
    for backend, why in (("failing_rollout", "RuntimeError: judge backend down"), ("stalling_rollout", "timeout_s")):
        cfg = _config(tiny, backend=f"{PLUGINS}:{backend}", invalid_score=-1.0, timeout_s=0.5)
        pool = RayResourcePool([1], num_cpus_per_process=1)
        group = RayWorkerGroup(pool, ClassWithInitArgs(JudgeWorker, cfg))
        try:
            group.init_model()
            out = group.judge(judge_inputs(batch, tokenizer))
            assert why in out.meta_info["judge_error"]
            reward, metrics, _ = judge_rewards(group, batch, tokenizer, rule, cfg)
            assert metrics["judge/failed"] == 2 and metrics["judge/score_mean"] == -1.0
            assert reward.token_level_scores.sum().item() == -2.0
            if backend == "stalling_rollout":  # the stalled generation still runs: later calls fail at once
                assert "still generating" in group.judge(judge_inputs(batch, tokenizer)).meta_info["judge_error"]
        finally:
            group.shutdown()
            pool.remove()


def test_judge_config_errors(tiny, tmp_path):
    def refused(match: str, *overrides: str) -> None:
        with pytest.raises(ConfigError, match=match):
            load_config(RunConfig, None, ["judge.enable=true", *overrides])

    refused("judge.combine must be one of", "judge.combine=mean")
    refused("judge.parser='nope' is not a registered judge verdict parser", "judge.parser=nope")
    refused("judge.template='nope' is not a registered judge prompt template", "judge.template=nope")
    refused("judge.rollout.n must be 1", "judge.rollout.n=2", "judge.rollout.do_sample=true")
    refused("judge.timeout_s must be > 0", "judge.timeout_s=0")
    refused("judge.timeout_s=600.0 must be below trainer.call_timeout_s=60", "trainer.call_timeout_s=60")
    refused("tensor_model_parallel_size=2: a judge split over ranks", "judge.rollout.tensor_model_parallel_size=2")
    refused("rollout.multi_turn / rollout.agent is not supported yet", "rollout.multi_turn.enable=true")
    refused("adv_estimator=remax, whose baseline is scored by the rule reward", "algorithm.adv_estimator=remax")
    refused("rollout.name='nope' is not a registered rollout backend", "judge.rollout.name=nope")
    tokenizer = load_tokenizer(tiny)
    cfg = _config(tiny)
    need = judge_context(cfg, tokenizer, 64, 16)
    assert need == len(render_prompt(cfg, tokenizer, "", "", "", None)) + 80
    with pytest.raises(ValueError, match=r"judge prompts can be \d+ tokens .* raise judge.rollout.prompt_length"):
        judge_context(cfg, tokenizer, 128, 32)
    long = JudgeConfig(enable=True, model=ModelConfig(path=tiny), rollout=RolloutConfig(prompt_length=2040))
    with pytest.raises(ValueError, match=r"more than the judge model's context \(2048 tokens"):
        judge_context(long, tokenizer, 128, 32)
    run = load_config(  # the check `hybridflow train` runs on its inputs, before any worker starts
        RunConfig, None, ["judge.enable=true", f"judge.model.path={tiny}", "judge.rollout.prompt_length=100"]
    )
    with pytest.raises(ValueError, match=r"more than judge.rollout.prompt_length=100; raise"):
        check_judge_prompts(run)


@pytest.mark.slow
def test_a_ray_run_rewards_the_judge_alone(tiny, tmp_path: Path):
    """2 steps on Ray with the judge colocated: every response's reward is the judge's 0.6 (the rule's withheld),
    the judge's time is in the step timing and the profile, its metrics in every step."""
    args = [
        "train",
        *base_overrides(tiny, tmp_path),
        "trainer.n_workers_per_node=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.backend=ray",
        "judge.enable=true",
        f"judge.model.path={tiny}",
        f"judge.parser={NEWLINES}",
        f"judge.rollout.response_length={VERDICT_TOKENS}",
    ]
    proc = run_cli(args, tmp_path, module="hybridflow.cli.main")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [r for r in read_metrics(tmp_path) if "timing_s/step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert row["critic/score/mean"] == pytest.approx(FIXED_SCORE)  # 4 prompts x 2 samples, each judged 0.6
        assert row["judge/score_mean"] == pytest.approx(FIXED_SCORE) and row["judge/yes_rate"] == 1.0
        assert row["judge/invalid"] == row["judge/failed"] == row["judge/overlong"] == 0
        assert 0 <= row["judge/rule_agreement"] <= 1 and "reward/mean" in row
        assert 0 < row["timing_s/judge"] <= row["timing_s/reward"]
    profile = json.loads((tmp_path / "logs" / "profile.json").read_text())
    assert any(op["metric"] == "timing_s/judge" for op in profile), profile


def test_verls_generative_reward_model_keys_are_the_judge(tiny):
    """verl's GenRM (reward_model.enable + model.path + rollout.*) is the judge; without rollout.name, the same
    keys are the scalar reward model's, and verl's generated defaults for reward_model.rollout.* load unused."""
    cfg = load_config(
        RunConfig,
        None,
        [
            "reward_model.enable=true",
            f"reward_model.model.path={tiny}",
            "reward_model.rollout.name=native",
            "reward_model.rollout.tensor_model_parallel_size=1",
            "reward_model.rollout.response_length=16",
            "reward_model.rollout.dtype=bfloat16",
            "reward_model.rollout.max_num_seqs=32",
        ],
    )
    j = cfg.judge
    assert (j.enable, j.model.path, j.rollout.name, j.rollout.response_length) == (True, tiny, "native", 16)
    assert (j.rollout.dtype, j.rollout.max_batch_size, cfg.reward_model.enable) == ("bf16", 32, False)
    unused = load_config(
        RunConfig, None, ["reward_model.rollout.name=???", "reward_model.rollout.tensor_model_parallel_size=2"]
    )
    assert not unused.judge.enable and unused.judge.rollout.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="judge.rollout.tensor_model_parallel_size=2"):
        load_config(
            RunConfig,
            None,
            [
                "reward_model.enable=true",
                "reward_model.rollout.name=native",
                "reward_model.rollout.tensor_model_parallel_size=2",  # verl's default for its reward model
            ],
        )
