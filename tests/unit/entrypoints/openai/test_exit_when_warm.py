"""--exit-when-warm: the server stops once warm-up is over, and only then; an engine that fails
first makes it a failed start; a drain ends the wait without exiting."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from vlmserve.entrypoints.openai import app


def _state(pending: list[int], problem=None, ready=True):
    calls = []
    state = SimpleNamespace(
        draining=False,
        ready=ready,
        load_error=None,
        config=SimpleNamespace(stall_timeout=30.0),
        stop_serving=lambda: calls.append("exit"),
    )
    readings = iter(pending)
    state.engine = SimpleNamespace(
        problem=lambda stall, loading: problem,
        cache_gauges=lambda: SimpleNamespace(warmup_pending=next(readings, 0)),
    )
    return state, calls


def test_it_exits_after_three_readings_in_a_row_with_nothing_pending(monkeypatch):
    monkeypatch.setattr(app, "_WARM_POLL_S", 0.001)
    state, calls = _state([2, 0, 0, 1, 0, 0])  # a reading above 0 starts the count again
    seen = []
    engine = state.engine
    gauges = engine.cache_gauges
    engine.cache_gauges = lambda: seen.append(1) or gauges()
    asyncio.run(app.ServerState._exit_once_warm(state, 0.0))
    assert calls == ["exit"] and len(seen) == 7 and state.load_error is None


def test_an_engine_that_fails_first_makes_it_a_failed_start(monkeypatch):
    monkeypatch.setattr(app, "_WARM_POLL_S", 0.001)
    state, calls = _state([1, 1], problem="inference worker died")
    asyncio.run(app.ServerState._exit_once_warm(state, 0.0))
    assert calls == ["exit"] and "inference worker died" in state.load_error  # load_error: exit status 1


def test_a_drain_or_an_engine_being_replaced_does_not_count_as_warm(monkeypatch):
    monkeypatch.setattr(app, "_WARM_POLL_S", 0.001)
    state, calls = _state([0, 0, 0, 0], ready=False)  # not ready (an engine restarting): no reading counts

    async def drain_later():
        task = asyncio.ensure_future(app.ServerState._exit_once_warm(state, 0.0))
        await asyncio.sleep(0.05)
        state.draining = True
        await asyncio.wait_for(task, 5)

    asyncio.run(drain_later())
    assert calls == []
