"""OpenAI API request parsing and response building for the server (no HTTP, no sessions here).

Request bodies are read as plain JSON objects; a bad field raises `RequestError` (HTTP 400, the
OpenAI error shape) naming it. Responses follow the OpenAI chat/completions objects; each choice
also carries `token_ids`, the sampled ids it was decoded from (an extension the OpenAI client
keeps as an extra field).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hybridflow.agent.loop.tool_calls import parse_tool_calls
from hybridflow.endpoint.backend import Sample
from hybridflow.endpoint.limits import ServerLimits


class RequestError(ValueError):
    """A request the server refuses (HTTP `status`), with the OpenAI error `code`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
    """The OpenAI error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Params:
    """The sampling fields of one request, checked."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...]
    logprobs: bool


def parse_params(body: dict[str, Any], max_tokens_cap: int, limits: ServerLimits) -> Params:
    """The sampling params of a chat or completion request body; raises `RequestError` naming a bad
    field. `max_tokens` (or `max_completion_tokens`) defaults to, and is clamped at, `max_tokens_cap`;
    `n` and the stop strings are bounded by `limits`."""
    if body.get("stream"):
        raise RequestError("stream=true is not supported by this server; send the request without stream", "stream")
    n = _number(body, "n", 1, int)
    temperature = _number(body, "temperature", 1.0, float)
    top_p = _number(body, "top_p", 1.0, float)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = max_tokens_cap if limit is None else _number({"max_tokens": limit}, "max_tokens", 1, int)
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"n must be between 1 and {limits.max_n} (this server's max_n), got {n}", "n")
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}", "temperature")
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    logprobs = body.get("logprobs") not in (None, False)  # completions: 0 still asks for the sampled tokens'
    return Params(n, temperature, top_p, min(max_tokens, max_tokens_cap), _stop(body, limits), logprobs)


def _stop(body: dict[str, Any], limits: ServerLimits) -> tuple[str, ...]:
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(stop) > limits.max_stop:
        raise RequestError(f"stop has {len(stop)} strings; this server takes at most {limits.max_stop}", "stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise RequestError(f"a stop string is longer than this server's {limits.max_stop_chars} characters", "stop")
    return tuple(stop)


def _number(body: dict[str, Any], key: str, default: float, kind: type) -> Any:
    """`body[key]` as a finite `kind` (int: a whole number), or `default` when absent."""
    value = body.get(key)
    if value is None:
        return default
    wanted = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{key} must be {wanted}, got a {type(value).__name__}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{key} must be a finite number, got {value}", key)
    if kind is int:
        if value != int(value):
            raise RequestError(f"{key} must be {wanted}, got {value}", key)
        return int(value)
    if isinstance(value, int) and abs(value) > 1e6:  # float() of a huge JSON integer overflows
        raise RequestError(f"{key} is out of range", key)
    return float(value)


def parse_messages(body: dict[str, Any], limits: ServerLimits) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) of a chat request; raises `RequestError` when they are missing or malformed.
    A message's content is a string, null, or a list of text parts (`{"type": "text", "text": ...}`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > limits.max_messages:
        raise RequestError(f"{len(messages)} messages; this server takes at most {limits.max_messages}", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}] needs a role of system, user, assistant or tool", "messages")
        if not _is_text(m.get("content")):
            raise RequestError(
                f"messages[{i}].content must be a string or a list of text parts ({{type: text, text: ...}})",
                "messages",
            )
        if not _are_tool_calls(m.get("tool_calls")):
            raise RequestError(f"messages[{i}].tool_calls must be a list of function calls", "messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("tools must be a list of function schemas", "tools")
    return messages, tools


def _is_text(content: Any) -> bool:
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str) for p in content
    )


def _are_tool_calls(calls: Any) -> bool:
    if calls is None:
        return True
    return isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(fn := c.get("function", c), dict)
        and isinstance(fn.get("name", ""), str)
        and isinstance(fn.get("arguments", {}), (str, dict))
        for c in calls
    )


def parse_prompt(prompt: Any, limits: ServerLimits, vocab_size: int) -> list[str] | list[list[int]]:
    """A completion request's `prompt` as a list of strings or one list of token ids (each id in
    `[0, vocab_size)`), at most `limits.max_prompts` of them; raises `RequestError` otherwise."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt must be a string, a list of strings or a list of token ids", "prompt")
    if all(isinstance(p, str) for p in prompt):
        if len(prompt) > limits.max_prompts:
            raise RequestError(f"{len(prompt)} prompts; this server takes at most {limits.max_prompts}", "prompt")
        return list(prompt)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("prompt must be a string, a list of strings or a list of token ids", "prompt")
    if not all(0 <= t < vocab_size for t in prompt):
        raise RequestError(f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary)", "prompt")
    return [list(prompt)]


def assistant_reply(text: str, with_tools: bool) -> tuple[dict[str, Any], bool]:
    """(the assistant message for `text`, whether it calls tools): with tools in the request, each
    well-formed `<tool_call>` block becomes an OpenAI tool call and leaves the content."""
    parsed = parse_tool_calls(text) if with_tools else None
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": text}, False
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in parsed.calls
    ]
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, True


def chat_logprobs(tokenizer: Any, sample: Sample) -> dict[str, Any]:
    """The `logprobs` object of a chat choice (no alternatives: `top_logprobs` empty)."""
    content = []
    for token_id, logprob in zip(sample.token_ids, sample.log_probs):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content}


def completion_logprobs(tokenizer: Any, sample: Sample) -> dict[str, Any]:
    """The legacy `logprobs` object of a completion choice."""
    tokens = [tokenizer.decode([t]) for t in sample.token_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": list(sample.log_probs), "top_logprobs": None, "text_offset": offsets}


def envelope(kind: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int, samples: list[Sample]):
    """The response object around `choices` ("chat.completion" or "text_completion") with usage."""
    completion = sum(len(s.token_ids) for s in samples)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
    }
