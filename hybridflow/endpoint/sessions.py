"""Per-session token capture of the OpenAI-compatible server: every token as sampled, never re-tokenized.

A session (server.py says how a request names its session; the store takes any hashable key, the
server's is the pair (owner, session id)) holds one or more *branches*; a
branch is one trajectory: its first prompt's ids, then model tokens (mask 1, with their
sampling log-probs) and observation tokens (mask 0, log-prob 0), plus the chat messages that
those ids stand for (the assistant ones as the server returned them).

A chat request whose messages (and tools) start with all of a branch's messages extends that
branch: its prompt is the branch's ids plus the template delta of the new messages
(`tokens.observation_ids`), so what the model sampled is never decoded and re-encoded. A turn
that did not end on a sampled end-of-turn id (cut by `max_tokens` or a stop string) is first
closed with the template's end-of-turn id, as an observation token (mask 0). Of several
matching branches the longest is extended; with `n > 1` the first choice extends it and each
other choice forks a copy.

A request that extends no branch of a non-empty session (the harness edited, dropped or
re-ordered history) is a *mismatch*: with `on_mismatch="split"` it starts a new branch from the
fresh prompt, with "refuse" it is rejected (`HistoryMismatch`); either way `metrics` counts it.
Text completions (`/v1/completions`) always start a new branch.

Messages are compared after `normalize_message`: role, text content, tool calls as (name, parsed
arguments), ignoring ids and fields the OpenAI client adds (`refusal`, `annotations`, ...).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agent.loop.runner import Trajectory
from hybridflow.agent.loop.tokens import encode, observation_ids, prompt_ids
from hybridflow.agent.loop.tool_calls import format_tool_call, render_messages
from hybridflow.endpoint.backend import Sample

Message = dict[str, Any]
MISMATCH_POLICIES = ("split", "refuse")


class HistoryMismatch(ValueError):
    """A request's messages extend no recorded branch of its session and the policy is "refuse"."""


def message_text(content: Any) -> str:
    """An OpenAI message `content` (None, a string, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _call_key(call: dict[str, Any]) -> tuple[str, str]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # not JSON: compared as the raw string the client sent
    return str(fn.get("name", "")), json.dumps(args, sort_keys=True)


def normalize_message(message: Message) -> tuple:
    """The parts of a message that decide whether two histories are the same (module docstring)."""
    calls = tuple(_call_key(c) for c in message.get("tool_calls") or ())
    return message.get("role"), message_text(message.get("content")).strip(), calls


def template_message(message: Message) -> Message:
    """An OpenAI message as the chat template takes it: text content, tool calls written in the
    `<tool_call>` format into an assistant's content."""
    text = message_text(message.get("content"))
    calls = message.get("tool_calls") or ()
    if calls:
        written = [format_tool_call(*_name_args(c)) for c in calls]
        text = "\n".join(([text] if text else []) + written)
    return {"role": message["role"], "content": text}


