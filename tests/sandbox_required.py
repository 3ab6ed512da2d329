"""The python sandbox's test modules' guard: skip where the machine cannot host the sandbox (not root, no
bubblewrap, the kernel or a container refusing namespaces), fail where it can but the sandbox does not start."""

from __future__ import annotations

import functools
import re

import pytest

from hybridflow.agent.loop.tools.sandbox import SandboxConfig, SandboxUnavailableError, check_machine, run_python

REFUSED = re.compile(r"namespace|Operation not permitted|Permission denied")
"""bubblewrap's messages where the kernel or a container's seccomp profile refuses the namespaces."""


@functools.cache
def machine_problem() -> str | None:
    """Why this machine cannot run the sandbox at all, or None; a start failure of any other kind raises."""
    try:
        check_machine()
        run_python("print(1)", SandboxConfig(tree_limits="rlimit", timeout_s=60))
    except SandboxUnavailableError as exc:
        if "could not start" in str(exc) and not REFUSED.search(str(exc)):
            raise
        return str(exc)
    return None


def require_sandbox() -> None:
    """Skip the calling module where `machine_problem()` names one."""
    problem = machine_problem()
    if problem is not None:
        pytest.skip(f"no sandbox here: {problem}", allow_module_level=True)
