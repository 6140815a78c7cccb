"""MLX's dtype-only kernels (indexing, compiled activations) built in side processes on a first
start: indexing modules named as MLX names them, activations marked once filed, only what the
cache lacks is built, spread over the processes, each filed into the shared cache as soon as it
is built, and a spec that fails costs only itself."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from support.helpers import on_own_thread
from vlmserve.engine import mlx_prebuild


def test_indexing_modules_are_named_as_mlx_files_them_and_the_likeliest_come_first():
    specs = mlx_prebuild.specs("float16")
    assert specs[:3] == ["gather:float16:int32:1", "act:swiglu:float16", "scatter:float16:int32:Assign:1"]
    names = [mlx_prebuild.module_name(s) for s in specs if not s.startswith("act:")]
    for name in (
        "gather_float16_int32_1",
        "scatter_float16_int32_Assign_1",
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
    assert {s for s in specs if s.startswith("act:")} == {f"act:{a}:float16" for a in mlx_prebuild.ACTIVATIONS}
    assert len(set(specs)) == len(specs)
    assert not any("bfloat16" in s for s in specs)  # the model's dtype only


def test_an_activation_counts_as_built_by_its_marker_an_indexing_module_by_its_file(tmp_path):
    assert not mlx_prebuild.built(tmp_path, "act:gelu:bfloat16")
    assert not mlx_prebuild.built(tmp_path, "gather:bfloat16:int32:1")
    (tmp_path / "gather_bfloat16_int32_1.ptx").write_bytes(b"cubin")  # the engine's own build counts too
    (tmp_path / "vlmserve-prebuilt").mkdir()
    (tmp_path / "vlmserve-prebuilt" / "act-gelu-bfloat16").touch()
    assert mlx_prebuild.built(tmp_path, "act:gelu:bfloat16") and mlx_prebuild.built(tmp_path, "gather:bfloat16:int32:1")


def test_every_spec_runs_its_op():
    """Each spec's op runs (on the CPU here: the ops are what matter, MLX compiles only on CUDA)."""

    def run_all():
        for dtype in ("bfloat16", "float16", "float32"):
            for spec in mlx_prebuild.specs(dtype):
                mlx_prebuild.build(spec)  # raises for a spec it cannot run

    on_own_thread(run_all)
    with pytest.raises(ValueError):
        mlx_prebuild.build("gather_nd:float32:int32")


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

    monkeypatch.setattr(mlx_prebuild, "build", build)
    monkeypatch.setattr(mlx_prebuild.os, "nice", lambda n: 0)
    assert mlx_prebuild.main(["--file-into", str(shared), "one", "bad", "act:gelu:float16"]) == 0
    assert filed == [[], ["one.ptx"]]  # "one" was filed before the next was built
    assert sorted(p.name for p in shared.glob("*.ptx")) == ["act:gelu:float16.ptx", "one.ptx"]
    assert mlx_prebuild.built(shared, "act:gelu:float16")  # marked once filed
    assert mlx_prebuild.main(["bad"]) == 1


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
            assert module == mlx_prebuild.__name__ and shared == cache
            started.append(args)

        def done(self):
            return True

        def finish(self, timeout):
            finished.append(timeout)
            return True

    monkeypatch.setattr(mlx_prebuild, "StagedBuild", Staged)
    with caplog.at_level(logging.INFO, logger=mlx_prebuild.__name__):
        prebuild = mlx_prebuild.start(model, processes=3)
        prebuild._thread.join(10)
    assert len(started) == 3 and all(args[:2] == ["--file-into", str(cache)] for args in started)
    specs = [s for args in started for s in args[2:]]
    assert sorted(specs) == sorted(mlx_prebuild.specs("bfloat16")[1:])  # all but the cached one
    assert finished == [5.0, 5.0, 5.0]  # each ended: its output read
    assert f"0 of {len(specs)} modules in the kernel cache" in caplog.text  # the fakes filed nothing
    assert "(3 parallel processes, 0 failed or stopped)" in caplog.text

    (cache / "vlmserve-prebuilt").mkdir()
    for spec in mlx_prebuild.specs("bfloat16"):
        (cache / f"{mlx_prebuild.module_name(spec)}.ptx").write_bytes(b"built")
        (cache / "vlmserve-prebuilt" / spec.replace(":", "-")).touch()
    assert mlx_prebuild.start(model) is None  # nothing left to build
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    assert mlx_prebuild.start(model) is None  # no kernel cache: nothing is kept


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

    monkeypatch.setattr(mlx_prebuild, "StagedBuild", Hung)
    prebuild = mlx_prebuild.Prebuild([["a"], ["b"]], tmp_path / "kc", timeout=0.3)
    t0 = time.monotonic()
    prebuild._thread.join(10)
    assert outcomes == [0.0, 0.0] and time.monotonic() - t0 < 5


@pytest.mark.gpu
def test_each_indexing_spec_builds_the_module_it_names_and_an_activation_builds_the_models(tmp_path):
    """On CUDA: a build process leaves the module `module_name` names in its cache, and an
    activation's build the very module a layer calling that activation compiles."""
    specs = [s for s in mlx_prebuild.specs("bfloat16")[:5] if not s.startswith("act:")]
    specs += ["gather_axis:float32:uint32", "masked_scatter:bfloat16", "scatter:float32:uint32:Sum:1"]
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path / "specs"))
    subprocess.run([sys.executable, "-m", mlx_prebuild.__name__, *specs], env=env, check=True, timeout=600)
    built = {p.stem for p in (tmp_path / "specs").glob("*.ptx")}
    assert {mlx_prebuild.module_name(s) for s in specs} <= built

    layer = (
        "import mlx.core as mx, mlx.nn as nn; mlp = nn.Sequential(nn.Linear(64, 96), nn.GELU(approx='fast'));"
        " mx.eval(mlp(mx.random.normal((3, 7, 64)).astype(mx.bfloat16)))"
    )
    for tag, command in (
        ("act", ["-m", mlx_prebuild.__name__, "act:gelu_fast_approx:bfloat16"]),
        ("layer", ["-c", layer]),
    ):
        env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path / tag))
        subprocess.run([sys.executable, *command], env=env, check=True, timeout=600)
    assert {p.name for p in (tmp_path / "layer").glob("*.ptx")} <= {p.name for p in (tmp_path / "act").glob("*.ptx")}


def test_stopping_ends_the_builds_and_the_reaper_quietly(tmp_path, monkeypatch, caplog):
    outcomes = []

    class Running:
        def __init__(self, *args, **kwargs):
            self.killed = False

        def done(self):
            return self.killed

        def finish(self, timeout):
            outcomes.append(timeout)
            return True

        def kill(self):
            self.killed = True

    monkeypatch.setattr(mlx_prebuild, "StagedBuild", Running)
    with caplog.at_level(logging.INFO, logger=mlx_prebuild.__name__):
        prebuild = mlx_prebuild.Prebuild([["a"], ["b"]], tmp_path)
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

    monkeypatch.setattr(mlx_prebuild, "StagedBuild", Flaky)
    with pytest.raises(OSError):
        mlx_prebuild.Prebuild([["a"], ["b"], ["c"]], tmp_path)
    assert len(started) == 2 and all(b.killed for b in started)
