"""The documentation site cannot rot: every recipe and every documented `hybridflow ...` command line resolves,
the configuration reference is the generated one, and the metrics glossary names every metric the code logs.

Commands are collected from the fenced code blocks of README.md and docs/**/*.md and from the `#   ...` lines
of recipes/*.yaml. `train`, `sft` and `dpo` commands go through the CLI's own argument parser, `load_config` (every key,
type and cross-section check) and the pure resolve step of `--print-config`, against a fixed machine (16 CPUs,
dtype "auto" -> fp32, a fixed device profile for the planner's choices), so nothing is measured and no worker starts; the other subcommands through their argument
parsers. The slow variant runs the real `hybridflow train/sft/dpo --print-config` on every recipe.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

from hybridflow.cli.args import parse_args
from hybridflow.cli.main import build_parser
from hybridflow.cli.plan import build_parser as plan_parser
from hybridflow.cli.profile import build_parser as profile_parser
from hybridflow.config.doc import missing_docs, render
from hybridflow.config.dpo import DPOConfig, resolve_dpo
from hybridflow.config.measure import Measurements
from hybridflow.config.resolve import resolve
from hybridflow.config.run import RunConfig
from hybridflow.config.sft import SFTConfig, resolve_sft
from hybridflow.planner.device import DevicePoint, DeviceProfile
from hybridflow.protocol import keys as K
from hybridflow.utils.config_loader import load_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").rglob("*.md"))
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
PROFILE = DeviceProfile("m", "float32", [DevicePoint(1, 8, 64, 0.01, 0.03, 0.05)])  # every thread count falls back
MACHINE = Measurements(
    16, auto_dtypes=dict.fromkeys(range(1, 17), "fp32"), device_profiles=dict.fromkeys(range(1, 17), PROFILE)
)
STEPS_PER_EPOCH = 256
VLLM = importlib.util.find_spec("vllm") is not None
NO_VLLM = "rollout.name=vllm needs the vllm package, which is not installed"

# The user's own files that documented commands name, as a reader would have written them (in a temporary cwd).
USER_FILES = {
    "my_loss.py": (
        'from hybridflow.algos import policy_loss\n\n@policy_loss("my_loss")\n'
        "def my_loss(x):\n    return -x.advantages * x.log_prob\n"
    ),
    "my_run.yaml": "rollout:\n  n: 4\n",
    "my_reward.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
    "my_plugins.py": "",
    "my_env.py": (
        "from hybridflow.agent.loop.env import ToolEnvironment\n\n\nclass MyEnv(ToolEnvironment):\n    pass\n"
    ),
}


def _blocks(text: str) -> list[str]:
    """The contents of the shell (or unlabelled) fenced code blocks of a markdown page."""
    blocks = re.findall(r"^ *```([a-z]*)\n(.*?)^ *```", text, flags=re.S | re.M)
    return [body for lang, body in blocks if lang in ("", "bash", "sh", "console")]


def command_lines(text: str) -> list[list[str]]:
    """Every `.venv*/bin/hybridflow SUBCOMMAND ...` invocation in `text`'s lines, as argv after `hybridflow` (a bare
    `hybridflow train [--config FILE] ...` is a synopsis, not a command)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            if "hybridflow " not in part:
                continue
            words = shlex.split(part.replace("$ ", "", 1), comments=True)
            while words and ("=" in words[0] and not words[0].startswith("-") or words[0] == "time"):
                words = words[1:]  # RAY_ADDRESS=... and `time` before the command
            if words and words[0].endswith("/bin/hybridflow"):  # .venv/bin/hybridflow, .venv-vllm/bin/hybridflow
                found.append(words[1:])
    return found


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) for every command in README.md, docs/ and the recipes' comments."""
    out = []
    for page in [ROOT / "README.md", *DOCS]:
        for block in _blocks(page.read_text()):
            out += [(page.relative_to(ROOT).as_posix(), argv) for argv in command_lines(block)]
    for recipe in RECIPES:
        comments = "\n".join(line.lstrip("# ") for line in recipe.read_text().splitlines() if line.startswith("#   "))
        out += [(recipe.relative_to(ROOT).as_posix(), argv) for argv in command_lines(comments)]
    return out


