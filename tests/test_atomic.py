"""Atomic writes: a writer that raises leaves nothing behind, one that returns leaves exactly its content."""

from __future__ import annotations

import os

import pytest

from hybridflow.utils.atomic import atomic_dir, atomic_file, commit_dir, fresh_dir, temp_sibling


def test_atomic_file_writes_text_and_bytes_and_replaces(tmp_path):
    path = tmp_path / "sub" / "state.txt"  # the parent is created
    with atomic_file(path, "w", encoding="utf-8") as f:
        f.write("one")
    with atomic_file(path) as f:
        f.write("two")
    assert path.read_text() == "two"
    with atomic_file(tmp_path / "blob.bin", "wb") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "blob.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["blob.bin", "state.txt", "sub"]


def test_atomic_file_that_raises_keeps_the_old_content_and_no_temp(tmp_path):
    path = tmp_path / "state.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="mid-write"), atomic_file(path) as f:
        f.write("half of the new cont")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.txt"]
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "new.txt") as f:
        raise RuntimeError("before anything was written")
    assert [p.name for p in tmp_path.iterdir()] == ["state.txt"]


def test_atomic_file_refuses_append_and_read_modes(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"), atomic_file(tmp_path / "x", "a"):
        pass


def test_atomic_dir_commits_only_on_success(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(KeyboardInterrupt), atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and ".tmp-" in tmp.name and not any(tmp.iterdir())
        (tmp / "weights.bin").write_bytes(b"x" * 10)
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(out) as tmp:
        (tmp / "nested").mkdir()
        (tmp / "nested" / "weights.bin").write_bytes(b"y" * 10)
    assert (out / "nested" / "weights.bin").read_bytes() == b"y" * 10
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_atomic_dir_replaces_an_existing_directory_unless_told_to_keep_it(tmp_path):
    out = tmp_path / "data"
    with atomic_dir(out) as tmp:
        (tmp / "v1.txt").write_text("1")
    with atomic_dir(out) as tmp:
        (tmp / "v2.txt").write_text("2")
    assert [p.name for p in out.iterdir()] == ["v2.txt"]
    with atomic_dir(out, replace=False) as tmp:  # another writer finished first: theirs stays
        (tmp / "v3.txt").write_text("3")
    assert [p.name for p in out.iterdir()] == ["v2.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_seal_runs_after_the_contents_and_before_the_rename(tmp_path):
    seen = []

    def seal(tmp):
        seen.append(sorted(p.name for p in tmp.iterdir()))
        (tmp / "COMPLETE").write_text("")

    with atomic_dir(tmp_path / "ckpt", tag="7", seal=seal) as tmp:
        assert tmp.name == "ckpt.tmp-7"
        (tmp / "shard").write_text("s")
        assert seen == []
    assert seen == [["shard"]] and sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["COMPLETE", "shard"]


def test_two_phase_commit_of_a_directory_filled_by_several_writers(tmp_path):
    final = tmp_path / "step"
    tmp = fresh_dir(temp_sibling(final, "abc"))
    for rank in range(3):  # each rank writes its own file below the agreed temporary name
        (temp_sibling(final, "abc") / f"rank{rank}").write_text(str(rank))
    assert not final.exists()
    assert commit_dir(tmp, final) == final
    assert sorted(p.name for p in final.iterdir()) == ["rank0", "rank1", "rank2"]
    assert [p.name for p in tmp_path.iterdir()] == ["step"]


def test_fresh_dir_clears_what_a_failed_write_left(tmp_path):
    left = temp_sibling(tmp_path / "x", str(os.getpid()))
    left.mkdir()
    (left / "junk").write_text("j")
    assert list(fresh_dir(left).iterdir()) == []
