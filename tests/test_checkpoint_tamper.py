"""Checkpoints that cannot lie: a pickle planted in a checkpoint file is never run, and a truncated,
incomplete or manifest-less checkpoint is refused in one line naming the file, by `load_checkpoint` and by
`hybridflow export` alike; the refused checkpoint and the run's other checkpoints are left as they were."""

from __future__ import annotations

import builtins
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from hybridflow.engine import CheckpointError, EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engine import checkpoint_files as F
from hybridflow.models import tiny_model_dir
from hybridflow.utils import checkpoint_dirs as C
from hybridflow.utils.manifest import MANIFEST, file_entry
from tests.engine_helpers import make_batch
from tests.test_cli_tools import cli, one_line_error


class _Planted:
    """Unpickling it would create `marker`: what a hostile checkpoint file would run instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An engine trained one step, and two checkpoints of it (steps 1 and 2)."""
    root = tmp_path_factory.mktemp("ckpts")
    engine = FSDPEngine.from_pretrained(tiny_model_dir("llama"), EngineConfig(param_dtype="fp32"), OptimConfig(lr=1e-2))
    engine.train_step([make_batch(2, 6, 4, seed=8)], lambda out, micro: (-out["log_probs"].sum(), {}))
    for step in (1, 2):
        engine.save_checkpoint(root / f"global_step_{step}", extra={"update_calls": step})
    return engine, root


@pytest.fixture
def victim(saved, tmp_path):
    """A fresh copy of checkpoint 2 to tamper with, and the digests of checkpoint 1 to prove it untouched."""
    engine, root = saved
    copy = tmp_path / "global_step_2"
    shutil.copytree(root / "global_step_2", copy)
    return engine, copy, _digests(root / "global_step_1")


def _digests(path: Path) -> dict[str, dict]:
    return {p.relative_to(path).as_posix(): file_entry(p) for p in sorted(path.rglob("*")) if p.is_file()}


def _reseal(path: Path, name: str) -> None:
    """Record `name`'s new bytes in the manifest: a forger who rewrites the manifest too."""
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][name] = file_entry(path / name)
    (path / MANIFEST).write_text(json.dumps(manifest))


