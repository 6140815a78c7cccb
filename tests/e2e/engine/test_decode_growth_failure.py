"""A decode step whose rows cannot take their next blocks (the KV pool fails to grow) ends
that step's rows with an error, as a failed forward does, instead of stopping the engine; the
budget gets back what they held, and the engine goes on serving new requests."""

from __future__ import annotations

import pytest

from support.helpers import MODELS, on_own_thread, token_request
from vlmserve.engine.core import EngineCore
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.models.registry import load_model_adapter, model_type_of
from vlmserve.protocol import FinishReason, SamplingParams

pytestmark = pytest.mark.slow

PATH = MODELS / "qwen2_vl"


def _request(rid: str, prompt: list[int]):
    return token_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))


def _run(core: EngineCore) -> None:
    for _ in range(300):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("the engine did not finish its work")


def test_a_failed_block_growth_ends_the_steps_rows_and_the_engine_goes_on():
    prompts = {rid: [(5 * i + ord(rid)) % 400 + 20 for i in range(9)] for rid in "ABC"}

    def work():
        codec = TextCodec(PATH)
        model = load_model_adapter(PATH, model_type_of(PATH), codec.eos_token_ids)

        def engine() -> EngineCore:
            # Blocks of 4 positions: the rows take a new one every few steps.
            return EngineCore(model, codec, max_num_seqs=4, prefix_cache_tokens=0, kv_budget=KVBudget(200, 4))

        alone = engine()
        request, expected = _request("C", prompts["C"])
        alone.add(request)
        _run(alone)

        core = engine()
        events = {}
        for rid in "AB":
            request, events[rid] = _request(rid, prompts[rid])
            core.add(request)
        while not core.sched.running or any(not e for e in events.values()):
            core.step()
        batch_type = type(core.runner.batch)
        grow = batch_type.grow

        def fails_once(self):
            batch_type.grow = grow
            raise MemoryError("the KV pool could not grow")

        batch_type.grow = fails_once
        try:
            for _ in range(20):  # until the rows need a block
                core.step()
                if batch_type.grow is grow:
                    break
        finally:
            batch_type.grow = grow
        ended = {rid: (e[-1].finish_reason, e[-1].error) for rid, e in events.items()}
        held = core.sched.kv_budget.used
        request, events["C"] = _request("C", prompts["C"])
        core.add(request)
        _run(core)
        return ended, held, expected, events["C"], core.sched.kv_budget.used

    ended, held, expected, after, idle_used = on_own_thread(work)
    for rid, (reason, error) in ended.items():
        assert reason == FinishReason.ERROR and "MemoryError" in error, rid
    assert held == 0  # the failed rows gave back what the budget counted for them
    assert after[-1].finish_reason == FinishReason.LENGTH
    assert [t for e in after for t in e.token_ids] == [t for e in expected for t in e.token_ids]
    assert idle_used == 0
