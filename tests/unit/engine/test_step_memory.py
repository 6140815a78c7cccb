"""The working-memory bound (engine/memory.py): MLX's memory limit is set before each step to the
memory in use plus the allowance, so a step's evaluation waits for the GPU to free temporaries
instead of holding a whole forward's worth of them."""

from __future__ import annotations

import pytest

GIB = 1 << 30


@pytest.fixture
def memory_limit():
    import mlx.core as mx

    before = mx.get_memory_limit()
    yield
    mx.set_memory_limit(before)


def test_the_allowance_is_the_operators_or_a_share_of_the_device(monkeypatch):
    from vlmserve.engine import memory

    assert memory.working_memory_bytes(1.5) == int(1.5 * GIB)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 120 * GIB)
    assert memory.working_memory_bytes(None) == 120 * GIB // 80
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 8 * GIB)
    assert memory.working_memory_bytes(None) == GIB  # at least 1 GiB
    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 512 * GIB)
    assert memory.working_memory_bytes(None) == 2 * GIB  # at most 2 GiB
    with pytest.raises(ValueError, match="--working-memory"):
        memory.working_memory_bytes(-1)  # a limit below the memory in use would stall every step


def test_the_limit_follows_the_memory_in_use(memory_limit):
    import mlx.core as mx

    from vlmserve.engine.memory import StepMemoryBound

    # (No arrays made here: MLX work belongs on the engine's worker thread. The e2e test in
    # tests/e2e/engine/sched checks it over real steps.)
    bound = StepMemoryBound(GIB // 4)
    bound.apply()
    assert mx.get_memory_limit() == mx.get_active_memory() + GIB // 4
    StepMemoryBound(GIB).apply()
    assert mx.get_memory_limit() == mx.get_active_memory() + GIB