def _refused(engine: FSDPEngine, path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def _unharmed(engine: FSDPEngine, path: Path, before: dict[str, dict]) -> None:
    """The run's other checkpoint still loads, byte for byte as it was written."""
    assert engine.load_checkpoint(path) == {"update_calls": 1}
    assert _digests(path) == before


def test_a_current_checkpoint_has_a_manifest_of_every_rank_file_and_loads(saved):
    engine, root = saved
    path = root / "global_step_1"
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert {"extra_rank0.pt", ".metadata", "meta.json", "__0_0.distcp"} <= set(files)
    assert F.damage(path) is None
    assert engine.load_checkpoint(path) == {"update_calls": 1}


def test_a_pickle_planted_in_the_extra_state_is_not_run(victim, tmp_path, saved):
    engine, path, before = victim
    marker = tmp_path / "pwned"
    torch.save({"lr_scheduler": None, "extra": _Planted(marker)}, path / "extra_rank0.pt")
    _reseal(path, "extra_rank0.pt")
    message = _refused(engine, path)
    assert "extra_rank0.pt" in message and "not plain data" in message
    assert not marker.exists()
    _unharmed(engine, saved[1] / "global_step_1", before)


def test_a_pickle_planted_in_the_checkpoint_index_is_not_run_by_load_or_export(victim, tmp_path, saved):
    engine, path, before = victim
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    _reseal(path, ".metadata")
    message = _refused(engine, path)
    assert ".metadata holds a pickled io.open" in message
    line = one_line_error(cli("export", str(path), "--out", str(tmp_path / "hf"), cwd=tmp_path), "export")
    assert ".metadata holds a pickled io.open" in line
    assert not marker.exists() and not (tmp_path / "hf").exists()
    _unharmed(engine, saved[1] / "global_step_1", before)


def test_a_truncated_shard_is_refused_naming_it_by_load_and_export(victim, tmp_path, saved):
    engine, path, before = victim
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    message = _refused(engine, path)
    assert "is damaged: __0_0.distcp has 1000 bytes, the manifest says" in message
    line = one_line_error(cli("export", str(path), "--out", str(tmp_path / "hf"), cwd=tmp_path), "export")
    assert "__0_0.distcp has 1000 bytes" in line
    _unharmed(engine, saved[1] / "global_step_1", before)


def test_a_missing_rank_file_is_refused_not_replaced_by_rank_0s(victim, saved):
    engine, path, before = victim
    (path / "extra_rank0.pt").unlink()
    assert "is damaged: extra_rank0.pt is missing" in _refused(engine, path)
    _unharmed(engine, saved[1] / "global_step_1", before)


def test_a_missing_manifest_is_refused(victim, tmp_path, saved):
    engine, path, before = victim
    (path / MANIFEST).unlink()
    assert f"is damaged: {MANIFEST} is missing" in _refused(engine, path)
    line = one_line_error(cli("export", str(path), "--out", str(tmp_path / "hf"), cwd=tmp_path), "export")
    assert f"{MANIFEST} is missing" in line
    _unharmed(engine, saved[1] / "global_step_1", before)


def test_rank_0_does_not_seal_without_every_rank_files(saved, tmp_path):
    """Before COMPLETE, rank 0 checks each rank's reported files; a rank whose files it cannot see fails the save."""
    _, root = saved
    tmp = tmp_path / "global_step_3.tmp-x"
    shutil.copytree(root / "global_step_1", tmp)
    rank0 = F.own_entries(tmp, 0)
    assert F.missing_rank_file(tmp, [rank0]) is None
    assert F.missing_rank_file(tmp, [rank0, {}]) == "extra_rank1.pt of rank 1 was not written"
    rank1 = {"extra_rank1.pt": {"size": 10, "sha256": "0" * 64}, "__1_0.distcp": {"size": 10, "sha256": "0" * 64}}
    assert "of rank 1 is not visible to rank 0" in F.missing_rank_file(tmp, [rank0, rank1])
    shards_only = {k: v for k, v in rank0.items() if k != "__0_0.distcp"}
    assert F.missing_rank_file(tmp, [shards_only]) == "__0_0.distcp is in .metadata but no rank reported writing it"


def test_a_truncated_shard_under_a_rewritten_manifest_is_still_one_line(victim, saved):
    engine, path, before = victim
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    _reseal(path, "__0_0.distcp")
    assert "its shards could not be read (" in _refused(engine, path)
    _unharmed(engine, saved[1] / "global_step_1", before)


def _in_trainer_checkpoint(root: Path, engine_ckpt: Path, own_manifest: bool) -> Path:
    """A trainer checkpoint (global_step_3) holding a copy of `engine_ckpt` as actor/, sealed as the trainer
    seals; without `own_manifest` the engine directory is as the previous version wrote it (no MANIFEST.json)."""
    with C.atomic_dir(C.step_dir(root, 3)) as tmp:
        shutil.copytree(engine_ckpt, tmp / "actor")
        if not own_manifest:
            (tmp / "actor" / MANIFEST).unlink()
        (tmp / "trainer_state.json").write_text('{"global_step": 3}')
    return C.step_dir(root, 3)


def test_the_trainer_manifest_reuses_the_engines_entries(saved, tmp_path):
    engine, root = saved
    path = _in_trainer_checkpoint(tmp_path, root / "global_step_1", own_manifest=True)
    outer = json.loads((path / MANIFEST).read_text())["files"]
    inner = json.loads((path / "actor" / MANIFEST).read_text())["files"]
    assert all(outer[f"actor/{name}"] == entry for name, entry in inner.items())
    assert C.damage(path) is None and engine.load_checkpoint(path / "actor") == {"update_calls": 1}


def test_an_engine_directory_of_the_previous_version_is_checked_against_the_trainer_manifest(saved, tmp_path):
    engine, root = saved
    path = _in_trainer_checkpoint(tmp_path, root / "global_step_1", own_manifest=False)
    assert engine.load_checkpoint(path / "actor") == {"update_calls": 1}
    shard = path / "actor" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert "is damaged: actor/__0_0.distcp has 1000 bytes" in _refused(engine, path / "actor")


def test_a_queued_batch_is_plain_data_and_a_planted_pickle_there_is_not_run(tmp_path):
    """The async modes' rollout_queue/step_<k>.pt: tensors, numpy object columns and meta round-trip as plain
    data; a file holding anything else is refused in one line, before any object in it is built."""
    import numpy as np

    from hybridflow.protocol import DataProto
    from hybridflow.train.async_pipeline import _load_queued, _plain_batch
    from hybridflow.utils.plain_data import NotPlainDataError, save_plain

    rows = np.empty(2, dtype=object)
    rows[:] = [{"index": "3", "tools": ["calculator"]}, {"index": "4", "ids": np.arange(3)}]
    batch = DataProto.from_dict(
        {"responses": torch.arange(6).view(2, 3), "old_log_probs": torch.rand(2, 3).bfloat16()},
        {"data_source": np.array(["a", "b"], dtype=object), "extra_info": rows},
        {"global_step": 3},
    )
    save_plain(tmp_path / "step_3.pt", _plain_batch(batch))
    back = _load_queued(tmp_path, 3)
    torch.testing.assert_close(back.batch["old_log_probs"], batch.batch["old_log_probs"])
    assert back.non_tensor_batch["extra_info"][0] == {"index": "3", "tools": ["calculator"]}
    np.testing.assert_array_equal(back.non_tensor_batch["extra_info"][1]["ids"], np.arange(3))
    assert back.meta_info == {"global_step": 3} and list(back.non_tensor_batch["data_source"]) == ["a", "b"]
    marker = tmp_path / "pwned"
    torch.save({"tensors": {}, "non_tensors": _Planted(marker), "meta_info": {}}, tmp_path / "step_4.pt")
    with pytest.raises(NotPlainDataError, match=r"step_4.pt holds objects that are not plain data"):
        _load_queued(tmp_path, 4)
    assert not marker.exists()
    (tmp_path / "step_5.pkl").write_bytes(b"old")
    with pytest.raises(NotPlainDataError, match=r"step_5.pkl is a pickle written by an older hybridflow"):
        _load_queued(tmp_path, 5)
