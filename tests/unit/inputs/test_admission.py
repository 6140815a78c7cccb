"""Admission's counts (inputs/admission.py): a request's place in the preprocessing queue until
its job ends, each choice's place in --max-waiting until its hold is released or dropped."""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from vlmserve.inputs.admission import Admission, ChoiceHold
from vlmserve.protocol import EngineError


class _Preprocessor:
    def __init__(self, encode):
        self.pool = ThreadPoolExecutor(1)
        self.encode = encode

    def check_text_length(self, chat) -> None:
        pass

    async def fetch_images(self, chat) -> list:
        return []

    def encode_chat(self, chat, images):
        return self.encode(chat)


def _admission(encode, max_waiting=8) -> Admission:
    config = SimpleNamespace(max_waiting=max_waiting, max_pending_preprocess=8)
    metrics = SimpleNamespace(preprocess=SimpleNamespace(observe=lambda s: None), preprocessed=lambda kind: None)
    admission = Admission(config, metrics, lambda: 0)
    admission.preprocessor = _Preprocessor(encode)
    return admission


def test_choices_count_until_their_holds_go():
    admission = _admission(lambda chat: "prepared")
    prepared, holds = asyncio.run(admission.prepare(SimpleNamespace(n=3)))
    assert prepared == "prepared" and len(holds) == 3 and all(isinstance(h, ChoiceHold) for h in holds)
    assert admission.pending_requests == 0 and admission.pending_choices == 3  # the job ended; the choices wait
    holds[0].release()
    holds[0].release()  # once only
    assert admission.pending_choices == 2
    with pytest.raises(EngineError):  # 2 waiting + 7 > 8
        admission.check_capacity(7)
    del holds[1:]  # never started: dropped
    gc.collect()
    assert admission.pending_choices == 0


def test_a_failed_job_gives_its_places_back():
    def fail(chat):
        raise ValueError("bad image")

    admission = _admission(fail)
    with pytest.raises(ValueError):
        asyncio.run(admission.prepare(SimpleNamespace(n=2)))
    assert admission.pending_requests == admission.pending_choices == 0


def test_a_cancelled_request_keeps_its_places_until_its_job_ends_or_never_starts():
    gate = threading.Event()
    admission = _admission(lambda chat: gate.wait(10) and "prepared")

    async def run():
        first = asyncio.create_task(admission.prepare(SimpleNamespace(n=1)))  # runs, blocked on the gate
        queued = asyncio.create_task(admission.prepare(SimpleNamespace(n=2)))  # waits for the one thread
        await asyncio.sleep(0.1)
        first.cancel()
        queued.cancel()
        await asyncio.gather(first, queued, return_exceptions=True)
        held = (admission.pending_requests, admission.pending_choices)  # the running job's places stay
        gate.set()
        for _ in range(100):
            if admission.pending_requests == 0:
                break
            await asyncio.sleep(0.01)
        return held

    held = asyncio.run(run())
    assert held == (1, 1)
    assert admission.pending_requests == admission.pending_choices == 0
