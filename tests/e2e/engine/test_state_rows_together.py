"""Prompts of a model whose layers keep state beside their KV (LFM2-VL: convolution windows;
Qwen3.5: those and a recurrent state) prefill together and give the tokens each gives alone
with exact shapes: new prompts of a chunk or less in one left-padded forward padded to the
prefill bucket (their state layers mask the padding), longer ones piece by piece in right-padded
forwards of several rows, their KV into the paged pool (each row's state kept at its own
piece's end, in its own caches)."""

from __future__ import annotations

import pytest

from support.families import adapter_loader
from support.helpers import (
    event_tokens,
    on_own_thread,
    refuse_join_once,
    run_until_idle,
    stand_in_gated_delta_kernel,
    token_request,
)
from vlmserve.protocol import SamplingParams

pytestmark = pytest.mark.slow

SHORT = {"A": 9, "B": 23, "C": 14, "D": 30}  # prompts of one chunk or less, of four lengths
LONG = {"E": 70, "F": 45, "G": 101, "H": 20}  # most longer than a chunk: pieces


def _family(family: str, tmp_path_factory):
    """The family's float32 test checkpoint: a loader of (model, codec) for the worker thread."""
    return adapter_loader(family, "float32", tmp_path_factory)


def _prompts(model, lengths: dict[str, int]) -> dict[str, list[int]]:
    vocab = model.info.vocab_size
    return {rid: [(7 * i + 31 * ord(rid)) % (vocab // 2) + 20 for i in range(n)] for rid, n in lengths.items()}


def _run(core, prompts: dict[str, list[int]], rids) -> dict[str, list[int]]:
    """Each request's greedy tokens (6), all added at once and run to the end."""
    events = {}
    for rid in rids:
        request, events[rid] = token_request(
            rid, prompts[rid], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
        core.add(request)
    run_until_idle(core)
    return {rid: event_tokens(e) for rid, e in events.items()}


def _engines(model, codec, **options):
    """A maker of engines over this model with these options, by prefill bucket."""
    from vlmserve.engine.core import EngineCore

    return lambda bucket: EngineCore(model, codec, prefill_bucket=bucket, **options)


def _only_cached_prefixes_hold_blocks(core) -> bool:
    """Every request done: the pools' blocks are held by cached prefixes only."""
    runner = core.runner
    used = sum(pool.used for pool in runner.batches.pools.values())
    return used == sum(cache.blocks_held() for cache in runner.prefix_caches())


def _alone(engine, prompts: dict[str, list[int]], rids) -> dict[str, list[int]]:
    """Each request's greedy tokens on an engine of its own at exact shapes (`engine(0)`: no
    bucket), as mlx_vlm.generate runs it."""
    alone = {}
    for rid in rids:
        alone.update(_run(engine(0), prompts, [rid]))
    return alone


@pytest.mark.parametrize("lengths", [SHORT, LONG], ids=["short", "long"])
@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_state_rows_prefilled_together_give_their_tokens_alone(family, lengths, tmp_path_factory):

    load = _family(family, tmp_path_factory)

    def work():
        model, codec = load()
        prompts = _prompts(model, lengths)
        pieces_rows = []  # the rows of each pieces forward that ran
        prefill_pieces = model.prefill_pieces

        def counted(states, spans, *args, **kwargs):
            logits = prefill_pieces(states, spans, *args, **kwargs)
            # (rows, into the KV pool); a forward that raised (then row by row) is not counted
            pieces_rows.append((len(states), kwargs.get("caches") is not None))
            return logits

        model.prefill_pieces = counted

        engine = _engines(model, codec, max_num_seqs=6, prefill_chunk=32, prefill_budget=128)

        alone = _alone(engine, prompts, lengths)
        pieces_rows.clear()
        core = engine(16)
        text_model = type(model.language_model.model)
        forward, forwards = text_model.__call__, []  # the (rows, length) of each text-model forward

        def recorded(self, inputs, *args, **kwargs):
            forwards.append(tuple(inputs.shape))
            return forward(self, inputs, *args, **kwargs)

        text_model.__call__ = recorded
        try:
            together = _run(core, prompts, list(lengths))
        finally:
            text_model.__call__ = forward
        if lengths is SHORT:  # one forward of the four, at the bucketed length (none row by row)
            assert [f for f in forwards if f[1] > 1] == [(4, 32)], forwards
        has_state = core.runner.batches.state_layout is not None
        most = max((n for n, into_pool in pieces_rows if into_pool), default=0)
        return alone, together, core.runner.stats.batched_prefills, most, model.prefills_pieces, has_state

    alone, together, batched, most_pieces_rows, prefills_pieces, has_state = on_own_thread(work)
    assert has_state and batched >= 1
    if lengths is LONG:  # pieces of several rows shared a forward into the pool, served to the end
        assert most_pieces_rows >= 2 and prefills_pieces
    assert together == alone and all(len(tokens) == 6 for tokens in alone.values())


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_a_state_row_prefilled_into_the_pool_that_its_join_cannot_pay_for_steps_aside(
    family, tmp_path_factory, monkeypatch
):
    """The budget refuses B's join once while B's prompt is in pool blocks: its KV goes from those
    blocks to host memory and its state from its own caches, and it joins later with the tokens
    it gives alone."""
    from vlmserve.engine.core import EngineCore
    from vlmserve.engine.runner.model_runner import ModelRunner
    from vlmserve.protocol import FinishReason

    load = _family(family, tmp_path_factory)
    refused = []

    def work():
        model, codec = load()
        vocab = model.info.vocab_size
        prompts = {"A": list(range(20, 30)), "B": [(7 * i + 3) % (vocab // 2) + 20 for i in range(100)]}
        lengths = {"A": 30, "B": 8}

        def engine() -> EngineCore:
            return EngineCore(model, codec, max_num_seqs=6, prefill_chunk=16, prefill_budget=64, prefix_cache_tokens=0)

        def request(rid):
            return token_request(
                rid, prompts[rid], SamplingParams(max_tokens=lengths[rid], temperature=0.0, ignore_eos=True)
            )

        alone = {}
        for rid in prompts:
            core = engine()
            req, events = request(rid)
            core.add(req)
            run_until_idle(core)
            alone[rid] = event_tokens(events)
        monkeypatch.setattr(ModelRunner, "_take_positions", refuse_join_once("B", refused))
        core = engine()
        events = {}
        req, events["A"] = request("A")
        core.add(req)
        core.step()
        core.step()
        req, events["B"] = request("B")
        core.add(req)
        run_until_idle(core)
        budget = core.sched.kv_budget
        pools = core.runner.batches.pools
        return alone, events, budget.used, budget.preemptions, all(pool.used == 0 for pool in pools.values())

    alone, events, used, preemptions, pools_empty = on_own_thread(work)
    assert len(refused) == 1 and refused[0] > 0  # refused once, with its prompt in pool blocks
    assert preemptions == 1 and used == 0 and pools_empty
    for rid, got in events.items():
        assert got[-1].finish_reason == FinishReason.LENGTH, (rid, got[-1].error)
        assert event_tokens(got) == alone[rid], rid


@pytest.mark.parametrize("fault", ["last_piece_alone", "pool_forward_fails"])
@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_state_rows_leaving_the_pool_midway_give_their_tokens_alone(family, fault, tmp_path_factory, monkeypatch):
    """Rows prefilling into the pool go on in their own caches midway: each one's last piece goes
    alone (its KV back from the pool, its full blocks a prefix its join takes), or a pieces
    forward into the pool fails once (every row then goes on one at a time). Their state never
    left their own caches: each gives the tokens it gives alone, and no block stays held."""
    from vlmserve.engine.ops.paged_prefill_cache import PagedPiecesCache
    from vlmserve.engine.runner.decode_batch import PagedDecodeBatch
    from vlmserve.engine.runner.model_runner import ModelRunner

    load = _family(family, tmp_path_factory)
    seen = []  # joins that took a row's own blocks back (last_piece_alone), or the failed forward

    def work():
        model, codec = load()
        prompts = _prompts(model, LONG)

        engine = _engines(model, codec, max_num_seqs=6, prefill_chunk=16, prefill_budget=64)

        alone = _alone(engine, prompts, LONG)
        if fault == "last_piece_alone":
            forwards, join = ModelRunner._pieces_forwards, PagedDecodeBatch.join

            def last_pieces_alone(rows):
                out = []
                for group, together in forwards(rows):
                    last = [
                        r
                        for r in group
                        if r[0].prefill_pool is not None and r[0].next_piece(r[1])[1] == r[0].prefill_end
                    ]
                    out += [([r], False) for r in last]
                    rest = [r for r in group if r not in last]
                    out += [(rest, together)] if rest else []
                return out

            def noting_join(self, owners, rows_cache, rows=None):
                seen.extend(o.prefix_hit.shared.length for o in owners if o.prefix_hit and o.prefix_hit.shared)
                return join(self, owners, rows_cache, rows)

            monkeypatch.setattr(ModelRunner, "_pieces_forwards", staticmethod(last_pieces_alone))
            monkeypatch.setattr(PagedDecodeBatch, "join", noting_join)
        else:
            text_model = type(model.language_model.model)
            forward = text_model.__call__

            def fails_once(self, inputs, *args, **kwargs):
                cache = kwargs.get("cache", next((a for a in args if isinstance(a, list)), None))
                if not seen and cache and any(isinstance(c, PagedPiecesCache) for c in cache):
                    seen.append(inputs.shape)
                    raise RuntimeError("a pieces forward failed")
                return forward(self, inputs, *args, **kwargs)

            monkeypatch.setattr(text_model, "__call__", fails_once)
        core = engine(16)
        together = _run(core, prompts, list(LONG))
        return alone, together, core.sched.kv_budget.used, _only_cached_prefixes_hold_blocks(core)

    alone, together, used, only_cached_held = on_own_thread(work)
    assert seen and used == 0 and only_cached_held
    assert together == alone


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_plan_free_convolutions_give_the_tokens_of_mlx_s(family, tmp_path_factory):
    """With the depthwise convolutions swapped for CUDA's plan-free ones (engine/ops/depthwise_conv),
    prompts prefilled together (in one forward and in pieces into the pool) and decoded by the
    compiled step give the tokens each gives alone through MLX's convolution."""
    import mlx.nn as nn

    from vlmserve.engine.ops import depthwise_conv

    load = _family(family, tmp_path_factory)
    lengths = {**SHORT, **LONG}

    def work():
        model, codec = load()
        prompts = _prompts(model, lengths)
        for _, module in model.language_model.named_modules():  # on CUDA the load swapped them
            if type(module) is depthwise_conv.PlanFreeDepthwiseConv1d:
                module.__class__ = nn.Conv1d

        options = {"max_num_seqs": 8, "prefill_chunk": 32, "prefill_budget": 128}
        alone = _alone(_engines(model, codec, **options), prompts, lengths)
        swapped = depthwise_conv.install(model.language_model, force=True)
        compiled = _engines(model, codec, compile_decode=True, **options)  # the swapped modules traced
        return alone, _run(compiled(16), prompts, list(lengths)), swapped

    alone, together, swapped = on_own_thread(work)
    assert swapped > 0
    assert together == alone and all(len(tokens) == 6 for tokens in alone.values())


def test_routed_gated_delta_rule_gives_the_tokens_of_mlx_s(tmp_path_factory, monkeypatch):
    """With the gated delta rule's calls routed as on CUDA (engine/ops/gated_delta_scan; the
    kernel's launch stood in for by mlx_vlm's per-token ops, as the fixture's head dims are
    below the kernel's), prompts prefilled together, in pieces and alone from their cached
    prefixes, and the compiled decode steps after them, give the tokens each gives alone
    through mlx_vlm's own paths."""
    from vlmserve.engine.ops import gated_delta_scan

    launched = stand_in_gated_delta_kernel(monkeypatch)  # only routed calls launch: after install
    load = _family("qwen3_5", tmp_path_factory)
    lengths = {**SHORT, **LONG}

    def work():
        model, codec = load()
        prompts = _prompts(model, lengths)
        options = {"max_num_seqs": 8, "prefill_chunk": 32, "prefill_budget": 128}
        alone = _alone(_engines(model, codec, **options), prompts, lengths)
        try:
            routed = gated_delta_scan.install(model.language_model, force=True)
            core = _engines(model, codec, compile_decode=True, **options)(16)
            together = _run(core, prompts, list(lengths))
            events = {}
            for rid in ("G", "B"):  # again: from their cached prefixes
                request, events[rid] = token_request(
                    rid, prompts[rid], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                )
                core.add(request)
            run_until_idle(core)
        finally:
            gated_delta_scan.uninstall()  # the routing is process-wide
        again = {rid: (event_tokens(e), max(x.cached_tokens for x in e)) for rid, e in events.items()}
        return alone, together, again, routed

    alone, together, again, routed = on_own_thread(work)
    assert routed == 2 and {n > 1 for _, n in launched} == {True, False}  # prompts and decode steps
    assert together == alone and all(len(tokens) == 6 for tokens in alone.values())
    for rid, (tokens, cached) in again.items():
        assert tokens == alone[rid] and 0 < cached < lengths[rid]
