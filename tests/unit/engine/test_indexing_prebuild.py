"""MLX's indexing kernels built in side processes on a first start: the modules named as MLX
names them, only those the cache lacks are built, spread over the processes, each filed into the
shared cache as soon as it is built, and a spec that fails costs only itself."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from support.helpers import on_own_thread
from vlmserve.engine import indexing_prebuild


def test_modules_are_named_as_mlx_files_them_the_likeliest_first():
    specs = indexing_prebuild.modules("float16")
    names = [indexing_prebuild.module_name(s) for s in specs]
    assert names[:3] == ["gather_float16_int32_1", "scatter_float16_int32_Assign_1", "gather_int32_int32_1"]
    for name in (
        "scatter_float32_uint32_Sum_1",
        "scatter_float16_int32_Sum_1",
        "gather_uint32_uint32_1",
        "gather_float16_uint32_2",
        "gather_int64_uint32_1",
        "gather_axis_float32_uint32",
        "scatter_axis_float16_int32_Assign",
        "masked_scatter_float16",
    ):
        assert name in names
    assert len(set(names)) == len(names)
    assert not any("bfloat16" in n for n in names)  # the model's dtype only


def test_a_quantized_models_embedding_lookup_comes_first():
    """Its embedding gathers packed uint32 weights by int32 ids besides its scales: both modules
    lead, so a first start's first processes build what the load's first forward needs."""
    names = [indexing_prebuild.module_name(s) for s in indexing_prebuild.modules("bfloat16", quantized=True)]
    assert names[:2] == ["gather_bfloat16_int32_1", "gather_uint32_int32_1"]
    assert len(set(names)) == len(names)
    assert set(names) == {indexing_prebuild.module_name(s) for s in indexing_prebuild.modules("bfloat16")}


def test_every_spec_runs_its_op():
    """Each spec's op runs (on the CPU here: the ops are what matter, MLX compiles only on CUDA)."""

    def run_all():
        for dtype in ("bfloat16", "float16", "float32"):
            for spec in indexing_prebuild.modules(dtype):
                indexing_prebuild.build(spec)  # raises for a spec it cannot run

    on_own_thread(run_all)
    with pytest.raises(ValueError):
        indexing_prebuild.build("gather_nd:float32:int32")


def test_a_failing_spec_costs_only_itself_and_each_build_is_filed_as_it_ends(tmp_path, monkeypatch):
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir()
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(private))
    filed = []

    def build(spec):
        if spec == "bad":
            raise ValueError("no such op")
        (private / f"{spec}.ptx").write_bytes(b"cubin")
        filed.append(sorted(p.name for p in shared.glob("*")) if shared.exists() else [])

    monkeypatch.setattr(indexing_prebuild, "build", build)
    monkeypatch.setattr(indexing_prebuild.os, "nice", lambda n: 0)
    assert indexing_prebuild.main(["--file-into", str(shared), "one", "bad", "two"]) == 0
    assert filed == [[], ["one.ptx"]]  # "one" was filed before "two" was built
    assert sorted(p.name for p in shared.glob("*")) == ["one.ptx", "two.ptx"]
    assert indexing_prebuild.main(["bad"]) == 1


def test_a_start_builds_what_the_cache_lacks_over_the_processes_and_files_each_process(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "kc"
    cache.mkdir()
    (cache / "gather_bfloat16_int32_1.ptx").write_bytes(b"built earlier")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    started, finished = [], []

    class Staged:
        def __init__(self, module, args, shared, tag, seed):
            assert not seed  # each spec is built whatever else the cache holds
            assert module == indexing_prebuild.__name__ and shared == cache
            started.append(args)

        def done(self):
            return True

        def finish(self, timeout):
            finished.append(timeout)
            return True

    monkeypatch.setattr(indexing_prebuild, "StagedBuild", Staged)
    with caplog.at_level(logging.INFO, logger=indexing_prebuild.__name__):
        prebuild = indexing_prebuild.start(model, processes=3)
        prebuild._thread.join(10)
    assert len(started) == 3 and all(args[:2] == ["--file-into", str(cache)] for args in started)
    specs = [s for args in started for s in args[2:]]
    assert sorted(specs) == sorted(indexing_prebuild.modules("bfloat16")[1:])  # all but the cached one
    assert finished == [5.0, 5.0, 5.0]  # each ended: its output read
    assert "0 of 36 modules in the kernel cache" in caplog.text  # the fakes filed nothing
    assert "(3 parallel processes, 0 failed or stopped)" in caplog.text

    for spec in indexing_prebuild.modules("bfloat16"):
        (cache / f"{indexing_prebuild.module_name(spec)}.ptx").write_bytes(b"built")
    assert indexing_prebuild.start(model) is None  # nothing left to build
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert indexing_prebuild.start(model) is None  # no kernel cache: nothing is kept


def test_builds_under_way_say_how_many_modules_are_in_the_cache(tmp_path, monkeypatch, caplog):
    """A start users can watch: while the processes run, a line says n of N modules are filed
    (at most one every PROGRESS_S, and only when n grew)."""
    cache = tmp_path / "kc"
    cache.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.setattr(indexing_prebuild, "PROGRESS_S", 0.0)
    running = threading.Event()
    running.set()

    class Staged:
        def __init__(self, *args, **kwargs):
            pass

        def done(self):
            return not running.is_set()

        def finish(self, timeout):
            return True

        def kill(self):
            pass

    monkeypatch.setattr(indexing_prebuild, "StagedBuild", Staged)
    with caplog.at_level(logging.INFO, logger=indexing_prebuild.__name__):
        prebuild = indexing_prebuild.start(model, processes=2)
        total = len(prebuild.specs)
        try:
            for spec in prebuild.specs[:3]:
                (cache / f"{indexing_prebuild.module_name(spec)}.ptx").write_bytes(b"built")
            deadline = time.monotonic() + 10
            while f"3/{total} in the kernel cache" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
        finally:
            running.clear()
            prebuild._thread.join(10)
    progress = [r.getMessage() for r in caplog.records if "in the kernel cache (" in r.getMessage()]
    # None while nothing was filed, none again while nothing more was (the three files may be
    # seen one poll apart: a line for each count, rising).
    counts = [int(line.split(": ")[1].split("/")[0]) for line in progress]
    assert counts and counts == sorted(set(counts)) and counts[0] > 0 and counts[-1] == 3, progress
    assert f"3 of {total} modules in the kernel cache" in caplog.text  # the closing line


def test_a_build_past_its_time_is_stopped(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "kc"))
    outcomes = []

    class Hung:
        def __init__(self, *args, **kwargs):
            self.killed = False

        def kill(self):
            self.killed = True

        def done(self):
            return False

        def finish(self, timeout):
            outcomes.append(timeout)
            return False

    monkeypatch.setattr(indexing_prebuild, "StagedBuild", Hung)
    prebuild = indexing_prebuild.Prebuild([["a"], ["b"]], tmp_path / "kc", timeout=0.3)
    t0 = time.monotonic()
    prebuild._thread.join(10)
    assert outcomes == [0.0, 0.0] and time.monotonic() - t0 < 5


