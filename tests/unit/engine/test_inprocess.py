"""Engine.generate (engine/inprocess.py) over a scripted engine core: events queued for a reader
are joined, an error kept apart from the text before it."""

from __future__ import annotations

import numpy as np
import pytest


class _Scripted:
    """An engine core stand-in that answers each request with these events, all at once."""

    def __init__(self, engine, events):
        self.engine, self.events, self.inbox = engine, events, []

    def add(self, req):
        for event in self.events:
            req.emit(event)
        self.engine._flush()


@pytest.mark.parametrize("last", ["length", "error"])
def test_joined_events_keep_an_error_apart_from_the_text_before_it(last):
    import asyncio
    from types import SimpleNamespace

    from vlmserve.config import ServerConfig
    from vlmserve.engine.inprocess import Engine
    from vlmserve.protocol import FinishReason, PreparedRequest, SamplingParams, TokenEvent

    engine = Engine(ServerConfig(model="unused"))
    engine.worker = SimpleNamespace(healthy=True, wake=lambda: None)
    final = (
        TokenEvent("c", [3], finish_reason=FinishReason.LENGTH, completion_tokens=3)
        if last == "length"
        else TokenEvent(finish_reason=FinishReason.ERROR, error="boom")
    )
    engine.core = _Scripted(engine, [TokenEvent("a", [1]), TokenEvent("b", [2]), final])

    async def read():
        return [
            e async for e in engine.generate("r", PreparedRequest(prompt_ids=np.zeros(3, np.int32)), SamplingParams())
        ]

    events = asyncio.run(read())
    if last == "length":  # all three were queued before the reader looked: one event
        assert [(e.text, e.token_ids, e.finish_reason, e.completion_tokens) for e in events] == [
            ("abc", [1, 2, 3], FinishReason.LENGTH, 3)
        ]
    else:
        assert [(e.text, e.token_ids, e.finish_reason, e.error) for e in events] == [
            ("ab", [1, 2], None, None),
            ("", [], FinishReason.ERROR, "boom"),
        ]
