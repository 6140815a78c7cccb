"""Decode shapes left for idle time: one per idle turn of the worker; a failure is logged and
leaves the rest to traffic (they compile when first used) instead of ending the worker."""

from __future__ import annotations

import logging
from types import SimpleNamespace


def _core(warm_shape):
    from vlmserve.engine.core import EngineCore

    core = SimpleNamespace(
        _shapes_to_warm=[(1, 32), (2, 32), (4, 32)],
        runner=SimpleNamespace(batches=SimpleNamespace(warm_shape=warm_shape)),
        noted=[],
    )
    core._note_peak = core.noted.append
    return core, EngineCore


def test_one_shape_per_idle_turn():
    traced = []
    core, engine_core = _core(lambda rows, width: traced.append((rows, width)) or True)
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
    assert traced == [(1, 32), (2, 32), (4, 32)] and len(core.noted) == 3


def test_a_failed_compile_leaves_the_rest_to_traffic(caplog):
    def fails(rows, width):
        raise MemoryError("out of device memory")

    core, engine_core = _core(fails)
    with caplog.at_level(logging.WARNING):
        engine_core.idle_work(core)  # does not raise
    assert not engine_core.has_idle_work(core)
    assert "compile when first used" in caplog.text