@pytest.mark.gpu
def test_each_spec_builds_the_module_it_names(tmp_path):
    """On CUDA: a build process leaves exactly the module `module_name` names in its cache."""
    specs = indexing_prebuild.modules("bfloat16")[:3] + ["gather_axis:float32:uint32", "masked_scatter:bfloat16"]
    specs += ["scatter:float32:uint32:Sum:1", "scatter_axis:float32:int32"]
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-m", indexing_prebuild.__name__, *specs], env=env, check=True, timeout=600)
    built = {p.stem for p in tmp_path.glob("*.ptx")}
    assert {indexing_prebuild.module_name(s) for s in specs} <= built


class _Running:
    """A build process stand-in that runs until killed, and succeeds."""

    def __init__(self, *args, **kwargs):
        self.killed = False

    def done(self):
        return self.killed

    def finish(self, timeout):
        return True

    def kill(self):
        self.killed = True


def test_stopping_ends_the_builds_and_the_reaper_quietly(tmp_path, monkeypatch, caplog):
    outcomes = []

    class Running(_Running):
        def finish(self, timeout):
            outcomes.append(timeout)
            return True

    monkeypatch.setattr(indexing_prebuild, "StagedBuild", Running)
    with caplog.at_level(logging.INFO, logger=indexing_prebuild.__name__):
        prebuild = indexing_prebuild.Prebuild([["a"], ["b"]], tmp_path)
        prebuild.stop()
        prebuild._thread.join(5)
    assert all(b.killed for b in prebuild.builds) and not prebuild._thread.is_alive()
    assert outcomes == [] and "modules in the kernel cache" not in caplog.text


def test_a_process_that_cannot_start_stops_those_started_before_it(tmp_path, monkeypatch):
    started = []

    class Flaky:
        def __init__(self, *args, **kwargs):
            if len(started) == 2:
                raise OSError("no more processes")
            self.killed = False
            started.append(self)

        def kill(self):
            self.killed = True

    monkeypatch.setattr(indexing_prebuild, "StagedBuild", Flaky)
    with pytest.raises(OSError):
        indexing_prebuild.Prebuild([["a"], ["b"], ["c"]], tmp_path)
    assert len(started) == 2 and all(b.killed for b in started)


def test_the_load_waits_for_the_first_modules_until_filed_or_their_process_ends(tmp_path, monkeypatch):
    """wait_for_first returns once each process's first module is in the cache (or its process
    has ended), whatever the later ones do, and never past its timeout."""
    monkeypatch.setattr(indexing_prebuild, "StagedBuild", _Running)
    cache = tmp_path / "kc"
    cache.mkdir()
    prebuild = indexing_prebuild.Prebuild(
        [["gather:bfloat16:int32:1", "gather:int32:int32:1"], ["masked_scatter:bfloat16"]], cache
    )
    try:
        assert prebuild.wait_for_first(timeout=0.3) >= 0.3  # neither filed, both running: the timeout

        def land():
            time.sleep(0.3)
            (cache / "gather_bfloat16_int32_1.ptx").write_bytes(b"x")  # the first process's first module
            time.sleep(0.3)
            prebuild.builds[1].killed = True  # the second process ended without filing its module

        lander = threading.Thread(target=land)
        lander.start()
        waited = prebuild.wait_for_first(timeout=10)
        lander.join()
        assert 0.5 <= waited < 5  # until both, not for the later module of the first process
    finally:
        prebuild.stop()
    # A cache that lacks only unlikely modules (a start stopped early): nothing to wait for.
    later = indexing_prebuild.Prebuild([["gather_axis:float32:uint32"]], cache, likely={"gather:bfloat16:int32:1"})
    try:
        assert later.wait_for_first(timeout=5) < 0.5
    finally:
        later.stop()
