"""The two kinds of failure a Tinker future reports (`category` of a failed future)."""

from __future__ import annotations


class UserError(ValueError):
    """The request is wrong (unknown model, bad data, taken checkpoint name ...): category "user"."""


class ServerError(RuntimeError):
    """The service failed on a valid request: category "server"."""
