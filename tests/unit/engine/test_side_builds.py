"""Kernel builds started before the engine loads (side_builds): only for a model already on
disk, and the engine then takes them over instead of starting its own."""

from __future__ import annotations

from vlmserve.config import ServerConfig
from vlmserve.engine import side_builds
from vlmserve.engine.ops import cuda_kernels


def test_an_early_start_needs_the_model_on_disk(tmp_path):
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
