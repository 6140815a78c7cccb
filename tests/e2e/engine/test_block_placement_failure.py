"""Rows whose KV blocks cannot be placed end with an error instead of stopping the engine: a
decode step whose rows cannot take their next blocks (the pool fails to grow) ends that step's
rows, as a failed forward does; a preempted row whose KV cannot come back ends alone. The
budget gets back what they held, and the engine goes on serving the others and new requests."""

from __future__ import annotations

import pytest

from support.helpers import MODELS, event_tokens, on_own_thread, run_until_idle, token_request
from vlmserve.engine.core import EngineCore
from vlmserve.engine.runner.decode_batch import DtypeGroupedBatch
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.models.registry import load_model_adapter, model_type_of
from vlmserve.protocol import FinishReason, SamplingParams

pytestmark = pytest.mark.slow

PATH = MODELS / "qwen2_vl"


def _request(rid: str, prompt: list[int], max_tokens: int = 12):
    return token_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


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
        run_until_idle(alone)

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
        run_until_idle(core)
        return ended, held, expected, events["C"], core.sched.kv_budget.used

    ended, held, expected, after, idle_used = on_own_thread(work)
    for rid, (reason, error) in ended.items():
        assert reason == FinishReason.ERROR and "MemoryError" in error, rid
    assert held == 0  # the failed rows gave back what the budget counted for them
    assert after[-1].finish_reason == FinishReason.LENGTH
    assert event_tokens(after) == event_tokens(expected)
    assert idle_used == 0


def test_a_preempted_row_whose_kv_cannot_come_back_ends_alone():
    prompts = {rid: [(3 * i + ord(rid)) % 400 + 20 for i in range(9)] for rid in "AB"}

    def work():
        codec = TextCodec(PATH)
        model = load_model_adapter(PATH, model_type_of(PATH), codec.eos_token_ids)

        def engine(blocks: int) -> EngineCore:
            return EngineCore(model, codec, max_num_seqs=4, prefix_cache_tokens=0, kv_budget=KVBudget(blocks, 4))

        alone = {}
        for rid, prompt in prompts.items():
            core = engine(200)
            request, alone[rid] = _request(rid, prompt, 40)
            core.add(request)
            run_until_idle(core)

        # 20 blocks of 4 positions: both rows start, and B (the later) steps aside as they grow.
        core = engine(20)
        assert core.runner.batches.paged
        events = {}
        for rid in "AB":
            request, events[rid] = _request(rid, prompts[rid], 40)
            core.add(request)
        resume, resumes = DtypeGroupedBatch.resume, []

        def fails_once(self, owner, host_kv):
            DtypeGroupedBatch.resume = resume
            resumes.append(owner.req.request_id)
            raise MemoryError("the KV pool could not take the row back")

        DtypeGroupedBatch.resume = fails_once
        try:
            run_until_idle(core)
        finally:
            DtypeGroupedBatch.resume = resume
        return alone, events, resumes, core.sched.kv_budget.preemptions, core.sched.kv_budget.used

    alone, events, resumes, preemptions, idle_used = on_own_thread(work)
    assert preemptions >= 1 and resumes == ["B"]
    assert events["B"][-1].finish_reason == FinishReason.ERROR and "MemoryError" in events["B"][-1].error
    assert events["A"][-1].finish_reason == FinishReason.LENGTH
    assert event_tokens(events["A"]) == event_tokens(alone["A"])
    assert idle_used == 0
