"""OpenAI API request parsing and response building for the server (no HTTP, no sessions here).

Request bodies are read as plain JSON objects; a bad field raises `RequestError` (HTTP 400, the
OpenAI error shape) naming it. Responses follow the OpenAI chat/completions objects; each choice
also carries `token_ids`, the sampled ids it was decoded from (an extension the OpenAI client
keeps as an extra field).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hybridflow.agent.loop.tool_calls import parse_tool_calls
from hybridflow.agent.server.backend import Sample


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


def parse_params(body: dict[str, Any], max_tokens_cap: int) -> Params:
    """The sampling params of a chat or completion request body; raises `RequestError` naming a bad
    field. `max_tokens` (or `max_completion_tokens`) defaults to, and is clamped at, `max_tokens_cap`."""
    if body.get("stream"):
        raise RequestError("stream=true is not supported by this server; send the request without stream", "stream")
    n = _number(body, "n", 1, int)
    temperature = _number(body, "temperature", 1.0, float)
    top_p = _number(body, "top_p", 1.0, float)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = max_tokens_cap if limit is None else _number({"max_tokens": limit}, "max_tokens", 1, int)
    if n < 1:
        raise RequestError(f"n must be >= 1, got {n}", "n")
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}", "temperature")
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    logprobs = body.get("logprobs") not in (None, False)  # completions: 0 still asks for the sampled tokens'
    return Params(n, temperature, top_p, min(max_tokens, max_tokens_cap), stop, logprobs)


def _number(body: dict[str, Any], key: str, default: float, kind: type) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise RequestError(f"{key} must be a{'n integer' if kind is int else ' number'}, got {value!r}", key)
    return kind(value)


def parse_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) of a chat request; raises `RequestError` when they are missing or malformed."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}] needs a role of system, user, assistant or tool", "messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError("tools must be a list of function schemas", "tools")
    return messages, tools


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
