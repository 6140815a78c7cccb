"""On Apple silicon the engine keeps the GPU's recommended working set wired, as mlx-lm and
mlx-vlm do while they generate (engine/memory.py: wire_memory); elsewhere it does nothing."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

GB = 10**9


@pytest.fixture
def metal(monkeypatch):
    """A stand-in Metal backend with a 48 GB recommended working set; the limits it is given."""
    import mlx.core as mx

    from vlmserve.engine import memory

    wired: list[int] = []
    monkeypatch.setattr(mx, "metal", SimpleNamespace(is_available=lambda: True))
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 48 * GB})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: wired.append(n) or 0)
    return memory, wired


def test_metal_wires_the_recommended_working_set(metal, caplog):
    memory, wired = metal
    with caplog.at_level(logging.INFO, logger="vlmserve.engine.memory"):
        assert memory.wire_memory(4 * GB) == 48 * GB
    assert wired == [48 * GB]
    assert "wired memory limit: 48.0 GB" in caplog.text and "paging" not in caplog.text


def test_weights_near_the_working_set_are_warned_about(metal, caplog):
    memory, wired = metal
    with caplog.at_level(logging.WARNING, logger="vlmserve.engine.memory"):
        memory.wire_memory(45 * GB)
    assert wired == [48 * GB] and "expect paging" in caplog.text


def test_a_refused_limit_is_a_warning_not_a_failed_start(metal, monkeypatch, caplog):
    import mlx.core as mx

    memory, _ = metal

    def refuse(limit):
        raise ValueError("[metal::set_wired_limit] Setting a wired limit larger than the maximum")

    monkeypatch.setattr(mx, "set_wired_limit", refuse)
    with caplog.at_level(logging.WARNING, logger="vlmserve.engine.memory"):
        assert memory.wire_memory(4 * GB) is None
    assert "not set" in caplog.text


def test_other_backends_are_left_alone(monkeypatch):
    import mlx.core as mx

    from vlmserve.engine import memory

    monkeypatch.setattr(mx, "metal", SimpleNamespace(is_available=lambda: False))
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: pytest.fail("wired off Metal"))
    assert memory.wire_memory(4 * GB) is None
