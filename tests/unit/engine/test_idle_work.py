"""Decode shapes left for idle time: one per idle turn of the worker; a failure is logged and
leaves the rest to traffic (they compile when first used) instead of ending the worker."""

from __future__ import annotations

import logging
from types import SimpleNamespace


class _Model:
    """Kernels left to build: each build appends its name to `log`."""

    def __init__(self, kernels, log, fail=()):
        self.kernels, self.log, self.fail = list(kernels), log, fail

    def kernels_pending(self):
        return len(self.kernels)

    def build_next_kernel(self):
        name = self.kernels.pop(0)
        if name in self.fail:
            raise RuntimeError(f"nvrtc refused {name}")
        self.log.append(name)


def _core(warm_shape, kernels=(), log=None, fail=()):
    from vlmserve.engine.core import EngineCore

    log = [] if log is None else log
    core = SimpleNamespace(
        _shapes_to_warm=[(1, 32), (2, 32), (4, 32)],
        runner=SimpleNamespace(batches=SimpleNamespace(warm_shape=warm_shape, retrace=lambda: log.append("retrace"))),
        model=_Model(kernels, log, fail),
        noted=[],
        _kernels_due=None,
        _kernel_seconds=0.0,
    )
    core._note_peak = core.noted.append
    core._build_kernel = lambda: EngineCore._build_kernel(core)
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


def test_kernels_are_built_first_then_decode_steps_retrace_with_them_then_shapes_compile():
    log = []
    core, engine_core = _core(lambda rows, width: log.append((rows, width)) or True, ["qkv", "mlp"], log)
    while engine_core.has_idle_work(core):
        engine_core.idle_work(core)
    assert log == ["qkv", "mlp", "retrace", (1, 32), (2, 32), (4, 32)]


def test_a_kernel_that_fails_to_build_is_skipped_and_the_rest_go_on(caplog):
    log = []
    core, engine_core = _core(lambda rows, width: True, ["qkv", "mlp"], log, fail=("qkv",))
    with caplog.at_level(logging.WARNING):
        engine_core.idle_work(core)
        engine_core.idle_work(core)
    assert log == ["mlp", "retrace"] and "nvrtc refused qkv" in caplog.text


def test_kernels_left_past_the_grace_period_are_due_even_without_an_idle_turn():
    import time

    core, engine_core = _core(lambda rows, width: True, ["qkv"])
    assert not engine_core._kernels_overdue(core)  # no warm-up has set a deadline
    core._kernels_due = time.monotonic() + 60
    assert not engine_core._kernels_overdue(core)
    core._kernels_due = time.monotonic() - 1
    assert engine_core._kernels_overdue(core)
    engine_core._build_kernel(core)
    assert not engine_core._kernels_overdue(core) and core._kernels_due is None
