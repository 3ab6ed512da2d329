"""The fault-injection seam: hybridflow/utils/hooks.py's points are no-ops until a test fills them, the faults of
tests/faults fill only points the code declares, and a fault plugin arms a process that imports it (as every
worker of a run imports trainer.plugins). The faults' effects on real runs are in test_fault_tolerance.py and the
test_parity_*.py files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from faults import POINT_NAMES, armed, plugin_file

from hybridflow.utils import hooks

ROOT = Path(__file__).resolve().parents[1]


def test_a_point_answers_none_until_a_hook_is_installed_and_after_it_is_removed():
    point = hooks.HookPoint("test.seam_probe", "a point for this test: (x); answers x + 1")
    assert point(x=1) is None
    seen = []
    with hooks.installed({point: lambda x: seen.append(x) or x + 1}):
        assert point(x=1) == 2 and hooks.installed_points() == ["test.seam_probe"]
        with hooks.installed({"test.seam_probe": lambda x: -x}):  # by name; restores the outer hook after
            assert point(x=3) == -3
        assert point(x=4) == 5
    assert point(x=5) is None and seen == [1, 4] and hooks.installed_points() == []
    with pytest.raises(ValueError, match="'test.seam_probe' is declared twice"):
        hooks.HookPoint("test.seam_probe", "again")


def test_every_point_the_faults_fill_is_declared_by_the_code():
    import hybridflow.controller.decorator  # noqa: F401, PLC0415
    import hybridflow.rollout.sync  # noqa: F401, PLC0415
    import hybridflow.rollout.vllm.rollout  # noqa: F401, PLC0415  (imports vllm lazily: fine without it)
    import hybridflow.workers.actor_rollout_ref  # noqa: F401, PLC0415

    assert sorted(set(POINT_NAMES) - set(hooks.POINTS)) == []
    with armed(calls="update_actor@1:0", marker_dir="/nonexistent", parity="skip_sync@1,token_edit@2"):
        assert set(hooks.installed_points()) == set(POINT_NAMES)
    assert hooks.installed_points() == []


def test_no_library_file_switches_faults_on_an_environment_variable():
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "hybridflow").rglob("*.py"))
        if any(name in path.read_text() for name in ("HYBRIDFLOW_FAULT", "HYBRIDFLOW_PARITY_FAULT", "parity_fault("))
    ]
    assert offenders == []


def test_bad_specs_are_refused_before_a_run_starts(tmp_path: Path):
    with pytest.raises(ValueError, match="METHOD@STEP:RANK"):
        plugin_file(tmp_path, calls="update_actor@3", marker_dir=tmp_path)
    with pytest.raises(ValueError, match="KIND@STEP with KIND one of"):
        plugin_file(tmp_path, parity="skip_everything@2")
    with pytest.raises(ValueError, match="need a marker_dir"):
        plugin_file(tmp_path, calls="update_actor@3:0")
    assert not (tmp_path / "fault_plugin.py").exists()


PROGRAM = """
    import sys
    from hybridflow.controller.decorator import Dispatch, register
    from hybridflow.protocol import DataProto
    from hybridflow.utils.plugins import import_plugins

    import_plugins([sys.argv[1]])  # as a worker does with trainer.plugins

    class Worker:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def update_actor(self, data):
            return data.meta_info["global_step"]

    for step in (1, 2, 3):
        print("ran", Worker().update_actor(DataProto(meta_info={"global_step": step})), flush=True)
"""


def test_a_fault_plugin_arms_the_process_that_imports_it_and_fires_once(tmp_path: Path):
    plugin = plugin_file(tmp_path / "plugin", calls="update_actor@2:0", marker_dir=tmp_path / "markers")

    def run() -> subprocess.CompletedProcess:
        code = textwrap.dedent(PROGRAM)
        env = {k: v for k, v in os.environ.items() if k != "RANK"} | {"PYTHONPATH": str(ROOT)}  # rank 0
        return subprocess.run([sys.executable, "-c", code, str(plugin)], capture_output=True, text=True, env=env)

    first = run()
    assert first.returncode == -9 and first.stdout.split("\n")[:-1] == ["ran 1"], first.stdout + first.stderr
    assert [p.name for p in (tmp_path / "markers").iterdir()] == ["update_actor@2:0:kill"]
    again = run()  # the marker exists: the point has fired
    assert again.returncode == 0 and again.stdout.split() == ["ran", "1", "ran", "2", "ran", "3"], again.stderr
