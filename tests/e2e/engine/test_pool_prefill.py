"""Rows that prefill in pieces straight into the KV pool (engine/ops/paged_prefill_cache.py):
a decode step that fails (and drops the pools) leaves them to go on in their own caches, and a
prompt that embeds longer than its ids is counted by the budget before it takes blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from support.helpers import MODELS, event_tokens, on_own_thread, refuse_join_once, run_until_idle, token_request
from vlmserve.engine.core import EngineCore
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.models.registry import load_model_adapter, model_type_of
from vlmserve.protocol import FinishReason, SamplingParams

pytestmark = pytest.mark.slow


def _model(name: str):
    path = MODELS / name
    codec = TextCodec(path)
    return load_model_adapter(path, model_type_of(path), codec.eos_token_ids), codec


def _request(rid: str, prompt: list[int], max_tokens: int) -> tuple:
    return token_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _pieces_engine(prompts: dict[str, list[int]], lengths: dict[str, int]):
    """A maker of engines whose longer prompts prefill in pieces into the pool (qwen2_vl, chunks of
    16), and each prompt's greedy tokens alone (on the calling thread: the worker's)."""
    model, codec = _model("qwen2_vl")

    def engine() -> EngineCore:
        return EngineCore(model, codec, max_num_seqs=6, prefill_chunk=16, prefill_budget=64, prefix_cache_tokens=0)

    alone = {}
    for rid, prompt in prompts.items():
        core = engine()
        request, events = _request(rid, prompt, lengths[rid])
        core.add(request)
        run_until_idle(core)
        alone[rid] = event_tokens(events)
    return engine, alone


def test_rows_prefilling_into_the_pool_go_on_after_a_failed_decode_step():
    prompts = {rid: [(7 * i + ord(rid)) % 400 + 20 for i in range(100)] for rid in "BCD"}

    def work():
        engine, alone = _pieces_engine(prompts, dict.fromkeys(prompts, 5))
        core = engine()
        a, a_events = _request("A", list(range(20, 30)), 40)
        core.add(a)
        core.step()
        core.step()
        events = {}
        for rid in "BC":
            request, events[rid] = _request(rid, prompts[rid], 5)
            core.add(request)
        core.step()
        in_pool = [s.req.request_id for s in core.sched.prefilling if s.prefill_pool is not None]
        batch = core.runner.batch
        forward = type(batch).forward_pieces

        def fails_once(self, *args, **kwargs):
            type(batch).forward_pieces = forward
            raise RuntimeError("a decode step failed")

        type(batch).forward_pieces = fails_once
        try:
            core.step()
        finally:
            type(batch).forward_pieces = forward
        request, events["D"] = _request("D", prompts["D"], 5)
        core.add(request)
        run_until_idle(core)
        return alone, in_pool, a_events[-1].finish_reason, events

    alone, in_pool, a_reason, events = on_own_thread(work)
    assert sorted(in_pool) == ["B", "C"]  # prefilling into the pool when the step failed
    assert a_reason == FinishReason.ERROR  # the decoding row ends with its step
    for rid, got in events.items():
        assert got[-1].finish_reason == FinishReason.LENGTH, (rid, got[-1].error)
        assert event_tokens(got) == alone[rid], rid


def test_a_prompt_embedded_longer_than_its_ids_is_counted_before_it_takes_blocks():
    """A merge that makes the prompt 4x its ids (as LLaVA-NeXT's image features can): the pool
    never grows past the budget and what the budget counts is what the rows hold. A row the
    budget cannot hold for its next piece goes on in a cache of its own and settles at its join
    (each prompt fits the budget alone: none fails)."""

    def work():
        import mlx.core as mx

        model, codec = _model("llava")
        embed = model.embed_prompts

        def longer(prepared, staged=None):
            states = embed(prepared) if staged is None else embed(prepared, staged)
            out = []
            for st in states:
                embeds = mx.concatenate([st.embeds] * 4, axis=1)
                ids = mx.full((1, embeds.shape[1]), int(st.input_ids[0, -1].item()), dtype=mx.int32)
                out.append(replace(st, embeds=embeds, input_ids=ids))
            return out

        model.embed_prompts = longer
        budget = KVBudget(40, 4)
        core = EngineCore(
            model, codec, max_num_seqs=6, prefill_chunk=16, prefill_budget=64, prefix_cache_tokens=0, kv_budget=budget
        )
        reasons = []
        for i in range(4):
            request, events = _request(f"r{i}", [(11 * j + i) % 400 + 20 for j in range(30)], 4)
            core.add(request)
            reasons.append(events)
        seen = []
        for _ in range(300):
            if not core.has_work():
                break
            core.step()
            held = sum(s.kv_units for s in core.sched.running + core.sched.prefilling)
            seen += [(p.num_blocks, p.most, held, budget.used) for p in core.runner.batches.pools.values()]
        ends = [(events[-1].finish_reason, events[-1].error) for events in reasons]
        return seen, ends, budget.used

    seen, ends, used = on_own_thread(work)
    assert seen and all(blocks <= most and held == used for blocks, most, held, used in seen)
    assert ends == [(FinishReason.LENGTH, None)] * 4 and used == 0


def test_a_continued_chat_past_the_pieces_bound_still_shares_its_cached_prefix(monkeypatch):
    """A prompt that starts from a cached prefix and whose pieces pass PIECES_MAX_PAIRS goes on
    alone in its own cache (the fused single path): the prefix's blocks stay shared at its join
    rather than copied a second time, and it answers as an engine without reuse does."""
    from vlmserve.engine.runner import model_runner, pool_prefill

    monkeypatch.setattr(model_runner, "PIECES_MAX_PAIRS", 100)
    went_alone = []
    back = pool_prefill.back_to_own_cache
    monkeypatch.setattr(pool_prefill, "back_to_own_cache", lambda seq: (went_alone.append(seq.prefilled), back(seq))[1])
    first = [(7 * i) % 400 + 20 for i in range(60)]

    def work():
        model, codec = _model("qwen2_vl")

        def engine(prefix_tokens: int) -> EngineCore:
            budget = KVBudget(400, 4)
            return EngineCore(
                model, codec, max_num_seqs=6, prefill_chunk=16, prefill_budget=64,
                prefix_cache_tokens=prefix_tokens, kv_budget=budget,
            )  # fmt: skip

        core = engine(4096)
        request, answer = _request("A", first, 3)
        core.add(request)
        run_until_idle(core)
        second = first + event_tokens(answer) + [33, 44, 55, 66, 77]
        cached = [list(kv.blocks) for kv in core.runner.prefix_cache._entries.values()]
        request, events = _request("B", second, 3)
        core.add(request)
        joined = []
        while core.has_work():
            core.step()
            joined = joined or [list(s.blocks) for s in core.sched.running]
        reference = engine(0)
        request, alone = _request("B", second, 3)
        reference.add(request)
        run_until_idle(reference)
        return cached, joined, went_alone, events, alone

    cached, joined, went_alone, events, alone = on_own_thread(work)
    assert went_alone and events[-1].cached_tokens > 0  # it reused the prefix, then went alone
    assert set(joined[0]) & {b for blocks in cached for b in blocks}  # and still shares its blocks
    assert event_tokens(events) == event_tokens(alone)


def test_a_row_prefilled_into_the_pool_that_its_join_cannot_pay_for_steps_aside_and_resumes(monkeypatch):
    """The budget refuses B's join once (as when rows that arrived before it took the last blocks
    meanwhile), while B's prompt is in blocks of the pool: its KV goes from those blocks to host
    memory, the blocks go back, and it joins later with the tokens it gives alone."""
    from vlmserve.engine.runner.model_runner import ModelRunner

    prompts = {"A": list(range(20, 30)), "B": [(7 * i + 3) % 400 + 20 for i in range(100)]}
    lengths = {"A": 30, "B": 8}
    refused = []

    def work():
        engine, alone = _pieces_engine(prompts, lengths)
        monkeypatch.setattr(ModelRunner, "_take_positions", refuse_join_once("B", refused))
        core = engine()
        events = {}
        request, events["A"] = _request("A", prompts["A"], lengths["A"])
        core.add(request)
        core.step()
        core.step()
        request, events["B"] = _request("B", prompts["B"], lengths["B"])
        core.add(request)
        run_until_idle(core)
        budget = core.sched.kv_budget
        return alone, events, budget.used, budget.preemptions, core.runner.batches.pools

    alone, events, used, preemptions, pools = on_own_thread(work)
    assert len(refused) == 1 and refused[0] > 0  # refused once, with its prompt in pool blocks
    assert preemptions == 1 and used == 0
    assert pools and all(pool.used == 0 for pool in pools.values())  # no block left held
    for rid, got in events.items():
        assert got[-1].finish_reason == FinishReason.LENGTH, (rid, got[-1].error)
        assert event_tokens(got) == alone[rid], rid
