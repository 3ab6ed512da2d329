"""The command line's front door (issue 33): `--list-keys`, errors (one line for a user's, one line and a traceback
file for a bug's, `--debug`), and every sampling flag of `hybridflow generate` reaching the sampler.

In-process calls of `hybridflow.cli.main.main`; one subprocess checks the exit code and stderr of a bug."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from hybridflow.cli import list_keys as config_keys
from hybridflow.cli.generate import sampling_settings
from hybridflow.cli.main import main
from hybridflow.config.run import RunConfig
from hybridflow.config.sft import SFTConfig
from hybridflow.utils.config_loader import Section

LINE = re.compile(r"^(?P<key>[\w.]+): (?P<type>.+?) = (?P<default>.*?)(  +# (?P<doc>.*))?$")


def leaf_keys(root: type) -> set[str]:
    """Every leaf key of `root`'s default config, from OmegaConf (independent of config_keys)."""

    def walk(node: DictConfig, prefix: str) -> set[str]:
        out = set()
        for key in node:
            value = node[key]
            if isinstance(value, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(value)):
                out |= walk(value, f"{prefix}{key}.")
            else:
                out.add(f"{prefix}{key}")
        return out

    return walk(OmegaConf.structured(root), "")


def listing(capsys, *args: str) -> tuple[list[str], dict[str, re.Match]]:
    """The header lines and the parsed key lines of `hybridflow args... --list-keys`."""
    assert main(list(args)) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [line for line in lines if line.startswith("#")]
    keys = {m["key"]: m for m in map(LINE.match, lines[len(header) :])}
    assert None not in keys.values(), lines
    return header, keys


@pytest.mark.parametrize("command, root", [("train", RunConfig), ("sft", SFTConfig)])
def test_list_keys_lists_every_key_with_type_default_and_doc(capsys, command: str, root: type) -> None:
    header, keys = listing(capsys, command, "--list-keys")
    assert set(keys) == leaf_keys(root)
    undocumented = [k for k, m in keys.items() if not m["doc"]]
    assert not undocumented, f"config fields without a docstring: {undocumented}"
    assert ("verl" in " ".join(header)) == (command == "train")  # only RunConfig reads verl's key names


def test_list_keys_prefix_shows_the_main_jobs_defaults(capsys) -> None:
    _, keys = listing(capsys, "train", "--list-keys", "actor.optim")
    assert keys and all(k.startswith("actor.optim.") for k in keys)
    lr = keys["actor.optim.lr"]
    assert (lr["type"], float(lr["default"])) == ("float", RunConfig().actor.optim.lr)
    assert lr["doc"] == config_keys.first_sentence(config_keys.field_docs(type(RunConfig().actor.optim))["lr"])
    _, keys = listing(capsys, "train", "--list-keys", "data.train_batch_size")
    assert list(keys) == ["data.train_batch_size"] and keys["data.train_batch_size"]["default"] == "8"


