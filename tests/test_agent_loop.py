"""The multi-turn agent loop: trained ids == sampled ids, masks, rewards, stops, failures."""

from __future__ import annotations

import pytest
import torch

from hybridflow.agent.loop.env import Environment, ResetResult, StepResult, make_env
from hybridflow.agent.loop.runner import AgentLoopConfig, Trajectory, TurnOutput, run_agent_loop
from hybridflow.agent.loop.tokens import TemplateDeltaError, encode, observation_ids
from hybridflow.agent.loop.tool_calls import format_tool_call, render_messages
from hybridflow.data.tasks import make_difficulty, make_rows
from tests.agent_helpers import QWEN2_STYLE_TEMPLATE, tiny_generate, with_template


@pytest.fixture(scope="module")
def tiny():
    from hybridflow.models import load_causal_lm, load_tokenizer, tiny_model_dir

    path = tiny_model_dir("llama")
    return load_causal_lm(path).eval(), load_tokenizer(path)


@pytest.fixture(scope="module", params=["smollm2", "qwen2_style"])
def tok(request, tiny):
    return tiny[1] if request.param == "smollm2" else with_template(tiny[1], QWEN2_STYLE_TEMPLATE)


class Chatty(Environment):
    """Replies with a tool message to every turn; ends after `turns` turns with reward 1."""

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, row):
        return ResetResult([{"role": "user", "content": row["q"]}])

    def step(self, assistant_text):
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": f"obs {self.seen}: {assistant_text[:5]!r}"}], reward=0.1)


