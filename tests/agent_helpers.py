"""Shared pieces of the agent tests: a Qwen2-style chat template and a tiny-model turn generator."""

from __future__ import annotations

import copy
from typing import Any

import torch

QWEN2_STYLE_TEMPLATE = (
    r"{%- if tools %}{{- '<|im_start|>system\n# Tools\n\n<tools>' }}{%- for tool in tools %}{{- '\n' }}"
    r"{{- tool | tojson }}{%- endfor %}{{- '\n</tools><|im_end|>\n' }}{%- endif %}"
    r"{%- for message in messages %}{%- if message.role == 'tool' %}"
    r"{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    r"{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    r"{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    r"{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""Qwen2's tool conventions: schemas in a system turn, consecutive tool results grouped in one
user turn as `<tool_response>` blocks."""


def with_template(tokenizer: Any, template: str) -> Any:
    """A copy of `tokenizer` that renders chats with `template`."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


class ForceStop:
    """Logits processor: row r must emit `stop_id` once it has generated `lengths[r]` tokens."""

    def __init__(self, start: int, lengths: list[int], stop_id: int) -> None:
        self.start, self.lengths, self.stop_id = start, lengths, stop_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.start
        for row, length in enumerate(self.lengths):
            if step >= length:
                scores[row] = float("-inf")
                scores[row, self.stop_id] = 0.0
        return scores


def tiny_generate(model: Any, stop_id: int, pad_id: int, seed: int, record: list):
    """A `GenerateFn` sampling with HF `generate` (temperature 1, every turn forced to stop within
    2-6 tokens so several turns fit); appends each call's outputs to `record`."""
    from transformers import LogitsProcessorList

    from hybridflow.agent.loop.runner import TurnOutput

    rng = torch.Generator().manual_seed(seed)

    def generate(batch: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        width = max(len(r) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in batch])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
        lengths = [int(torch.randint(1, 6, (1,), generator=rng)) for _ in batch]
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets), do_sample=True, top_k=0, top_p=1.0,
            temperature=1.0, eos_token_id=stop_id, pad_token_id=pad_id, return_dict_in_generate=True,
            output_scores=True, logits_processor=LogitsProcessorList([ForceStop(width, lengths, stop_id)]),
        )  # fmt: skip
        new = out.sequences[:, width:]
        logps = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, new[..., None])[..., 0]
        turns = []
        for row, budget in enumerate(budgets):
            tokens = new[row, :budget].tolist()
            end = tokens.index(stop_id) + 1 if stop_id in tokens else len(tokens)
            turns.append(TurnOutput(tokens[:end], logps[row, :end].tolist()))
        record.append(turns)
        return turns

    return generate
