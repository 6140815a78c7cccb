"""Pieces of several long prompts share one forward (models/ragged_cache.py): with a small prefill
chunk, concurrent image and text requests are prefilled piece by piece together, and each gives
the tokens it gives alone (where its prompt is prefilled one forward at a time)."""

from __future__ import annotations

import asyncio

import httpx
import mlx.core as mx
import pytest

from support.families import checkpoint
from support.helpers import chat_body, data_uri, images
from support.server import start_server
from vlmserve.engine.ops.paged_prefill_cache import PagedPiecesCache
from vlmserve.models.ragged_cache import RaggedLayerCache

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
LONG = " ".join(f"word{i}" for i in range(60))


def _bodies(model: str) -> list[dict]:
    imgs = images()
    cases = [
        ("Describe the picture in detail. " + LONG[:120], [imgs[1]]),
        ("What is in this image?", [imgs[2]]),
        ("Summarise: " + LONG, []),
        ("Count the words: " + LONG[:200], []),
        ("Compare the two pictures.", [imgs[0], imgs[2]]),
    ]
    return [
        chat_body(model, text, [data_uri(p) for p in paths], max_tokens=MAX_TOKENS, temperature=0)
        for text, paths in cases
    ]


async def _outputs(server, bodies, concurrent: bool) -> list[str]:
    async def post(c, body):
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
        if concurrent:
            return list(await asyncio.gather(*(post(c, b) for b in bodies)))
        return [await post(c, b) for b in bodies]


def _server(family: str, tmp_path_factory, prefix_cache_tokens: int = 0, max_num_seqs: int = 8):
    cache_dir = tmp_path_factory.getbasetemp() / "families"
    cache_dir.mkdir(exist_ok=True)
    server = start_server(
        str(checkpoint(family, "float32", cache_dir)),
        max_num_seqs=max_num_seqs,
        prefill_chunk=32,
        prefix_cache_tokens=prefix_cache_tokens,
    )
    return server.wait_warm()  # its own forwards done: the tests count the model's


def _count_calls(model, pooled: list | None = None) -> list[list[tuple[int, int]]]:
    """The spans (start, end) of each `prefill_pieces` call the model gets from now on (and in
    `pooled`, whether each wrote into the KV pool)."""
    calls: list[list[tuple[int, int]]] = []
    prefill_pieces = model.prefill_pieces

    def spy(states, spans, bucket=1, caches=None):
        calls.append(list(spans))
        if pooled is not None:
            pooled.append(caches is not None and all(isinstance(c, PagedPiecesCache) for c in caches))
        return prefill_pieces(states, spans, bucket, caches=caches)

    model.prefill_pieces = spy
    return calls


# M-RoPE (qwen2_vl, glm4v), deepstack rows (qwen3_vl), plain RoPE offsets (llava, mistral3,
# idefics3, internvl_chat), per-row query scales (ministral3), multi-head latent attention
# (kimi_vl), sliding-window layers on plain caches (gemma3; its windows bind in
# tests/e2e/models/test_sliding_windows.py).
@pytest.mark.parametrize(
    "family",
    [
        "qwen2_vl",
        "glm4v",
        "qwen3_vl",
        "llava",
        "mistral3",
        "ministral3",
        "idefics3",
        "internvl_chat",
        "kimi_vl",
        "gemma3",
    ],
)
def test_pieces_prefilled_together_give_each_prompts_own_tokens(family, tmp_path_factory):
    server = _server(family, tmp_path_factory)
    try:
        model = server.engine.core.model
        pooled: list[bool] = []
        calls = _count_calls(model, pooled)
        bodies = _bodies(server.model_id)
        takes_pieces = model.prefills_pieces
        sched = server.engine.core.sched
        whole = asyncio.run(_outputs(server, bodies, concurrent=False))  # each alone: one forward
        assert calls == []
        sched.lone_takes_budget = False  # alone too, a chunk a step (as behind running streams)
        model._pieces_work = False  # the reference: every piece through the single-prompt path
        reference = asyncio.run(_outputs(server, bodies, concurrent=False))
        model._pieces_work = takes_pieces
        assert calls == []
        alone = asyncio.run(_outputs(server, bodies, concurrent=False))
        assert calls and all(len(c) == 1 for c in calls)  # alone, a prompt's later pieces still take that forward
        sched.lone_takes_budget = True
        together = asyncio.run(_outputs(server, bodies, concurrent=True))
        assert together == alone == reference == whole
        assert calls and max(map(len, calls)) >= 2  # several rows' pieces shared forwards
        assert all(end > start for call in calls for start, end in call)  # rows with nothing left never do
        assert model.prefills_pieces  # and the model still takes such forwards
        # Paged, the rows' pieces go into their blocks of the pool (unless they embed in another dtype).
        if server.engine.core.runner.batches.paged and model.kv_layout()[2] == mx.float32:
            assert all(pooled)
        runner = server.engine.core.runner

        def held():  # once every request is done, only cached prefixes hold blocks
            pools = runner.batches.pools.values()
            return sum(p.used for p in pools), sum(c.blocks_held() for c in runner.prefix_caches())

        used, cached = server.on_worker(held)
        assert used == cached
    finally:
        server.stop()