def resolve_command(argv: list[str]) -> object:
    """What `hybridflow ARGV --print-config` would print, minus the measuring: the resolved run (train, sft, dpo), or
    the parsed arguments (the other subcommands)."""
    command, rest = argv[0], argv[1:]
    if command in ("train", "sft", "dpo"):
        args = parse_args(rest, f"hybridflow {command}", "")
        if command == "train":
            return resolve(load_config(RunConfig, args.config, args.overrides), STEPS_PER_EPOCH, MACHINE)
        if command == "dpo":
            return resolve_dpo(load_config(DPOConfig, args.config, args.overrides), STEPS_PER_EPOCH, MACHINE)
        return resolve_sft(load_config(SFTConfig, args.config, args.overrides), STEPS_PER_EPOCH, MACHINE)
    if command == "plan":
        return plan_parser().parse_args(rest)
    if command == "profile":
        return profile_parser().parse_args(rest)
    args, extra = build_parser().parse_known_args(argv)
    assert all(command == "data" and "=" in e for e in extra), f"unrecognized arguments: {extra}"
    return args


def _needs_vllm(argv: list[str]) -> bool:
    return any("vllm" in a for a in argv if "=" in a or a.endswith(".yaml"))


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch) -> Path:
    """A working directory with the repository's recipes and the user files the docs name."""
    for name, text in USER_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    monkeypatch.chdir(tmp_path)
    return tmp_path


COMMANDS = documented_commands()


def test_commands_were_found():
    where = {w for w, _ in COMMANDS}
    assert len(COMMANDS) >= 60 and "README.md" in where and "recipes/main.yaml" in where
    assert {argv[0] for _, argv in COMMANDS} >= {"train", "sft", "data", "export", "generate", "serve", "plan"}


UNIQUE = {tuple(argv): where for where, argv in reversed(COMMANDS)}  # each command once, named by its first page


@pytest.mark.parametrize("argv", [list(a) for a in UNIQUE], ids=[f"{w}:{' '.join(a)[:60]}" for a, w in UNIQUE.items()])
def test_documented_command_resolves(argv: list[str], user_dir: Path):
    if _needs_vllm(argv) and not VLLM:
        with pytest.raises(ValueError, match=NO_VLLM):  # every other key was checked before this one
            resolve_command(argv)
        return
    assert resolve_command(argv) is not None


def test_every_recipe_is_documented_and_run_by_a_command():
    run = {a[a.index("--config") + 1] for _, a in COMMANDS if "--config" in a}
    assert {f"recipes/{r.name}" for r in RECIPES} <= run
    page = (ROOT / "docs" / "recipes.md").read_text()
    assert all(f"recipes/{r.name}" in page for r in RECIPES)


def test_every_page_is_in_the_nav():
    """`mkdocs build --strict` refuses a page missing from mkdocs.yml's nav; this says so without mkdocs installed."""

    def pages(node) -> set[str]:
        if isinstance(node, str):
            return {node}
        items = node.values() if isinstance(node, dict) else node
        return set().union(*(pages(i) for i in items))

    nav = pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert {str(p.relative_to(ROOT / "docs")) for p in DOCS} == nav


def test_main_recipe_is_the_default_run(user_dir: Path):
    written = resolve(load_config(RunConfig, "recipes/main.yaml"), STEPS_PER_EPOCH, MACHINE)
    default = resolve(load_config(RunConfig), STEPS_PER_EPOCH, MACHINE)
    assert written.to_yaml() == default.to_yaml()


def test_config_reference_is_generated():
    """docs/reference/config.md is `python -m hybridflow.config.doc > docs/reference/config.md`, and every
    key in it has a meaning (its field's docstring)."""
    assert (ROOT / "docs" / "reference" / "config.md").read_text() == render()
    assert not missing_docs()


# --- the metrics glossary ----------------------------------------------------------------------------------
METRIC = re.compile(r"^([a-z][a-z_\-]*|\*)(/[A-Za-z0-9_@*\-]+)+$")
NOT_METRICS = {
    "lighteval/MATH",
    "openai/gsm8k",
    "tokens/s",
    "application/x-protobuf",
}  # data sources, a plot's axis label, a content type
STAT_FILES = ["hybridflow/algos", "hybridflow/workers/losses.py", "hybridflow/engine/fsdp.py"]


