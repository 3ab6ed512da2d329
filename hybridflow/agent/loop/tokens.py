"""Chat-template text -> token ids for the agent loop, without re-tokenizing model tokens.

The loop never decodes and re-encodes what the model sampled. It tokenizes only text the model
did not write, each piece once:
- `prompt_ids`: the first messages (and tool schemas) rendered by the template with the
  generation prompt;
- `observation_ids`: the template's rendering of observation messages placed after an
  assistant turn, as the *token delta* between two renderings of a fixed dummy conversation:
  `[user, assistant]` and `[user, assistant, *observations]` + generation prompt. The delta
  starts right after the assistant's end-of-turn token (the token at which the model stopped
  sampling), so it holds what the template puts between turns (e.g. `\\n<|im_start|>tool\\n
  ...<|im_end|>\\n<|im_start|>assistant\\n`).

Both renderings must agree on every token before the cut, and the dummy assistant turn must
end in one of the stop tokens; a template for which either fails raises `TemplateDeltaError`
instead of producing ids that would drift from what the model sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridflow.agent.loop.tool_calls import render_messages

Message = dict[str, Any]
_DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class TemplateDeltaError(ValueError):
    """The chat template does not render observations as a clean suffix of the conversation."""


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of template text (special tokens are in the text already, none added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The first messages (+ tools, with `render_messages`' fallbacks) as the model's prompt ids."""
    rendered, kwargs = render_messages(tokenizer, messages, tools)
    return encode(
        tokenizer, tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **kwargs)
    )


def observation_ids(
    tokenizer: Any, observations: list[Message], stop_ids: Sequence[int], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Ids to append after an assistant turn that ended in a stop token: the observations and the
    next generation prompt (module docstring)."""
    base, kwargs = render_messages(tokenizer, _DUMMY, tools)
    full, _ = render_messages(tokenizer, _DUMMY + list(observations), tools)
    base_ids = encode(tokenizer, tokenizer.apply_chat_template(base, tokenize=False, **kwargs))
    full_ids = encode(
        tokenizer, tokenizer.apply_chat_template(full, add_generation_prompt=True, tokenize=False, **kwargs)
    )
    stops = set(stop_ids)
    ends = [i for i, t in enumerate(base_ids) if t in stops]
    if not ends:
        raise TemplateDeltaError(
            f"the chat template ends an assistant turn with none of the stop tokens {sorted(stops)}; "
            "the agent loop cannot tell where a sampled turn ends in the template"
        )
    cut = ends[-1] + 1
    if full_ids[:cut] != base_ids[:cut]:
        raise TemplateDeltaError(
            "rendering observations after an assistant turn changes the tokens before them; "
            "the chat template does not extend a conversation append-only"
        )
    return full_ids[cut:]
