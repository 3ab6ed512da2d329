"""The allowed dependencies between hybridflow's parts (docs/architecture.md, DESIGN.md), checked on every import
of every module, function-local and type-only ones included (an AST walk, not the import-time graph).

The parts stand in layers, each importing only parts below it (docs/architecture.md draws them):

    cli/                the `hybridflow` command, one module per subcommand
    train/              the loops (PPO sync/async, SFT, DPO), the job and its recovery
    config/             the run's typed config and its resolve stage
    workers/, service/  role workers over Engine / Rollout; the Tinker-compatible service
    planner/, endpoint/ the cost model and layout search; the OpenAI-compatible endpoint and harness training
    rollout/            the Rollout interface, sync, multi-turn; native/, hf, vllm/
    parity/             the guard's checks (the sync calls them; they read a rollout through a protocol)
    engine/, data/, controller/
    agent/              the multi-turn loop's environments, tools, sandbox; the agent's config
    rewards/, models/, algos/
    protocol/
    utils/, compat/     (compat/verl/: verl's key names)

controller/ knows nothing of RL; algos/ is tensor math without Ray; planner/ takes plain inputs (planner/inputs.py)
and never reads the run config; the library never imports its command-line entry points (cli/).
parity/ imports nothing of rollout/. No library module imports anything of tests/:
the fault injection lives there and reaches the code only through the hook points of utils/hooks.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hybridflow

PACKAGE = Path(hybridflow.__file__).parent
TESTS = Path(__file__).resolve().parent
CLI_MODULES = {f"hybridflow.cli.{p.stem}" for p in (PACKAGE / "cli").glob("*.py") if p.stem != "__init__"}
"""Every subcommand's module: `hybridflow` (cli/main.py, the console script), train, sft, plan, generate, ..."""

_ALL = (
    "protocol", "models", "algos", "engine", "data", "rewards", "agent", "controller", "rollout", "parity",
    "planner", "endpoint", "workers", "config", "compat", "train", "cli", "service",
)  # fmt: skip


def _above(*allowed: str) -> tuple[str, ...]:
    return tuple(p for p in _ALL if p not in allowed and not any(a.startswith(p + ".") for a in allowed))


FORBIDDEN = {
    "utils": _above(),
    "protocol": _above("utils", "protocol"),
    "models": _above("utils", "models"),
    "algos": (*_above("utils", "algos"), "ray"),
    "rewards": _above("utils", "protocol", "rewards"),
    "agent": _above("utils", "protocol", "rewards", "agent"),
    "data": _above("utils", "protocol", "data", "agent"),
    "engine": _above("utils", "protocol", "models", "algos", "engine"),
    "controller": _above("utils", "protocol", "controller"),
    "rollout": _above("utils", "protocol", "models", "engine", "agent", "rollout", "parity"),
    "parity": _above("utils", "protocol", "models", "engine", "parity"),
    "planner": ("workers", "config", "compat", "train", "cli", "service", "controller", "agent"),
    "endpoint": ("workers", "config", "compat", "train", "cli", "service", "planner", "parity"),
    "workers": ("config", "compat", "train", "cli", "service"),
    "config": ("train", "cli", "service"),
    "compat": ("train", "cli", "service"),
    "train": ("cli",),
}
"""Part of hybridflow -> what it must not import: hybridflow's parts by name, "ray" the library."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, package: str) -> set[str]:
    """Every module an `import` / `from ... import` in `source` (a module of `package`) may load."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(p for p in (anchor, node.module) if p)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def test_imported_modules_resolves_absolute_relative_and_from_package_imports():
    source = (
        "import os, hybridflow.cli.main\n"
        "from hybridflow.cli import train\n"
        "from .checkpointing import actor_dir\n"
        "from .. import protocol\n"
        "def f():\n"
        "    from hybridflow.cli.main import cmd_data\n"
    )
    found = imported_modules(source, "hybridflow.train")
    assert {
        "os",
        "hybridflow.cli.main",
        "hybridflow.cli.train",
        "hybridflow.train.checkpointing",
        "hybridflow.protocol",
        "hybridflow.cli.main.cmd_data",
    } <= found


