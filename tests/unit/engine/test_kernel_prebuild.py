"""Quantized-matmul kernels built in side processes: which settings a config calls for, a build
leaves a marker in the kernel cache, a later start skips what is marked, and builds the engine
does not wait for are taken by its worker as each setting's builds end."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest

from support.helpers import on_own_thread
from vlmserve.engine import kernel_prebuild


def test_settings_are_the_model_wide_one_and_every_per_layer_override():
    config = {
        "quantization": {
            "group_size": 64,
            "bits": 4,
            "language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
            "vision_tower.blocks.0.attn.qkv": False,
        }
    }
    assert kernel_prebuild.settings(config) == [(4, 64, "affine"), (8, 32, "affine")]
    assert kernel_prebuild.settings({"quantization_config": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}) == [
        (4, 32, "mxfp4")
    ]
    assert kernel_prebuild.settings({"torch_dtype": "bfloat16"}) == []


def test_the_activation_dtype_is_the_models():
    assert kernel_prebuild.activation_dtype({"torch_dtype": "float16"}) == "float16"
    assert kernel_prebuild.activation_dtype({"text_config": {"dtype": "bfloat16"}}) == "bfloat16"
    assert kernel_prebuild.activation_dtype({}) == "bfloat16"


def test_builds_run_leave_markers_and_a_later_start_skips_them(tmp_path, monkeypatch, caplog):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization": {"group_size": 64, "bits": 4}}))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernel_prebuild, "ROW_CLASSES", (8, 16))
    procs = kernel_prebuild.start(model)
    assert len(procs) == 2
    with caplog.at_level(logging.INFO):
        kernel_prebuild.wait(procs, timeout=120)
    assert "2 built in parallel processes (0 failed)" in caplog.text
    markers = sorted(p.name for p in (tmp_path / "ptx" / "vlmserve-prebuilt").iterdir())
    assert markers == ["qmm-bfloat16-affine-b4-g64-m16", "qmm-bfloat16-affine-b4-g64-m8"]
    assert kernel_prebuild.start(model) == []  # all built: nothing to start


def test_builds_of_the_modes_served_meanwhile_run_behind_the_rest(tmp_path, monkeypatch):
    """A mode the engine serves without its kernels meanwhile (affine: dequantized) builds at a
    lower priority; one it waits for does not."""
    model = tmp_path / "model"
    model.mkdir()
    quant = {"group_size": 64, "bits": 4, "lm_head": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}
    (model / "config.json").write_text(json.dumps({"quantization": quant}))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernel_prebuild, "ROW_CLASSES", (16,))
    monkeypatch.setattr(kernel_prebuild, "StagedBuild", lambda module, args, *rest: args)
    builds = kernel_prebuild.start(model, background=("affine",))
    assert sorted((b.mode, "--background" in b.staged) for b in builds) == [("affine", True), ("mxfp4", False)]
    assert all("--background" not in b.staged for b in kernel_prebuild.start(model))


def test_the_worker_takes_a_background_builds_kernels_once_it_has_ended(tmp_path, monkeypatch, caplog):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization": {"group_size": 32, "bits": 8}}))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernel_prebuild, "ROW_CLASSES", (16,))
    background = kernel_prebuild.Background(kernel_prebuild.start(model), timeout=120)
    assert background.pending() == 1
    deadline = time.monotonic() + 120
    while not background.ready() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        with caplog.at_level(logging.INFO):
            taken = on_own_thread(background.take_one)  # it loads the kernel: MLX work, the worker's
    finally:
        background.stop()  # nothing left running if the wait above ran out
    assert taken == ((8, 32), "bfloat16") and background.pending() == 0 and not background.ready()
    assert "8-bit, group 32: 1 built in parallel processes" in caplog.text
    assert (tmp_path / "ptx" / "vlmserve-prebuilt" / "qmm-bfloat16-affine-b8-g32-m16").exists()


class _Staged:
    """A build process's stand-in: `ended` says whether it has exited, `ok` how."""

    def __init__(self, ended=False, ok=True, started=None):
        self.ended, self.ok, self.killed = ended, ok, False
        self.started = time.monotonic() if started is None else started

    def done(self):
        return self.ended

    def finish(self, timeout):
        if not self.ended:  # still running: finish stops it
            self.killed = True
            return False
        return self.ok

    def kill(self):
        self.killed = True


def _build(bits, group, rows, staged):
    return kernel_prebuild.KernelBuild(bits, group, "affine", "bfloat16", rows, staged)