def _segments(traj: Trajectory) -> list[tuple[int, list[int]]]:
    """(mask value, ids) runs of a trajectory's response."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(traj.response_ids, traj.response_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


def test_trained_ids_are_the_sampled_ids_over_several_turns(tiny, tok):
    model, _ = tiny
    record: list[list[TurnOutput]] = []
    generate = tiny_generate(model, tok.eos_token_id, tok.pad_token_id, seed=0, record=record)
    rows = [{"q": f"question {i} " + "long " * i} for i in range(6)]
    config = AgentLoopConfig(response_length=200, max_turn_tokens=16, max_assistant_turns=5, max_user_turns=5)
    with torch.no_grad():
        trajs = run_agent_loop(rows, Chatty, generate, tok, config)
    assert len(record) == 3 and all(t.stop_reason == "done" for t in trajs)
    for i, traj in enumerate(trajs):
        sampled = [turns[i] for turns in record]  # every trajectory ran every round
        runs = _segments(traj)
        assert [ids for m, ids in runs if m == 1] == [s.token_ids for s in sampled]
        observations = [m for m in traj.messages if m["role"] == "tool"]
        want_obs = [observation_ids(tok, [o], [tok.eos_token_id]) for o in observations]
        assert [ids for m, ids in runs if m == 0] == want_obs and len(runs) == 5
        model_logps = [lp for lp, m in zip(traj.rollout_log_probs, traj.response_mask) if m]
        assert model_logps == [lp for s in sampled for lp in s.log_probs]
        assert traj.turn_rewards == [0.1, 0.1, 1.0] and traj.reward == pytest.approx(1.2)
        assert traj.reward_positions[-1] == len(traj.response_ids) - 1
        assert traj.response_ids[traj.reward_positions[0]] == tok.eos_token_id
        _assert_text_is_the_template_rendering(tok, traj)
    # The check has teeth: decoding and re-encoding (what a text-level loop does) changes the ids.
    drifted = [
        t for t in trajs if encode(tok, tok.decode(t.prompt_ids + t.response_ids)) != t.prompt_ids + t.response_ids
    ]
    assert drifted


def _assert_text_is_the_template_rendering(tok, traj: Trajectory) -> None:
    messages, kwargs = render_messages(tok, traj.messages, traj.tools)
    rendered = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    text = tok.decode(traj.prompt_ids + traj.response_ids)
    assert rendered.startswith(text) and rendered[len(text) :] == "\n"


@pytest.fixture(scope="module")
def tool_rows():
    return make_rows("tool_arithmetic", 2, "train", 0, make_difficulty("tool_arithmetic"))


def _scripted(tok, turns_per_row: list[list[str]]):
    """A GenerateFn returning the given turn texts (tokenized, + EOS) in order, per row."""
    calls = [0] * len(turns_per_row)

    def generate(batch, budgets):
        out = []
        for ids, budget in zip(batch, budgets):
            row = next(i for i, prompt in enumerate(prompts) if ids[: len(prompt)] == prompt)
            text = turns_per_row[row][calls[row]]
            calls[row] += 1
            out.append(TurnOutput((encode(tok, text) + [tok.eos_token_id])[:budget], None))
        return out

    prompts: list[list[int]] = []
    return generate, prompts


def test_tool_episode_scores_the_answer_and_masks_the_tool_result(tok, tool_rows):
    answers = [row["reward_model"]["ground_truth"] for row in tool_rows]
    script = [
        [format_tool_call("calculator", {"expression": tool_rows[0]["extra_info"]["expression"]}), answers[0]],
        ["I think it is 7.", "unused"],
    ]
    generate, prompts = _scripted(tok, script)
    from hybridflow.agent.loop.tokens import prompt_ids

    for row in tool_rows:
        start = make_env("tool").reset(row)
        prompts.append(prompt_ids(tok, start.messages, start.tools))
    trajs = run_agent_loop(tool_rows, lambda: make_env("tool"), generate, tok, AgentLoopConfig())
    first, second = trajs
    assert (first.reward, first.tool_calls, first.assistant_turns, first.stop_reason) == (1.0, 1, 2, "done")
    assert (second.reward, second.tool_calls, second.assistant_turns) == (0.0, 0, 1)
    assert [m for m, _ in _segments(first)] == [1, 0, 1] and first.messages[2]["content"] == answers[0]
    assert tok.decode(first.prompt_ids).count('"calculator"') >= 1  # the schemas reached the prompt
    _assert_text_is_the_template_rendering(tok, first)


def test_stop_reasons(tok):
    rows = [{"q": "a"}]

    def generate_text(text, eos=True):
        return lambda batch, budgets: [TurnOutput((encode(tok, text) + [tok.eos_token_id] * eos)[:b]) for b in budgets]

    def run(config, text="hello there", eos=True, turns=10):
        return run_agent_loop(rows, lambda: Chatty(turns), generate_text(text, eos), tok, config)[0]

    assert run(AgentLoopConfig(max_assistant_turns=2)).stop_reason == "max_assistant_turns"
    assert run(AgentLoopConfig(max_user_turns=1)).stop_reason == "max_user_turns"
    cut = run(AgentLoopConfig(max_turn_tokens=2))
    assert cut.stop_reason == "length" and len(cut.response_ids) == 2 and cut.turn_rewards == [0.0]
    no_eos = run(AgentLoopConfig(), eos=False)
    assert no_eos.stop_reason == "length" and no_eos.assistant_turns == 1
    tight = run(AgentLoopConfig(response_length=12))
    assert tight.stop_reason == "response_length" and len(tight.response_ids) < 12 and tight.response_mask[-1] == 1


def test_an_environment_that_raises_names_itself_and_the_row(tok):
    class Broken(Chatty):
        def reset(self, row):
            self.q = row["q"]
            return super().reset(row)

        def step(self, assistant_text):
            if self.q == "b":
                raise KeyError("no such thing")
            return super().step(assistant_text)

    generate = lambda batch, budgets: [TurnOutput([tok.eos_token_id]) for _ in batch]  # noqa: E731
    with pytest.raises(RuntimeError, match=r"environment 'broken' failed in step\(\) on row 1: KeyError"):
        run_agent_loop([{"q": "a"}, {"q": "b"}], Broken, generate, tok, AgentLoopConfig(), env_name="broken")


def test_a_template_without_the_stop_token_is_refused(tok):
    plain = with_template(tok, "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(TemplateDeltaError, match="stop tokens"):
        observation_ids(plain, [{"role": "tool", "content": "1"}], [tok.eos_token_id])


def test_trajectories_become_a_batch_in_the_rollout_layout(tok):
    from hybridflow.agent.loop.batch import trajectories_to_batch
    from hybridflow.protocol import keys

    texts = iter(["first", "second", "third", "fourth"])

    def generate(batch, budgets):
        return [TurnOutput(encode(tok, next(texts)) + [tok.eos_token_id], None) for _ in batch]

    rows = [{"q": "short"}, {"q": "a much longer question " * 3}]
    trajs = run_agent_loop(rows, lambda: Chatty(2), generate, tok, AgentLoopConfig())
    batch = trajectories_to_batch(trajs, tok.pad_token_id, response_length=64)
    prompts, responses = batch.batch[keys.PROMPTS], batch.batch[keys.RESPONSES]
    assert prompts.shape[1] == max(len(t.prompt_ids) for t in trajs) and responses.shape[1] == 64
    for i, traj in enumerate(trajs):
        n_p, n_r = len(traj.prompt_ids), len(traj.response_ids)
        assert prompts[i, prompts.shape[1] - n_p :].tolist() == traj.prompt_ids
        assert responses[i, :n_r].tolist() == traj.response_ids
        assert batch.batch[keys.RESPONSE_MASK][i, :n_r].tolist() == traj.response_mask
        assert batch.batch[keys.RESPONSE_MASK][i, n_r:].sum() == 0
        attention = batch.batch[keys.ATTENTION_MASK][i]
        assert attention.sum() == n_p + n_r and attention[prompts.shape[1] : prompts.shape[1] + n_r].all()
        scores = batch.batch[keys.TOKEN_LEVEL_SCORES][i]
        assert scores.sum().item() == pytest.approx(traj.reward) and scores[n_r - 1] == 1.0
        assert batch.non_tensor_batch["num_turns"][i] == 2 and batch.non_tensor_batch["stop_reason"][i] == "done"
    positions = batch.batch[keys.POSITION_IDS][0]
    first = prompts.shape[1] - len(trajs[0].prompt_ids)
    assert positions[first] == 0 and positions[first + len(trajs[0].prompt_ids)] == len(trajs[0].prompt_ids)
    with pytest.raises(ValueError, match="exceed the widths"):
        trajectories_to_batch(trajs, tok.pad_token_id, response_length=4)


def test_loop_times_split_generate_from_waiting_on_environments(tok):
    import time

    from hybridflow.agent.loop.runner import LoopTimes

    class Slow(Chatty):
        def step(self, assistant_text):
            time.sleep(0.05)
            return super().step(assistant_text)

    def generate(batch, budgets):
        time.sleep(0.02)
        return [TurnOutput([tok.eos_token_id]) for _ in batch]

    times = LoopTimes()
    config = AgentLoopConfig(max_parallel_steps=4)
    run_agent_loop([{"q": "a"}, {"q": "b"}, {"q": "c"}], lambda: Slow(3), generate, tok, config, times=times)
    assert times.rounds == 3
    assert 0.06 <= times.generate_s and 9 * 0.05 <= times.tool_s  # 3 generate calls; 3 x 3 steps, summed
    assert 0 < times.env_s < times.tool_s  # blocked on steps, but the 3 steps of a round ran side by side
    assert times.generate_s + times.env_s <= times.total_s
    metrics = times.metrics()
    assert metrics["agent/tool_time_s"] == times.tool_s
    assert metrics["agent/rounds"] == 3.0 and metrics["agent/env_time_s"] == times.env_s
    assert metrics["agent/env_time_share"] == pytest.approx(times.env_s / times.total_s)
    assert LoopTimes().metrics()["agent/env_time_share"] == 0.0
