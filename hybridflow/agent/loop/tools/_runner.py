"""The first program inside the sandbox: lower the resource limits, then run `main.py` as `__main__`.

Run by `sandbox.py` as `python -I -S /hf/runner.py LIMITS_JSON` inside bubblewrap, already under the
sandbox's uid with no capabilities (this file imports only the standard library). It writes `READY` to
stdout first, so the caller tells "the code ran" (whatever it printed) from "the sandbox could not
start" (no marker). The limits are per process, hard = soft, so the code cannot raise them:
RLIMIT_CPU (SIGXCPU at the limit, SIGKILL a second later), RLIMIT_AS, RLIMIT_NPROC (the sandbox's uid
is used by this call alone, so it counts the whole tree), RLIMIT_FSIZE, no core files.
"""

import json
import os
import resource
import sys
import traceback

READY = "\x00hf-sandbox-ready\x00"


def set_limits(cfg: dict) -> None:
    """Apply the limits of `cfg` (module docstring)."""
    for name, value in (
        ("RLIMIT_CPU", cfg["cpu_seconds"]),
        ("RLIMIT_AS", cfg["memory_bytes"]),
        ("RLIMIT_NPROC", cfg["nproc"]),
        ("RLIMIT_FSIZE", cfg["max_file_bytes"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))


def run_code(path: str) -> None:
    """Execute `path` as `__main__` under the name main.py; an uncaught exception prints its traceback
    (without this file's frame) and exits 1."""
    with open(path) as fh:
        source = fh.read()
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    set_limits(cfg)
    sys.path[:0] = cfg["paths"]
    sys.argv = ["main.py"]
    sys.stdout.write(READY)
    sys.stdout.flush()
    try:
        run_code(os.path.join(os.getcwd(), "main.py"))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    main()