def _name_args(call: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    name, args = _call_key(call)
    parsed = json.loads(args)
    return name, parsed if isinstance(parsed, dict) else {}


@dataclass
class Branch:
    """One recorded trajectory of a session (module docstring)."""

    prompt_ids: list[int]
    tools: list[dict[str, Any]]
    messages: list[Message]
    keys: list[tuple] = field(default_factory=list)
    """`normalize_message` of each message, for prefix matching."""
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    sampled_ids: list[int] = field(default_factory=list)
    """Each completion's ids as the server's backend returned them, concatenated (token parity's reference)."""
    reward_positions: list[int] = field(default_factory=list)
    user_turns: int = 0
    last_closed: bool = True
    """Whether the last model turn ended on a sampled end-of-turn id."""
    finish_reason: str = ""

    @property
    def ids(self) -> list[int]:
        """Prompt and response ids: what the model sees next."""
        return self.prompt_ids + self.response_ids

    def to_trajectory(self, row_index: int) -> Trajectory:
        """This branch in the agent loop's `Trajectory` shape (rewards empty: the trainer scores it)."""
        calls = sum(len(m.get("tool_calls") or ()) for m in self.messages if m.get("role") == "assistant")
        traj = Trajectory(row_index, list(self.prompt_ids), list(self.tools), copy.deepcopy(self.messages))
        traj.response_ids, traj.response_mask = list(self.response_ids), list(self.response_mask)
        traj.rollout_log_probs, traj.reward_positions = list(self.log_probs), list(self.reward_positions)
        traj.sampled_ids = list(self.sampled_ids)
        traj.turn_rewards = [0.0] * len(self.reward_positions)
        traj.assistant_turns, traj.user_turns, traj.tool_calls = len(self.reward_positions), self.user_turns, calls
        traj.stop_reason = self.finish_reason or "length"
        return traj


@dataclass
class Pending:
    """A request's prompt, and where its samples go once generated (`SessionStore.commit`)."""

    session_id: Hashable
    prompt_ids: list[int]
    branch: Branch
    """The branch extended, or a new one (not yet stored) whose prompt is `prompt_ids`."""
    base_len: int
    """`len(branch.response_ids)` before this request's observation tokens (to detect a concurrent extension)."""
    messages: list[Message]
    is_new: bool
    delta: list[int] = field(default_factory=list)
    """The observation ids this request appends to the branch before its samples (mask 0)."""


class SessionStore:
    """All sessions' branches, thread-safe (module docstring)."""

    def __init__(
        self, tokenizer: Any, stop_ids: Sequence[int], on_mismatch: str = "split", max_sessions: int | None = None
    ) -> None:
        if on_mismatch not in MISMATCH_POLICIES:
            raise ValueError(f"on_mismatch must be one of {MISMATCH_POLICIES}, got {on_mismatch!r}")
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids)
        self.on_mismatch = on_mismatch
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"max_sessions must be None or >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        counters = ("requests", "extended", "split", "refused", "evicted")
        self.metrics = {f"sessions/{name}": 0 for name in counters}
        self._sessions: dict[Hashable, list[Branch]] = {}
        self._lock = threading.Lock()
        self._end_id = _turn_end_id(tokenizer, self.stop_ids)

    def begin_chat(self, session_id: Hashable, messages: list[Message], tools: list[dict[str, Any]]) -> Pending:
        """The prompt of a chat request: a recorded branch's ids + the new messages' delta, or a fresh
        prompt (new session, or a mismatch under "split"); raises `HistoryMismatch` under "refuse"."""
        keys = [normalize_message(m) for m in messages]
        with self._lock:
            self.metrics["sessions/requests"] += 1
            branches = self._sessions.get(session_id, [])
            match = _longest_prefix(branches, keys, tools)
            if match is None and branches:
                if self.on_mismatch == "refuse":
                    self.metrics["sessions/refused"] += 1
                    raise HistoryMismatch(
                        f"the messages extend none of this session's {len(branches)} recorded "
                        "conversation(s) (history was edited); start a new session id"
                    )
                self.metrics["sessions/split"] += 1
            if match is not None:
                self.metrics["sessions/extended"] += 1
                snapshot = _copy_branch(match)
        if match is None:
            ids = prompt_ids(self.tokenizer, [template_message(m) for m in messages], tools or None)
            return Pending(session_id, ids, Branch(ids, list(tools), []), 0, list(messages), True)
        new = [template_message(m) for m in messages[len(snapshot.messages) :]]
        closing = [] if snapshot.last_closed else [self._end_id]
        delta = closing + observation_ids(self.tokenizer, new, self.stop_ids, tools or None)
        return Pending(
            session_id, snapshot.ids + delta, match, len(snapshot.response_ids), list(messages), False, delta
        )

    def begin_completion(self, session_id: Hashable, prompt: list[int]) -> Pending:
        """A text completion: always a new branch whose prompt is `prompt`."""
        with self._lock:
            self.metrics["sessions/requests"] += 1
        return Pending(session_id, list(prompt), Branch(list(prompt), [], []), 0, [], True)

    def commit(self, pending: Pending, samples: list[Sample], replies: list[Message]) -> None:
        """Record each sample (with the assistant message returned for it) on `pending`'s branch: the
        first extends it, the others fork copies of it."""
        with self._lock:
            branches = self._sessions.pop(pending.session_id, [])
            self._sessions[pending.session_id] = branches  # the most recently used last
            self._evict()
            base = pending.branch
            if not pending.is_new and len(base.response_ids) != pending.base_len:
                base = _truncated(base, pending.base_len)  # another request extended it meanwhile: fork
            if not any(b is base for b in branches):  # new, forked, or popped by the trainer meanwhile
                branches.append(base)
            delta = pending.delta
            forks = [_copy_branch(base) for _ in samples[1:]]
            branches.extend(forks)
            for branch, sample, reply in zip([base, *forks], samples, replies):
                _append(branch, delta, pending.messages, sample, reply)

    def _evict(self) -> None:
        while self.max_sessions is not None and len(self._sessions) > self.max_sessions:
            del self._sessions[next(iter(self._sessions))]  # the least recently used
            self.metrics["sessions/evicted"] += 1

    def pop(self, session_id: Hashable, row_index: int = 0) -> list[Trajectory]:
        """Remove a session and return its branches as trajectories (none: an unknown id)."""
        with self._lock:
            branches = self._sessions.pop(session_id, [])
        return [b.to_trajectory(row_index) for b in branches]

    def pop_all(self) -> dict[Hashable, list[Trajectory]]:
        """Remove every session; returns session id -> its trajectories (row_index 0)."""
        with self._lock:
            ids = list(self._sessions)
        return {sid: self.pop(sid) for sid in ids}


