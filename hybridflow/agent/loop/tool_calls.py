"""Tool calls in assistant text, and tool schemas / results in the chat template.

The format is the Qwen2 / Hermes one: the assistant writes each call as

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

and tool results go back as messages of role `tool`. `parse_tool_calls` never raises on
model text: a call whose JSON is broken, lacks a name or has non-object arguments becomes an
error string the environment returns to the model as an observation.

Rendering (`render_messages`):
- tool schemas: passed as the template's `tools=` argument when the template renders them;
  otherwise (SmolLM2-135M-Instruct's template ignores `tools`) a system message holding
  `tools_system_prompt(tools)` (a compact listing, not the Hermes text) is put first (merged
  into an existing system message).
- tool results: role `tool` when the template renders a tool message's content (SmolLM2's
  renders any role as `<|im_start|>tool\\n...<|im_end|>`; Qwen2's wraps it in a user turn with
  `<tool_response>`); otherwise (a template that raises on, or drops, the tool role) the
  fallback is a `user` message `<tool_response>\\n{content}\\n</tool_response>`.

Departures from verl: verl picks a parser per model family (`format: hermes`) and takes tool
schemas from `tool_config_path`; here the Hermes format is the one format, and the fallbacks
above are probed from the template itself instead of configured.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_SENTINEL = "hf-sentinel-7f3a"


@dataclass
class ToolCall:
    """One well-formed call: a tool name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """An assistant turn split into its text, its well-formed calls and the problems of the rest."""

    content: str
    """The turn's text outside every `<tool_call>` block, stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One readable message per malformed call, meant as an observation for the model."""

    @property
    def has_calls(self) -> bool:
        """True when the turn tried to call a tool (well-formed or not)."""
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split assistant `text` into content, calls and per-call errors; never raises on model output."""
    calls, errors = [], []
    for i, match in enumerate(_CALL_RE.finditer(text), start=1):
        call, error = _parse_one(match.group(1))
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {i}: {error}")
    rest = _CALL_RE.sub("", text)
    if CALL_OPEN in rest:
        errors.append(f"tool call {len(calls) + len(errors) + 1}: {CALL_OPEN} without a closing {CALL_CLOSE}")
        rest = rest[: rest.index(CALL_OPEN)]
    return ParsedTurn(rest.strip(), calls, errors)


def _parse_one(body: str) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at char {exc.pos}); write {format_tool_call('name', {})}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, 'expected a JSON object with a string "name" and an object "arguments"'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f'"arguments" of {obj["name"]!r} is a string that is not JSON'
    if not isinstance(args, dict):
        return None, f'"arguments" of {obj["name"]!r} must be a JSON object, got {type(args).__name__}'
    return ToolCall(obj["name"], args), ""


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text an assistant writes to call `name` (what `parse_tool_calls` reads back)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system prompt for templates that do not render `tools=`: one line per tool, then the call format.

    Each tool is `name(arg: type, ...): description`, and the call format is shown with the first
    tool's name and arguments. It is about a third of the Hermes prompt's tokens (66 vs 188 for the
    calculator with SmolLM2's tokenizer), which every prompt of a run pays in the forward and backward.
    """
    lines = ["You can call these tools:"]
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters", {}).get("properties", {})
        signature = ", ".join(f"{name}: {spec.get('type', 'any')}" for name, spec in params.items())
        lines.append(f"- {fn['name']}({signature}): {fn.get('description', '')}".rstrip(": "))
    first = tools[0].get("function", tools[0])
    example = {name: "..." for name in first.get("parameters", {}).get("properties", {})}
    lines.append("To call a tool, write:")
    lines.append(format_tool_call(first["name"], example))
    return "\n".join(lines)


def fallback_tool_message(content: str) -> dict[str, str]:
    """A tool result as a user message, for templates that cannot render role `tool`."""
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts the `tools=` schemas into the prompt."""
    return _probe(tokenizer)[0]


def template_renders_tool_role(tokenizer: Any) -> bool:
    """Whether the chat template renders the content of a `tool` role message."""
    return _probe(tokenizer)[1]


@lru_cache(maxsize=16)
def _probe_template(template: str | None, tokenizer: Any) -> tuple[bool, bool]:
    schema = {"type": "function", "function": {"name": _SENTINEL, "description": "", "parameters": {}}}
    user = [{"role": "user", "content": "hi"}]
    tool_turn = user + [{"role": "assistant", "content": "ok"}, {"role": "tool", "content": _SENTINEL}]
    results = []
    for messages, kwargs in ((user, {"tools": [schema]}), (tool_turn, {})):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception:  # a template may raise on roles it does not know (jinja2 exceptions)
            text = ""
        results.append(_SENTINEL in text)
    return results[0], results[1]


def _probe(tokenizer: Any) -> tuple[bool, bool]:
    return _probe_template(getattr(tokenizer, "chat_template", None), tokenizer)


def render_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, apply_chat_template kwargs) for `tokenizer`, with the fallbacks of the module docstring."""
    out = [tool_message_for(tokenizer, m["content"]) if m["role"] == "tool" else dict(m) for m in messages]
    if not tools:
        return out, {}
    if template_renders_tools(tokenizer):
        return out, {"tools": tools}
    prompt = tools_system_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def tool_message_for(tokenizer: Any, content: str) -> dict[str, str]:
    """A tool result as the message `tokenizer`'s template renders: role `tool`, or the fallback."""
    if template_renders_tool_role(tokenizer):
        return {"role": "tool", "content": content}
    return fallback_tool_message(content)