def library_imports() -> dict[str, set[str]]:
    """Every module of the package -> every module it may import."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found[name] = imported_modules(path.read_text(), package)
    return found


def is_within(module: str, part: str) -> bool:
    """Whether `module` is `part` (a part of hybridflow, or the "ray" library) or inside it."""
    prefix = "ray" if part == "ray" else f"hybridflow.{part}"
    return module == prefix or module.startswith(prefix + ".")


def test_no_library_module_imports_the_cli():
    offenders = {
        name: sorted(found & CLI_MODULES) for name, found in library_imports().items() if name not in CLI_MODULES
    }
    offenders = {name: bad for name, bad in offenders.items() if bad}
    assert not offenders, f"library modules import the CLI: {offenders}"


def layer_offenders(imports: dict[str, set[str]]) -> list[str]:
    """ "module -> import" for every import (of `imports`: module -> what it imports) its layer forbids."""
    offenders = []
    for name, found in imports.items():
        for part, banned in FORBIDDEN.items():
            if is_within(name, part):
                offenders += [f"{name} -> {m}" for m in sorted(found) if any(is_within(m, b) for b in banned)]
    return offenders


def test_every_part_imports_only_what_its_layer_allows():
    offenders = layer_offenders(library_imports())
    assert not offenders, "imports across the layers:\n" + "\n".join(offenders)


def test_the_layer_rules_catch_rl_in_the_controller_and_implementations_in_parity():
    assert layer_offenders({"hybridflow.controller.decorator": {"hybridflow.parity.guard"}}) == [
        "hybridflow.controller.decorator -> hybridflow.parity.guard"
    ]
    imports = {"hybridflow.parity.weights": {"hybridflow.rollout.native.rollout", "hybridflow.engine.reshard", "torch"}}
    assert layer_offenders(imports) == ["hybridflow.parity.weights -> hybridflow.rollout.native.rollout"]


def tests_top_level_names() -> set[str]:
    """The top-level names that tests/ makes importable (its modules and packages, and `tests` itself)."""
    names = {"tests"} | {p.stem for p in TESTS.glob("*.py")}
    return names | {p.parent.name for p in TESTS.glob("*/__init__.py")}


def test_no_library_module_imports_the_tests():
    seams = tests_top_level_names()
    assert "faults" in seams and "conftest" in seams
    offenders = {
        name: sorted(m for m in found if m.split(".")[0] in seams) for name, found in library_imports().items()
    }
    offenders = {name: bad for name, bad in offenders.items() if bad}
    assert not offenders, f"library modules import test code: {offenders}"


def test_the_layer_check_sees_function_local_imports():
    source = "def f():\n    from hybridflow.config.run import RunConfig\n"
    found = imported_modules(source, "hybridflow.planner")
    assert any(is_within(m, "config") for m in found)
    assert not is_within("hybridflow.configx", "config") and is_within("ray.util", "ray")
    assert is_within("hybridflow.agent.loop.env", "agent") and not is_within("hybridflow.agentx", "agent")


def test_generate_reads_a_trainer_checkpoint_without_loading_the_other_subcommands(tmp_path):
    ckpt = tmp_path / "global_step_2"
    (ckpt / "actor").mkdir(parents=True)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import hybridflow.cli.generate as generate\n"
        "calls = []\n"
        "generate.export_hf = lambda src, out, tok, base_model: calls.append((src, tok, base_model)) or out\n"
        f"out = generate.model_dir({str(ckpt)!r}, Path({str(tmp_path)!r}))\n"
        f"assert calls == [(Path({str(ckpt / 'actor')!r}), None, None)], calls\n"
        f"loaded = sorted(set(sys.modules) & set({sorted(CLI_MODULES - {'hybridflow.cli.generate'})!r}))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr


def import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other in a loop (strongly connected components of more than one module,
    or a module importing itself), over `imports`: module -> what it imports (names inside a module map to it)."""

    def owner(name: str) -> str | None:
        while name and name not in imports:
            name = name.rpartition(".")[0]
        return name or None

    graph = {a: {o for m in found if (o := owner(m)) and o != a} for a, found in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No module imports itself through others, type-only and function-local imports included: a registry never
    imports its own entries (the package that defines the built-ins registers them)."""
    assert import_cycles(library_imports()) == []


def test_the_cycle_check_finds_a_loop_through_a_package():
    imports = {"p": {"p.a"}, "p.a": {"p.b.f"}, "p.b": {"p"}, "q": {"p.a"}}
    assert import_cycles(imports) == [["p", "p.a", "p.b"]]
