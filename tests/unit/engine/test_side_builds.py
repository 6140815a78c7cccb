"""Kernel builds started before the engine loads (side_builds): only for a model already on
disk, and the engine then takes them over instead of starting its own."""

from __future__ import annotations

from vlmserve.config import ServerConfig
from vlmserve.engine import side_builds
from vlmserve.engine.ops import cuda_kernels


def test_an_early_start_needs_the_model_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "kc"))  # a CUDA runner starts builds there
    monkeypatch.setenv("CUDA_CACHE_PATH", str(tmp_path / "cc"))
    assert side_builds.start_early(str(tmp_path / "missing")) is None
    # A hub id not in the local cache: fetching it is the engine's start's job (with its errors).
    assert side_builds.start_early("nobody-at-all/no-such-model-here") is None
    builds = side_builds.start_early(str(tmp_path))
    assert builds is not None and builds.model_path == tmp_path.resolve()
    if not cuda_kernels.on_cuda():  # nothing to build off CUDA
        assert builds.qmm == [] and builds.indexing is None


def test_the_engine_takes_over_builds_started_early(tmp_path):
    from vlmserve.engine.inprocess import Engine

    class Running:
        def __init__(self):
            self.stopped = False

        def kill(self):
            self.stopped = True

        def stop(self):
            self.stopped = True

    qmm, indexing = [Running()], Running()
    engine = Engine(ServerConfig(model=str(tmp_path)), side=side_builds.SideBuilds(tmp_path, qmm, indexing))
    engine.stop_kernel_builds()  # an engine whose start failed still ends them
    assert qmm[0].stopped and indexing.stopped


def test_a_start_that_fails_halfway_leaves_no_build_running(tmp_path, monkeypatch):
    """An odd config breaking the second kind of build: the first kind's processes are ended,
    and an early start gives up quietly (the engine's own start says why)."""
    running = []

    class Build:
        def kill(self):
            running.remove(self)

    def qmm(path, background=()):
        running.append(Build())
        return list(running)

    def indexing(path):
        raise AttributeError("'list' object has no attribute 'get'")

    monkeypatch.setattr(side_builds.cuda_kernels, "on_cuda", lambda: True)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "kc"))
    monkeypatch.setattr(side_builds.kernel_prebuild, "start", qmm)
    monkeypatch.setattr(side_builds.indexing_prebuild, "start", indexing)
    assert side_builds.start_early(str(tmp_path)) is None
    assert running == []


def test_the_engine_starts_with_the_early_builds_model_and_starts_none_of_its_own(tmp_path, monkeypatch):
    import asyncio

    from vlmserve.engine import inprocess

    class Stop(Exception):
        pass

    def refuse(*args):
        raise AssertionError("resolved or started again")

    def no_tokenizer(path):
        raise Stop  # the start got past the builds: enough here

    monkeypatch.setattr(inprocess, "resolve_model_path", refuse)
    monkeypatch.setattr(inprocess.side_builds, "start", refuse)
    monkeypatch.setattr(inprocess, "model_type_of", lambda path: "qwen2_vl")
    monkeypatch.setattr(inprocess, "TextCodec", no_tokenizer)
    monkeypatch.setattr(inprocess.cuda_kernels, "on_cuda", lambda: False)
    engine = inprocess.Engine(ServerConfig(model="somewhere"), side=side_builds.SideBuilds(tmp_path))
    try:
        try:
            asyncio.run(engine.start())
        except Stop:
            pass
        assert engine.model_path == tmp_path and engine.model_type == "qwen2_vl"
    finally:
        engine.worker.stop()
