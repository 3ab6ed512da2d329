"""Checkpoint integrity: a manifest of sizes and SHA-256 written at commit, verified before a resume;
a damaged newest checkpoint is reported in one line and the previous complete one is used."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hybridflow.config.run import RunConfig
from hybridflow.train.checkpointing import check_writable, resume_path
from hybridflow.utils import checkpoint_dirs as C
from hybridflow.utils.config_loader import load_config
from hybridflow.utils.manifest import MANIFEST
from tests.resolve_helpers import resolve_here


def _save(root: Path, step: int, run: str = "hybridflow/run") -> Path:
    with C.atomic_dir(C.step_dir(root, step)) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "shard.distcp").write_bytes(bytes(range(256)) * 64)
        (tmp / "trainer_state.json").write_text(f'{{"global_step": {step}, "run": "{run}"}}')
    return C.step_dir(root, step)


@pytest.mark.parametrize(
    "damage, phrase",
    [
        (
            lambda p: (p / "actor" / "shard.distcp").write_bytes(bytes(range(256)) * 63),
            "has 16128 bytes, the manifest says 16384",
        ),
        (
            lambda p: (p / "actor" / "shard.distcp").write_bytes(bytes(reversed(range(256))) * 64),
            "does not match its checksum",
        ),
        (lambda p: (p / "trainer_state.json").unlink(), "trainer_state.json is missing"),
        (lambda p: (p / "actor" / "stray.bin").write_bytes(b"?"), "actor/stray.bin is not in the manifest"),
    ],
)
def test_manifest_catches_every_kind_of_damage(tmp_path, damage, phrase):
    path = _save(tmp_path, 2)
    assert (path / MANIFEST).is_file() and C.damage(path) is None
    damage(path)
    assert phrase in C.damage(path)


def test_resume_skips_a_damaged_newest_checkpoint_with_one_line(tmp_path, caplog):
    cfg = resolve_here(load_config(RunConfig, None, [f"trainer.default_local_dir={tmp_path}"]), 4).config
    older, newest = _save(tmp_path, 2), _save(tmp_path, 4)
    assert resume_path(cfg) == newest
    (newest / "actor" / "shard.distcp").write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING, logger="hybridflow"):
        assert resume_path(cfg) == older
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "global_step_4 is damaged" in lines[0] and "previous complete one" in lines[0]


def test_an_explicit_damaged_resume_path_is_refused(tmp_path):
    path = _save(tmp_path, 2)
    (path / "trainer_state.json").write_text("{}")
    cfg = resolve_here(
        load_config(RunConfig, None, ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={path}"]), 4
    ).config
    with pytest.raises(ValueError, match="is damaged: trainer_state.json has 2 bytes"):
        resume_path(cfg)


def test_an_unwritable_checkpoint_dir_fails_before_the_first_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = resolve_here(
        load_config(RunConfig, None, [f"trainer.default_local_dir={blocker}/ckpt", "trainer.save_freq=5"]), 4
    )
    with pytest.raises(ValueError, match=r"trainer.default_local_dir=.*a_file/ckpt cannot be written"):
        check_writable(bad.config)
    never_saves = resolve_here(load_config(RunConfig, None, [f"trainer.default_local_dir={blocker}/ckpt"]), 4)
    check_writable(never_saves.config)  # save_freq=-1: nothing will be written, nothing to check
    good = resolve_here(
        load_config(RunConfig, None, [f"trainer.default_local_dir={tmp_path}/ok", "trainer.save_freq=5"]), 4
    )
    check_writable(good.config)
    assert (tmp_path / "ok").is_dir() and not list((tmp_path / "ok").iterdir())