class _NoRaggedForward:
    """A language model whose forward refuses ragged caches (as one that needs its offset as a
    number), after its first `takes` such forwards."""

    def __init__(self, inner, kv_layout, takes: int = 0):
        self._inner = inner
        self._kv = kv_layout
        self._takes = takes

    def __call__(self, *args, cache=None, **kwargs):
        if cache and isinstance(cache[0], (RaggedLayerCache, PagedPiecesCache)) and self._takes > 0:
            self._takes -= 1
        elif cache and isinstance(cache[0], (RaggedLayerCache, PagedPiecesCache)):
            _, (heads, dim, _), dtype = self._kv
            written = mx.zeros((len(cache[0].lengths), heads, max(cache[0].lengths), dim), dtype=dtype)
            cache[0].update_and_fetch(written, written)  # the first layer writes, then the forward fails
            raise TypeError("offset must be an int")
        return self._inner(*args, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("takes", [0, 2])
def test_a_model_that_cannot_take_pieces_together_prefills_them_one_at_a_time(tmp_path_factory, takes):
    """Refused at once, or after two such forwards, when rows' KV is in the block pool already:
    those rows go on in their own caches."""
    server = _server("qwen2_vl", tmp_path_factory)
    try:
        model = server.engine.core.model
        bodies = _bodies(server.model_id)
        alone = asyncio.run(_outputs(server, bodies, concurrent=False))
        model.fast_prefill = False  # on CUDA the family's own prompt forward would not go through the wrapper
        model.language_model = _NoRaggedForward(model.language_model, model.kv_layout(), takes)
        together = asyncio.run(_outputs(server, bodies, concurrent=True))
        assert together == alone  # what the failed forward wrote was taken back
        assert not model.prefills_pieces
    finally:
        server.stop()


def test_rows_whose_cached_prefix_leaves_nothing_to_prefill_join_without_a_forward(tmp_path_factory):
    """A row whose prompt is cached but its last token joins the batch at once; a model that
    samples the first token in prefill (the Qwen family on CUDA) runs just that position."""
    # Cached prefixes live in the KV pool's free blocks, and its first size follows max_num_seqs:
    # room for all five prompts at once.
    server = _server("qwen2_vl", tmp_path_factory, prefix_cache_tokens=65536, max_num_seqs=32)
    try:
        model = server.engine.core.model
        bodies = _bodies(server.model_id)
        alone = asyncio.run(_outputs(server, bodies, concurrent=False))
        calls = _count_calls(model)
        again = asyncio.run(_outputs(server, bodies, concurrent=True))  # every prompt is cached but its last token
        assert again == alone
        assert model.prefills_pieces
        if model.samples_in_prefill:
            assert calls and all(end - start == 1 for call in calls for start, end in call)
        else:
            assert calls == []
    finally:
        server.stop()


def test_forwards_of_pieces_stay_within_their_attention_bound(tmp_path_factory, monkeypatch):
    from vlmserve.engine.runner import model_runner

    server = _server("qwen2_vl", tmp_path_factory)
    try:
        model = server.engine.core.model
        bodies = _bodies(server.model_id)
        reference = asyncio.run(_outputs(server, bodies, concurrent=True))
        calls = _count_calls(model)
        bound = 2 * 32 * 100  # two pieces of 32 over 100 positions; a piece ending past 200 goes alone
        monkeypatch.setattr(model_runner, "PIECES_MAX_PAIRS", bound)
        bounded = asyncio.run(_outputs(server, bodies, concurrent=True))
        assert bounded == reference
        pairs = [len(c) * max(e - s for s, e in c) * max(e for _, e in c) for c in calls]
        assert calls and max(pairs) <= bound and max(map(len, calls)) >= 2
    finally:
        server.stop()