def test_a_setting_is_taken_when_all_its_builds_have_ended_and_stays_dequantized_if_one_failed(monkeypatch, caplog):
    loaded = []
    monkeypatch.setattr(kernel_prebuild, "build", lambda *args: loaded.append(args))
    a16, a32, b16 = _Staged(), _Staged(), _Staged()
    background = kernel_prebuild.Background(
        [_build(4, 64, 16, a16), _build(4, 64, 32, a32), _build(8, 64, 16, b16)], timeout=300
    )
    assert background.pending() == 2 and not background.ready() and background.take_one() is None
    a16.ended = True
    assert not background.ready()  # the other build of (4, 64) still runs
    b16.ended, b16.ok = True, False
    with caplog.at_level(logging.INFO):
        assert background.ready() and background.take_one() is None  # (8, 64) failed: it stays dequantized
    assert "8-bit, group 64: 1 of 1 builds failed or timed out" in caplog.text
    assert background.pending() == 1 and loaded == []
    a32.ended = True
    assert background.take_one() == ((4, 64), "bfloat16")
    assert loaded == [(4, 64, "affine", "bfloat16", 16), (4, 64, "affine", "bfloat16", 32)]
    assert background.pending() == 0 and not background.ready()


def test_each_build_that_ends_moves_a_progress_line_on(caplog):
    """A start users can watch: n of N builds ended, a line each time n grows."""
    one, two = _Staged(), _Staged()
    background = kernel_prebuild.Background([_build(4, 64, 16, one), _build(4, 64, 32, two)], timeout=300)
    with caplog.at_level(logging.INFO, logger=kernel_prebuild.__name__):
        background.ready()
        one.ended = True
        background.ready()
        background.ready()
        two.ended = True
        background.ready()
    lines = [r.getMessage() for r in caplog.records if "builds ended" in r.getMessage()]
    assert [line.split(" (")[0] for line in lines] == [
        "quantized matmul kernels: 1/2 builds ended",
        "quantized matmul kernels: 2/2 builds ended",
    ]


def test_a_build_past_the_timeout_is_stopped_and_its_setting_stays_dequantized(monkeypatch):
    monkeypatch.setattr(kernel_prebuild, "build", lambda *args: pytest.fail("a failed setting loads nothing"))
    slow, stopped = _Staged(started=time.monotonic() - 10), _Staged()
    background = kernel_prebuild.Background([_build(4, 32, 16, slow)], timeout=5)
    assert background.ready() and background.take_one() is None and slow.killed
    kernel_prebuild.Background([_build(4, 32, 16, stopped)], timeout=300).stop()
    assert stopped.killed


def test_the_engine_waits_only_for_builds_whose_layers_cannot_run_dequantized(monkeypatch):
    from vlmserve.config import ServerConfig
    from vlmserve.engine.inprocess import Engine
    from vlmserve.engine.ops import many_row_dequantized

    def engine_with(serves):
        monkeypatch.setattr(many_row_dequantized, "installed", lambda model: serves)
        engine = Engine(ServerConfig(model="unused"))
        engine._prebuild = [_build(4, 64, 16, _Staged()), _build(4, 64, 32, _Staged())]
        engine._prebuild.append(kernel_prebuild.KernelBuild(4, 32, "mxfp4", "bfloat16", 16, _Staged()))
        many_row_dequantized.hold({(4, 64)})  # Engine.start holds the affine settings
        core = SimpleNamespace(model=SimpleNamespace(model=None), kernel_builds=None)
        engine._build_in_background(core)
        return engine, core

    try:
        engine, core = engine_with(serves=True)
        assert [b.mode for b in engine._prebuild] == ["mxfp4"]  # waited for at warm-up
        assert core.kernel_builds.pending() == 1 and many_row_dequantized.held() == {(4, 64)}
        engine, core = engine_with(serves=False)  # nothing runs dequantized: wait for them all
        assert len(engine._prebuild) == 3 and core.kernel_builds is None
        assert many_row_dequantized.held() == frozenset()
    finally:
        many_row_dequantized.reset()


def test_nothing_starts_without_a_kernel_cache_or_a_config(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"quantization": {"group_size": 64, "bits": 4}}))
    assert kernel_prebuild.start(tmp_path) == []
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert kernel_prebuild.start(tmp_path / "missing") == []


def test_an_engine_that_stops_stops_its_builds_and_forgets_what_they_held():
    """Engine.stop_kernel_builds (Engine.stop, and an engine process before it exits): the builds
    waited for and those in the background are stopped, and no setting stays held."""
    from vlmserve.config import ServerConfig
    from vlmserve.engine.inprocess import Engine
    from vlmserve.engine.ops import many_row_dequantized

    engine = Engine(ServerConfig(model="unused"))  # its worker never started: not alive
    waited, later = _Staged(), _Staged()
    engine._prebuild = [_build(4, 32, 16, waited)]
    engine.core = SimpleNamespace(kernel_builds=kernel_prebuild.Background([_build(4, 64, 16, later)], timeout=300))
    many_row_dequantized.hold({(4, 64)})
    try:
        engine.stop_kernel_builds()
        assert waited.killed and later.killed and engine._prebuild == [] and engine.core.kernel_builds is None
        assert many_row_dequantized.held() == frozenset()
    finally:
        many_row_dequantized.reset()