def test_list_keys_of_an_unknown_prefix_is_one_line(capsys) -> None:
    assert main(["train", "--list-keys", "actor.optm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridflow train: error: no config key starts with 'actor.optm'") and "actor.optim" in err
    assert "\n" not in err


def test_the_key_table_is_generated_from_the_config() -> None:
    assert config_keys.TABLE.read_text() == config_keys.table_text(), "run: python -m hybridflow.cli.list_keys"


def test_a_stale_table_reads_the_config_itself(tmp_path: Path, monkeypatch, capsys) -> None:
    table = json.loads(config_keys.TABLE.read_text())
    table["train"]["sources"]["config/trainer.py"]["sha1"] = "0" * 40  # as if a section there had changed since
    table["train"]["keys"] = []
    monkeypatch.setattr(config_keys, "TABLE", tmp_path / "list_keys.json")
    config_keys.TABLE.write_text(json.dumps(table))
    keys, verl_names = config_keys.load_keys("train")
    assert [k.key for k in keys] == [k.key for k in config_keys.iter_keys(RunConfig())] and verl_names
    assert "list_keys.json is out of date" in capsys.readouterr().err


def test_docs_and_values_are_read_as_written() -> None:
    @dataclasses.dataclass
    class Inner(Section):
        flag: bool = False
        """Off by default. A second sentence, e.g. this one, is dropped."""
        names: list[str] = dataclasses.field(default_factory=lambda: ["a"])

    @dataclasses.dataclass
    class Outer(Section):
        inner: Inner = dataclasses.field(default_factory=Inner)
        """Nested."""
        path: str | None = None
        """Where (`x.y` style)."""

    keys = list(config_keys.iter_keys(Outer()))
    assert keys == [
        config_keys.KeyInfo("inner.flag", "bool", "false", "Off by default."),
        config_keys.KeyInfo("inner.names", "list[str]", '["a"]', ""),
        config_keys.KeyInfo("path", "str | None", "null", "Where (`x.y` style)."),
    ]


def test_a_bug_prints_one_line_and_the_file_holding_its_traceback(tmp_path: Path, capsys, monkeypatch) -> None:
    def buggy(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr("hybridflow.cli.data.cmd_data", buggy)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["data", "arithmetic", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridflow data: error: RuntimeError: boom [traceback in ") and "\n" not in err
    saved = Path(re.search(r"traceback in (\S+);", err)[1])
    assert saved.parent == tmp_path / "hybridflow-errors"
    text = saved.read_text()
    assert text.startswith("command: hybridflow data arithmetic --out") and "in buggy" in text
    assert main(["--debug", "data", "arithmetic", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in buggy" in err


def test_user_errors_stay_one_line_and_debug_shows_their_traceback(tmp_path: Path, capsys) -> None:
    args = ["data", "arithmetic", "--out", str(tmp_path), "digits=1"]  # DifficultyError: a TypeError and a ValueError
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridflow data: error: task 'arithmetic' has no difficulty setting 'digits'"), err
    assert "\n" not in err
    assert main([*args, "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_bug_in_a_subprocess_exits_1_naming_the_traceback_file(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from hybridflow.cli import main as cli\nimport hybridflow.cli.data as data\n"
        "def buggy(args): raise KeyError('missing')\n"
        "data.cmd_data = buggy\n"
        f"sys.exit(cli.main(['data', 'arithmetic', '--out', {str(tmp_path)!r}]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    saved = Path(re.search(r"traceback in (\S+);", proc.stderr)[1])
    assert saved.is_file() and "KeyError: 'missing'" in saved.read_text()


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({}, {"do_sample": False}),
        ({"temperature": 0.7}, {"do_sample": True, "temperature": 0.7}),  # issue 33: n=1 ignored it
        ({"top_p": 0.9}, {"do_sample": True, "top_p": 0.9, "temperature": 1.0}),
        ({"top_k": 5}, {"do_sample": True, "top_k": 5}),
        ({"n": 4}, {"do_sample": True, "n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1}),
        ({"temperature": 0}, {"do_sample": False}),
    ],
)
def test_generate_sampling_settings(flags: dict, expected: dict) -> None:
    settings = sampling_settings(flags.pop("n", 1), **flags)
    assert settings | expected == settings


def test_generate_refuses_flags_greedy_decoding_ignores() -> None:
    with pytest.raises(ValueError, match=r"ignores \['--n', '--top-k'\]"):
        sampling_settings(2, temperature=0, top_k=3)


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[str, str]:
    """The tiny random llama and 3 arithmetic prompts."""
    from hybridflow.data.tasks import build_task
    from hybridflow.models import tiny_model_dir

    _, test = build_task("arithmetic", tmp_path_factory.mktemp("gen"), 2, 3, seed=0)
    return str(tiny_model_dir("llama")), str(test)


def generate(model_and_data, tmp_path: Path, monkeypatch, *flags: str) -> tuple[object, list[int], list[str]]:
    """`hybridflow generate` in-process: the RolloutConfig it built, the batch sizes it generated, the responses."""
    from hybridflow.cli import generate as gen

    seen, batches, real = [], [], gen.build_rollout

    def build(cfg, *args):
        engine = real(cfg, *args)
        call = engine.generate_sequences
        monkeypatch.setattr(engine, "generate_sequences", lambda p: batches.append(len(p)) or call(p))
        seen.append(cfg)
        return engine

    monkeypatch.setattr(gen, "build_rollout", build)
    model, data = model_and_data
    out = tmp_path / f"gen{len(list(tmp_path.iterdir()))}.jsonl"
    args = ["generate", "--model", model, "--data", data, "--max-response-length", "6", "--out", str(out), *flags]
    assert main(args) == 0
    return seen[0], batches, [json.loads(line)["response"] for line in out.read_text().splitlines()]


def test_every_generate_flag_reaches_the_sampler(model_and_data, tmp_path: Path, monkeypatch, capsys) -> None:
    flags = ["--n", "2", "--temperature", "0.5", "--top-p", "0.8", "--top-k", "7", "--seed", "3", "--batch-size", "2"]
    cfg, batches, responses = generate(model_and_data, tmp_path, monkeypatch, *flags, "--max-prompt-length", "100")
    sampling = (cfg.n, cfg.do_sample, cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)
    assert sampling == (2, True, 0.5, 0.8, 7, 3)
    assert (cfg.name, cfg.prompt_length, cfg.response_length) == ("native", 100, 6)
    assert batches == [2, 1] and len(responses) == 6  # 3 prompts in batches of 2, 2 responses each


def test_generate_with_one_sample_honours_temperature_and_seed(model_and_data, tmp_path: Path, monkeypatch) -> None:
    """Greedy decoding would give the same responses for every seed (issue 33: `--n 1` decoded greedily whatever
    --temperature said); greedy's settings are checked in test_generate_sampling_settings."""
    hot = [generate(model_and_data, tmp_path, monkeypatch, "--temperature", "5", "--seed", s)[2] for s in "12"]
    assert hot[0] != hot[1]
