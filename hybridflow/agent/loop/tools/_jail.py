"""The sandbox's child process: isolate itself, then run `main.py` of the scratch directory.

Run as `python -I _jail.py CONFIG_JSON` by `sandbox.py` (this file imports only the standard
library, so the worktree need not be importable in the child). In order:
1. `unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)`: a private mount table, a network
   namespace with no interface up (every connect fails), a PID namespace whose init is the
   process forked next. If that is refused, exit `UNAVAILABLE` without running anything.
2. The forked init (killed with its parent: PR_SET_PDEATHSIG; and when init dies the kernel
   kills every process of the namespace, so nothing the code spawns outlives the call)
   mounts empty tmpfs over /tmp, /var/tmp, /run and /dev/shm (no Unix socket of the host is
   reachable), binds the scratch directory back at its own path, remounts every other mount
   read-only, and mounts a fresh read-only /proc of the new PID namespace.
3. Init forks the worker (PID 2), which sets resource limits (CPU seconds: SIGXCPU at the
   limit, SIGKILL a second later; address space; processes; file size), chdirs to scratch,
   sets `no_new_privs` and drops every capability (bounding set and effective/permitted), so
   the code cannot undo the mounts or enter other namespaces with privilege; then it runs the
   code in this interpreter as `__main__`. Init exits with the worker's exit code (128 + N
   when signal N killed it), which ends the namespace.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback

UNAVAILABLE = 97
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
HIDDEN = ("/tmp", "/var/tmp", "/run", "/dev/shm")
_FLAG_BITS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}

libc = ctypes.CDLL(None, use_errno=True)


def fail(message: str) -> None:
    """Report that isolation could not be set up and exit without running the code."""
    sys.stderr.write(f"sandbox unavailable: {message}\n")
    sys.stderr.flush()
    os._exit(UNAVAILABLE)


def check(result: int, what: str) -> None:
    """Fail closed when a libc call returned an error."""
    if result != 0:
        err = ctypes.get_errno()
        fail(f"{what}: {os.strerror(err)} (errno {err})")


def mount(source, target, fstype, flags: int, what: str, data=None) -> None:
    """mount(2) with byte-string arguments; fails closed."""
    enc = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), what)


def mount_points() -> list:
    """(mount point, flags to keep) of every mount, deepest last; octal escapes decoded."""
    points = []
    with open("/proc/self/mounts") as fh:
        for line in fh:
            fields = line.split()
            point = fields[1].encode().decode("unicode_escape")
            keep = sum(bit for opt, bit in _FLAG_BITS.items() if opt in fields[3].split(","))
            points.append((point, keep))
    return points


def lock_filesystem(scratch: str) -> None:
    """Every mount read-only except `scratch`; the shared temporary and runtime directories
    (`HIDDEN`) replaced by empty ones, so no Unix socket there (Ray's, a daemon's) can be
    reached (connect() on a socket file ignores read-only mounts); /proc replaced by the new
    PID namespace's."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, "make mounts private")
    handle = os.open(scratch, os.O_PATH | os.O_DIRECTORY)  # reachable after its parent is hidden
    for directory in HIDDEN:
        if os.path.isdir(directory) and not os.path.islink(directory):
            mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"hide {directory}", "size=1m")
    os.makedirs(scratch, exist_ok=True)
    mount(f"/proc/self/fd/{handle}", scratch, None, MS_BIND, "bind the scratch directory")
    os.close(handle)
    for point, keep in mount_points():
        if point == scratch or not os.path.lexists(point):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | keep
        mount(None, point, None, flags, f"remount {point} read-only")
    mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mount /proc")


def set_limits(cfg: dict) -> None:
    """Apply the configured resource limits (hard = soft, so the code cannot raise them)."""
    for name, value in (
        ("RLIMIT_CPU", cfg["cpu_seconds"]),
        ("RLIMIT_AS", cfg["memory_bytes"]),
        ("RLIMIT_NPROC", cfg["max_processes"]),
        ("RLIMIT_FSIZE", cfg["max_file_bytes"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))


def drop_privileges() -> None:
    """no_new_privs, then every capability out of the bounding, effective and permitted sets."""
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    check(libc.capset(header, data), "drop capabilities")


def run_code(path: str) -> None:
    """Execute `path` as `__main__`; an uncaught exception prints its traceback and exits 1."""
    with open(path) as fh:
        source = fh.read()
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # hide this file's frame
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


def worker(cfg: dict) -> None:
    """PID 2: limit, drop privileges, run the code."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "set the parent-death signal")
    set_limits(cfg)
    os.chdir(cfg["scratch"])
    drop_privileges()
    sys.argv = ["main.py"]
    try:
        run_code(os.path.join(cfg["scratch"], "main.py"))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def init(cfg: dict) -> int:
    """PID 1 of the new namespace: isolate the filesystem, run the worker, return its exit code.

    The code does not run as PID 1 itself: the kernel does not deliver default-action signals
    (SIGSEGV, SIGTERM) to a namespace's init, so a crash there would not end the call.
    """
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "set the parent-death signal")
    lock_filesystem(cfg["scratch"])
    return fork_and_wait(lambda: worker(cfg))


def fork_and_wait(child) -> int:
    """Run `child()` in a forked process; its exit code (128 + N for signal N)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                sys.stderr.write(f"{exc.code}\n")
            sys.stderr.flush()
            os._exit(code & 0xFF)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main() -> None:
    """Unshare, fork the namespace's init, and exit with the code's exit code."""
    cfg = json.loads(sys.argv[1])
    check(libc.unshare(cfg.get("namespaces", CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)), "unshare namespaces")
    os._exit(fork_and_wait(lambda: os._exit(init(cfg))))


if __name__ == "__main__":
    main()
