"""A prompt that starts with a cached one, of a model whose layers keep state beside their KV
(LFM2-VL: convolution windows; Qwen3.5: those and a recurrent state), resumes that prompt's KV
and state and gives the tokens it gives with nothing cached; a prompt that shares only part of
a cached one reuses nothing (no state is known there). Both ways a hit resumes: its pieces
going into the pool, and its own caches filled from the pool."""

from __future__ import annotations

import pytest

from support.families import adapter_loader
from support.helpers import event_tokens, on_own_thread, run_until_idle, token_request
from vlmserve.protocol import SamplingParams

pytestmark = pytest.mark.slow


def _run(core, rid: str, prompt: list[int], **sampling) -> tuple[list[int], int]:
    """A request's greedy tokens (6) and how many of its prompt tokens came from the cache."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **sampling)
    request, events = token_request(rid, prompt, params)
    core.add(request)
    run_until_idle(core)
    return event_tokens(events), events[-1].cached_tokens


def _engines(model, codec, **options):
    """A maker of engines over this model, by prefix cache size (0: nothing cached)."""
    from vlmserve.engine.core import EngineCore

    return lambda cached: EngineCore(model, codec, prefill_bucket=16, prefix_cache_tokens=cached, **options)


@pytest.mark.parametrize("route", ["pool", "own_caches"])
@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_a_prompt_continuing_a_cached_one_resumes_its_state(family, route, tmp_path_factory, monkeypatch):
    load = adapter_loader(family, "float32", tmp_path_factory)

    def work():
        model, codec = load()
        if route == "own_caches":  # no pieces forward: a hit fills the prompt's own caches
            monkeypatch.setattr(type(model), "prefills_pieces", property(lambda self: False))
        vocab = model.info.vocab_size
        first = [(7 * i + 3) % (vocab // 2) + 20 for i in range(40)]
        prompts = {  # the next token right after the cached state, and a longer continuation
            "continues_by_two": first + [(5 * i + 1) % (vocab // 2) + 20 for i in range(2)],
            "continues": first + [(13 * i + 4) % (vocab // 2) + 20 for i in range(25)],
            "shares_part": first[:30] + [(11 * i + 2) % (vocab // 2) + 20 for i in range(20)],
        }

        engine = _engines(model, codec, max_num_seqs=4, prefill_chunk=16, prefill_budget=64)
        alone = {rid: _run(engine(0), rid, p)[0] for rid, p in prompts.items()}
        core = engine(65536)
        _run(core, "first", first)
        after = {rid: _run(core, rid, p) for rid, p in prompts.items()}
        core._memory_read = 0.0  # the gauges' next read is now
        core._read_memory()
        held = sum(c.state_bytes for c in core.runner.prefix_caches())
        return alone, after, len(first), (core._memory["prefix_states"], held)

    alone, after, n_first, (gauge, held) = on_own_thread(work)
    assert gauge == held > 0  # the memory gauge shows the cached prefixes' states
    # the first prompt's KV and state (its last token rode a decode step)
    assert after["continues"][1] == after["continues_by_two"][1] == n_first - 1
    assert after["shares_part"][1] == 0
    for rid, (tokens, _) in after.items():
        assert tokens == alone[rid], rid


@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_prompts_cached_from_a_shared_forward_beside_a_decoding_row_resume_their_own_state(family, tmp_path_factory):
    """Prompts prefilled together (one forward) join while another row decodes, so each one's
    state comes from its own decode slot; continuations of each resume that row's state."""
    load = adapter_loader(family, "float32", tmp_path_factory)

    def work():
        model, codec = load()
        vocab = model.info.vocab_size

        def ids(seed: int, n: int) -> list[int]:
            return [(seed * i + 3 * seed + 1) % (vocab // 2) + 20 for i in range(n)]

        firsts = {f"first{k}": ids(7 + k, 12 + 5 * k) for k in range(3)}
        nexts = {f"next{k}": firsts[f"first{k}"] + ids(19 + k, 3) for k in range(3)}

        engine = _engines(model, codec, max_num_seqs=6, prefill_chunk=32, prefill_budget=128)
        alone = {rid: _run(engine(0), rid, p)[0] for rid, p in nexts.items()}
        core = engine(65536)
        busy, _ = token_request("busy", ids(5, 9), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        core.add(busy)
        core.step()
        core.step()  # "busy" decodes in slot 0
        for rid, prompt in firsts.items():
            request, _ = token_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            core.add(request)
        run_until_idle(core)
        batched = core.runner.stats.batched_prefills
        return alone, {rid: _run(core, rid, p) for rid, p in nexts.items()}, firsts, batched

    alone, after, firsts, batched = on_own_thread(work)
    assert batched >= 1  # the firsts shared a forward
    for k in range(3):
        tokens, cached = after[f"next{k}"]
        assert cached == len(firsts[f"first{k}"]) - 1
        assert tokens == alone[f"next{k}"], k


@pytest.mark.parametrize("steps", ["overlapped", "resolved_first"])
@pytest.mark.parametrize("family", ["lfm2_vl", "qwen3_5"])
def test_a_next_turn_sending_the_answer_back_resumes_past_it(family, steps, tmp_path_factory):
    """A finished row's prompt and answer are cached with the state after them: a prompt that
    sends that answer back and goes on resumes past the answer, with the tokens it gives with
    nothing cached. Overlapped, the step launched before the last token was read fed that
    token too; a row whose sampling needs the previous token (a penalty) reads each step
    before the next, so its last token was never fed."""
    load = adapter_loader(family, "float32", tmp_path_factory)
    sampling = {"presence_penalty": 0.5} if steps == "resolved_first" else {}

    def work():
        model, codec = load()
        vocab = model.info.vocab_size
        first = [(7 * i + 3) % (vocab // 2) + 20 for i in range(30)]
        engine = _engines(model, codec, max_num_seqs=4, prefill_chunk=16, prefill_budget=64)
        core = engine(65536)
        answer, _ = _run(core, "first", first, **sampling)
        turn = first + answer + [(5 * i + 2) % (vocab // 2) + 20 for i in range(2)]
        alone, _ = _run(engine(0), "turn", turn)
        return _run(core, "turn", turn), alone, len(first), len(answer)

    (tokens, cached), alone, n_first, n_answer = on_own_thread(work)
    assert cached == n_first + n_answer - (1 if steps == "resolved_first" else 0)
    assert tokens == alone