def _strings(tree: ast.AST):
    """Every string constant and f-string template (`{...}` as `*`) in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def logged_metric_names() -> set[str]:
    """Strings in hybridflow/ shaped like metric names (`prefix/name`, `*` where an f-string fills in)."""
    names = set()
    for path in (ROOT / "hybridflow").rglob("*.py"):
        for s in _strings(ast.parse(path.read_text())):
            if METRIC.match(s) and re.search(r"[a-z]", s) and s not in NOT_METRICS:
                names.add(s)
    return names


def loss_stat_names() -> set[str]:
    """String keys of the dicts in the losses and the engine (their stats, logged as actor/<k> or critic/<k>), less
    the batch keys (keys.py), the engine's `log_probs` output and `lr` (logged as actor/lr, critic/lr)."""
    names = set()
    paths = [p for f in STAT_FILES for p in ((ROOT / f).rglob("*.py") if (ROOT / f).is_dir() else [ROOT / f])]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                names |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    names.add(node.slice.value)
    batch_keys = {v for k, v in vars(K).items() if k.isupper() and isinstance(v, str)}
    return {n for n in names if re.fullmatch(r"[a-z][a-z_]*", n)} - batch_keys - {"lr", "log_probs"}


def glossary_names() -> list[str]:
    """The metric names the glossary documents: every `name` in the first column of its tables, `a/{b,c}` read as
    `a/b` and `a/c`."""
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    names = []
    for cell in re.findall(r"^\| `([^`]+)`", text, flags=re.M):
        head, _, tail = cell.partition("{")
        names += [head + alt for alt in tail.rstrip("}").split(",")] if tail else [cell]
    return names


def _documented(name: str, glossary: list[str]) -> bool:
    """A code name (`*` where an f-string fills in) matches a glossary name (`<x>` a placeholder)."""
    pattern = re.compile(".+".join(re.escape(p) for p in name.split("*")))
    concrete = [re.sub(r"<[^>]+>", "x", g) for g in glossary]
    return any(pattern.fullmatch(g) or g.startswith(name + "/") for g in concrete)


def test_metrics_glossary_names_every_logged_metric():
    glossary = glossary_names()
    missing = sorted(n for n in logged_metric_names() if not _documented(n, glossary))
    assert not missing, f"metrics logged but not in docs/reference/metrics.md: {missing}"


def test_metrics_glossary_names_every_loss_stat():
    glossary = set(glossary_names())
    missing = sorted(k for k in loss_stat_names() if f"actor/{k}" not in glossary and f"critic/{k}" not in glossary)
    assert not missing, f"loss stats logged as actor/<k> or critic/<k> but not in the glossary: {missing}"


def test_metrics_glossary_names_every_timer():
    timers = set()
    for path in (ROOT / "hybridflow" / "train").glob("*.py"):
        timers |= set(re.findall(r'timer\("([a-z_]+)"', path.read_text()))
    glossary = set(glossary_names())
    assert timers and not sorted(t for t in timers if f"timing_s/{t}" not in glossary)


# --- slow: the real --print-config -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_print_config_for_real(recipe: Path, user_dir: Path, capsys):
    """`hybridflow train|sft|dpo --config recipes/X.yaml --print-config` in-process: inputs read, machine measured."""
    from hybridflow.cli.main import main

    command = recipe.stem if recipe.stem in ("sft", "dpo") else "train"
    from_sft = ("rl_after_sft", "tool_sum_products")
    extra = ["model.path=default"] if recipe.stem in from_sft else []  # sft_model/ is what the SFT run writes
    extra += ["distillation.teacher.path=default"] if recipe.stem == "distill" else []  # main_policy/: an export
    if _needs_vllm(["--config", str(recipe)]) and not VLLM:
        pytest.skip("vllm is not installed here (the -m vllm suite runs in .venv-vllm)")
    assert main([command, "--config", f"recipes/{recipe.name}", "--print-config", *extra]) == 0
    assert capsys.readouterr().out.strip()