def _append(branch: Branch, delta: list[int], messages: list[Message], sample: Sample, reply: Message) -> None:
    if delta:
        branch.response_ids += delta
        branch.response_mask += [0] * len(delta)
        branch.log_probs += [0.0] * len(delta)
        branch.user_turns += 1
    branch.sampled_ids += sample.token_ids
    branch.response_ids += sample.token_ids
    branch.response_mask += [1] * len(sample.token_ids)
    branch.log_probs += list(sample.log_probs)
    branch.reward_positions.append(max(len(branch.response_ids) - 1, 0))
    branch.last_closed = sample.stopped_on_id
    branch.finish_reason = sample.finish_reason
    branch.messages = [*copy.deepcopy(messages), reply]
    branch.keys = [normalize_message(m) for m in branch.messages]


def _longest_prefix(branches: list[Branch], keys: list[tuple], tools: list[dict[str, Any]]) -> Branch | None:
    fits = [
        b for b in branches if b.keys and len(b.keys) < len(keys) and keys[: len(b.keys)] == b.keys and b.tools == tools
    ]
    return max(fits, key=lambda b: len(b.keys), default=None)


def _copy_branch(branch: Branch) -> Branch:
    return copy.deepcopy(branch)


def _truncated(branch: Branch, length: int) -> Branch:
    """A copy of `branch` as it was when its response had `length` ids (before a concurrent extension)."""
    out = copy.deepcopy(branch)
    out.response_ids, out.response_mask, out.log_probs = (
        x[:length] for x in (out.response_ids, out.response_mask, out.log_probs)
    )
    out.reward_positions = [p for p in out.reward_positions if p < length]
    out.sampled_ids = out.sampled_ids[: sum(out.response_mask)]
    return out


def _turn_end_id(tokenizer: Any, stop_ids: Sequence[int]) -> int:
    """The stop id with which the chat template ends an assistant turn (closes a turn cut short)."""
    rendered, _ = render_messages(tokenizer, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    ids = encode(tokenizer, tokenizer.apply_chat_template(rendered, tokenize=False))
    ends = [t for t in ids if t in set(stop_ids)]
    return ends[-1] if ends else stop_ids[0]
