"""The bounds the OpenAI-compatible server puts on one request and on its own load (issue 56).

Every bound is a field of `ServerLimits` with its default; `hybridflow serve` takes them as `key=value`
arguments (`parse_limits`), the harness server (endpoint/harness.py) derives its own from `rollout.agent`.
A request past a bound is refused before it reaches the batcher, alone, with a 4xx naming the bound
(server.py lists the status codes); `max_tokens` above the backend's `--max-tokens` is clamped, not refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class ServerLimits:
    """Bounds on a request's size and on the server's load (module docstring)."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body in bytes; a larger one is answered 413 without being read past the bound."""
    max_n: int = 16
    """Largest `n` (choices per request)."""
    max_prompt_tokens: int = 16384
    """Most prompt tokens of one prompt (after the chat template); the model's own context length also applies."""
    max_prompts: int = 64
    """Most prompts in one `/v1/completions` request (`prompt` given as a list)."""
    max_messages: int = 1024
    """Most messages in one chat request."""
    max_stop: int = 16
    """Most stop strings in one request."""
    max_stop_chars: int = 256
    """Longest stop string, in characters."""
    request_timeout_s: float = 300.0
    """Seconds a request may take from its arrival to its answer; past it, its work is cancelled and it gets 504."""
    max_queued: int = 256
    """Requests admitted at once (being prepared, queued or generating); one more gets 503 with Retry-After."""
    retry_after_s: int = 1
    """The Retry-After (seconds) of a 503 sent when `max_queued` requests are in."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:  # also refuses NaN
                raise ValueError(f"serve limit {f.name} must be > 0, got {value!r}")


def parse_limits(items: list[str]) -> ServerLimits:
    """`ServerLimits` from `key=value` strings (e.g. `["max_n=4", "request_timeout_s=60"]`); raises ValueError
    naming a key that is unknown or a value of the wrong type."""
    bad = [item for item in items if "=" not in item]
    if bad:
        raise ValueError(f"serve limits are key=value, got {bad[0]!r}; keys: {', '.join(_keys())}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(ServerLimits), OmegaConf.from_dotlist(items))
        return OmegaConf.to_object(merged)  # runs __post_init__
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ValueError(f"serve limit {key}: {err.msg.splitlines()[0]}; keys: {', '.join(_keys())}") from None


def _keys() -> list[str]:
    return [f.name for f in dataclasses.fields(ServerLimits)]
