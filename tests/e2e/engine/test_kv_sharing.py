"""The KV pool's shared blocks under a randomized load (engine/runner/block_pool.py, prefix_cache.py):
chats that resend their history, a shared opening, cancellations, preemption under a small budget,
and idle compactions. After every step each block's reference count equals its holders (rows,
cached prefixes, prefix hits not yet joined), the free list is exactly the blocks nobody holds,
no row will write where another holder reads, and the pool stays within the budget; every
finished answer equals the one from an engine without reuse."""

from __future__ import annotations

import collections
import random

import pytest

from support.helpers import MODELS, on_own_thread, token_request
from vlmserve.engine.core import EngineCore
from vlmserve.engine.runner.tokenizer import TextCodec
from vlmserve.engine.sched.kv_budget import KVBudget
from vlmserve.models.registry import load_model_adapter, model_type_of
from vlmserve.protocol import SamplingParams

pytestmark = pytest.mark.slow

PATH = MODELS / "qwen2_vl"


def _engines():
    """A maker of engines over one loaded model: (prefix-cache tokens, budget blocks, block size)."""
    codec = TextCodec(PATH)
    model = load_model_adapter(PATH, model_type_of(PATH), codec.eos_token_ids)

    def make(prefix_tokens: int, blocks: int, block_size: int) -> EngineCore:
        budget = KVBudget(blocks, block_size)
        return EngineCore(
            model, codec, max_num_seqs=6, prefill_chunk=16, prefix_cache_tokens=prefix_tokens, kv_budget=budget
        )

    return make


def _holders(core) -> tuple[dict, dict]:
    """(id(pool), block) -> [(kind, index in its list, length it reads or writes from, owner)]."""
    runner = core.runner
    held = collections.defaultdict(list)
    pools = {id(p): p for p in runner.batches.pools.values()}
    if runner.batch is not None and runner.batch.paged:
        for group in runner.batch.groups.values():
            for row in group.rows:
                if row is not None:
                    for i, b in enumerate(row.blocks):
                        held[(id(group.pool), b)].append(("row", i, row.cache_len, id(row)))
    for seq in core.sched.prefilling:
        shared = seq.prefix_hit.shared if seq.prefix_hit is not None else None
        if shared is not None:
            for i, b in enumerate(shared.blocks):
                held[(id(shared.pool), b)].append(("hit", i, shared.length, id(seq)))
        if seq.prefill_pool is not None:  # prefilling in pieces into its blocks: it writes from `prefilled` on
            for i, b in enumerate(seq.prefill_blocks):
                held[(id(seq.prefill_pool), b)].append(("row", i, seq.prefilled, id(seq)))
    for cache in runner.prefix_caches():
        for key, kv in cache._entries.items():
            assert len(kv.blocks) == -(-kv.length // kv.pool.block_size)
            for i, b in enumerate(kv.blocks):
                held[(id(kv.pool), b)].append(("entry", i, kv.length, key))
    return held, pools


def _check(core) -> None:
    held, pools = _holders(core)
    size = core.runner.budget.block_size
    for pid, pool in pools.items():
        expect = [0] * pool.num_blocks
        for (p, b), holders in held.items():
            if p == pid:
                expect[b] += len(holders)
        assert pool.refs == expect
        assert sorted(pool.free) == [b for b in range(1, pool.num_blocks) if not expect[b]]
        assert pool.num_blocks <= pool.most
    for holders in held.values():  # a row writes from its length on; nobody else may read there
        for kind, i, length, who in holders:
            if kind == "row":
                writes_from = max(0, length - i * size)
                for other in holders:
                    if other[3] != who:
                        assert writes_from >= min(size, other[2] - other[1] * size)
    assert sum(s.kv_units for s in core.sched.running + core.sched.prefilling) == core.sched.kv_budget.used
    cached = {(p, b) for (p, b), holders in held.items() if any(h[0] == "entry" for h in holders)}
    assert sum(c.blocks_held() for c in core.runner.prefix_caches()) == len(cached)


def _load(core, seed: int, requests: int = 36):
    """Requests over several steps: chats that resend their history with the answer, prompts
    sharing an opening, unrelated ones; some cancelled; idle compactions between bursts."""
    rng = random.Random(seed)
    opening = [rng.randrange(20, 500) for _ in range(rng.choice([30, 40, 48]))]
    chats = [list(opening) for _ in range(4)]
    sent, finished = {}, {}
    made = 0
    while made < requests or core.has_work():
        if made < requests and rng.random() < 0.4:
            chat = rng.randrange(len(chats) + 1)
            tail = [rng.randrange(20, 500) for _ in range(rng.randrange(2, 20))]
            prompt = (
                chats[chat] + tail
                if chat < len(chats)
                else [rng.randrange(20, 500) for _ in range(rng.randrange(3, 60))]
            )
            sampling = SamplingParams(max_tokens=rng.randrange(1, 25), temperature=0.0, ignore_eos=rng.random() < 0.5)
            request, events = token_request(f"r{made}", prompt, sampling)
            sent[request.request_id] = (prompt, sampling, events, request, chat)
            core.add(request)
            made += 1
        for _, _, events, request, _ in sent.values():
            if not request.cancelled and not (events and events[-1].finish_reason) and rng.random() < 0.03:
                request.cancelled = True
        core.step()
        _check(core)
        for rid, (prompt, _, events, _, chat) in sent.items():
            if rid not in finished and events and events[-1].finish_reason is not None:
                tokens = [t for e in events for t in e.token_ids]
                finished[rid] = tokens
                if chat < len(chats) and events[-1].finish_reason.name in ("STOP", "LENGTH") and rng.random() < 0.7:
                    chats[chat] = list(prompt) + tokens  # the next turn resends this answer
        if not core.has_work() and rng.random() < 0.1:
            core.runner.release_memory()
            _check(core)
    return sent, finished


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shared_blocks_stay_counted_and_answers_equal_those_without_reuse(seed):
    def work():
        make = _engines()
        core = make(4000, 48, 4)  # 48 blocks of 4 positions: cached prefixes give way, rows are preempted
        sent, finished = _load(core, seed)
        core.runner.release_memory()
        _check(core)
        reference = make(0, 100_000, 16)
        mismatched, answered = [], 0
        for rid, tokens in finished.items():
            prompt, sampling, events, request, _ = sent[rid]
            if request.cancelled or events[-1].finish_reason.name not in ("STOP", "LENGTH"):
                continue
            answered += 1
            alone, expected = token_request("alone", prompt, sampling)
            reference.add(alone)
            while reference.has_work():
                reference.step()
            if [t for e in expected for t in e.token_ids] != tokens:
                mismatched.append(rid)
        cached = sum(events[-1].cached_tokens for _, _, events, _, _ in sent.values() if events)
        return mismatched, answered, cached

    mismatched, answered, cached = on_own_thread(work)
    assert answered >= 12 and cached > 0  # the load reused cached prefixes
    assert mismatched == []
