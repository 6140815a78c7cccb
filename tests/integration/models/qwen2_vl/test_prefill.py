"""The Qwen prompt forward (models/qwen2_vl/prefill.py) computes what mlx_vlm's language model
computes: into one request's cache after a cached prefix (causal), into several rows' caches at
once (the ragged pieces forward), and into a left-padded batch. With the composed ops (every
backend) bit for bit; with its kernels on CUDA, bit for bit in float32 (the attention kernel
takes bf16 and fp16 only) and to bf16 rounding in bf16."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import MODELS, on_own_thread
from support.qwen_language import composed_forward, language_model

CASES = ("single", "pieces", "batch")


def _forwards(lm, forward, case: str) -> list[np.ndarray]:
    """One prompt forward of `case` by `forward(ids, embeds, positions, caches) -> logits`; returns
    the logits of every real position and every cache's keys and values."""
    import mlx.core as mx
    from mlx_vlm.models import cache as vlm_cache

    from vlmserve.models.ragged_cache import RaggedLayerCache

    dtype = lm.model.norm.weight.dtype
    dim = lm.args.hidden_size
    key = iter(mx.random.split(mx.random.key(3), 16))

    def embeds(rows, length):
        return mx.random.normal((rows, length, dim), key=next(key)).astype(dtype)

    def positions(rows, length, start):  # M-RoPE ids: three different rows, as an image's are
        base = mx.arange(length)[None, None] + mx.array(start).reshape(1, -1, 1)
        return (base + mx.array([0, 3, 5]).reshape(3, 1, 1)).astype(mx.int32)

    def prefix(caches, n):  # the reference path fills a cached prefix, alike in every run
        ids = mx.zeros((1, n), dtype=mx.int32)
        lm(ids, inputs_embeds=embeds(1, n), cache=caches, position_ids=positions(1, n, [0]))

    if case == "single":
        caches = vlm_cache.make_prompt_cache(lm)
        prefix(caches, 7)
        logits = forward(mx.zeros((1, 13), dtype=mx.int32), embeds(1, 13), positions(1, 13, [7]), caches)
        states = [a for c in caches for a in c.state]
        real = [logits]
    elif case == "pieces":
        rows = [vlm_cache.make_prompt_cache(lm) for _ in range(2)]
        prefix(rows[0], 5)
        prefix(rows[1], 300)  # past a buffer step: the cache grows in the forward
        lengths = [9, 4]
        caches = [RaggedLayerCache(list(layer), lengths) for layer in zip(*rows)]
        logits = forward(mx.zeros((2, 12), dtype=mx.int32), embeds(2, 12), positions(2, 12, [5, 300]), caches)
        states = [a for row in rows for c in row for a in c.state]
        real = [logits[i, :n] for i, n in enumerate(lengths)]
    else:
        pads = [0, 3]
        caches = [vlm_cache.BatchKVCache(pads) for _ in lm.model.layers]
        logits = forward(mx.zeros((2, 10), dtype=mx.int32), embeds(2, 10), positions(2, 10, [0, -3]), caches)
        end = caches[0].offset.max().item()
        states = [a[i : i + 1, :, p:end] for c in caches for a in (c.keys, c.values) for i, p in enumerate(pads)]
        real = [logits[i, p:] for i, p in enumerate(pads)]
    mx.eval(real, states)
    return [np.array(a.astype(mx.float32)) for a in real + states]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16+4bit"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_forward_equals_mlx_vlm(name, fused, dtype):
    def work():
        from vlmserve.engine.ops import cuda_kernels, decode_attention, fused_projections, rope_rotation
        from vlmserve.models.qwen2_vl import prefill

        lm = language_model(name, not fused, dtype)
        if fused:
            assert fused_projections.install(lm) == 2 * len(lm.model.layers)
        rope_rotation.install()  # as the server runs mlx_vlm's layers: its prompt attention off cuDNN
        decode_attention.install()

        def reference(ids, embeds, positions, caches):
            return lm(ids, inputs_embeds=embeds, cache=caches, position_ids=positions).logits

        def ours(kernels):
            return lambda ids, embeds, positions, caches: prefill.logits(
                lm, prefill.forward(lm, embeds, positions, caches, kernels), kernels
            )

        try:
            runs = {case: [_forwards(lm, f, case) for f in (reference, ours(False))] for case in CASES}
            if cuda_kernels.enabled():
                for case in CASES:
                    runs[case].append(_forwards(lm, ours(True), case))
        finally:
            rope_rotation.uninstall()
            decode_attention.uninstall()
        return runs

    for case, (reference, composed, *kernels) in on_own_thread(work).items():
        assert len(composed) == len(reference)
        for want, have in zip(reference, composed):
            np.testing.assert_array_equal(have, want, err_msg=case)
        for got in kernels:
            assert len(got) == len(reference)
            for want, have in zip(reference, got):
                if dtype == "float32":
                    np.testing.assert_array_equal(have, want, err_msg=case)
                else:  # the attention kernel's rounding, carried through the layers after it
                    np.testing.assert_allclose(have, want, rtol=0.05, atol=0.05 * np.abs(want).max(), err_msg=case)


def test_prompt_forwards_route_through_it(monkeypatch):
    """QwenVLModel's prompt forwards (a lone piece, pieces together, a batch) hand M-RoPE prompts
    to prefill.forward, and fill the same caches as mlx_vlm's forward. Its kernels are swapped
    for the composed ops so this runs on any backend."""
    from vlmserve.models.qwen2_vl import prefill

    calls = composed_forward(
        monkeypatch, prefill, lambda lm, embeds, *_: tuple(embeds.shape), lambda kwargs: set(kwargs) == {"position_ids"}
    )

    def work():
        import mlx.core as mx

        from vlmserve.models.qwen2_vl.adapter import QwenVLModel
        from vlmserve.protocol import PreparedRequest

        vlm = QwenVLModel(MODELS / "qwen2_vl")
        rng = np.random.default_rng(0)
        prompts = [PreparedRequest(prompt_ids=rng.integers(5, 500, n).astype(np.int32)) for n in (40, 23)]
        out = {}
        for fast in (False, True):
            vlm.fast_prefill = fast
            states = vlm.embed_prompts(prompts)
            for st in states:
                n = st.input_ids.shape[1]
                st.position_ids = mx.broadcast_to(mx.arange(n)[None, None], (3, 1, n))
            vlm.prefill(states[0], 0, 16)
            vlm.prefill(states[1], 0, 10)
            vlm.prefill_pieces(states, [(16, 39), (10, 22)], 8)
            batch, _ = vlm.prefill_batch(states, [30, 20], 8)
            arrays = [a for st in states for c in st.cache for a in c.state] + [a for c in batch for a in c.state]
            mx.eval(arrays)
            out[fast] = [np.array(a) for a in arrays]
        return out

    out = on_own_thread(work)
    assert calls == [(1, 16, 64), (1, 10, 64), (2, 24, 64), (2, 32, 64)]
    for ref, got in zip(out[False], out[True]):
        np.testing.assert_array_equal(got, ref)


def test_cache_rows_give_mlx_vlms_mask():
    """The attention kernel's rule (row b's query i sees keys firsts[b] <= j <= offsets[b] + i, from
    `cache_rows` before the forward writes) selects what mlx_vlm's mask selects for every real
    query: a request's cache after a prefix, ragged pieces, a left-padded group. Any backend."""

    def work():
        import mlx.core as mx
        from mlx_vlm.models import cache as vlm_cache
        from mlx_vlm.models.base import create_attention_mask

        from vlmserve.models.qwen2_vl import prefill
        from vlmserve.models.ragged_cache import RaggedLayerCache

        def filled(n):
            cache = vlm_cache.KVCache()
            cache.update_and_fetch(mx.zeros((1, 2, n, 8)), mx.zeros((1, 2, n, 8)))
            return cache

        cases = {
            "prefix": (filled(300), 1, 20, [20]),
            "ragged": (RaggedLayerCache([filled(5), filled(290)], [9, 4]), 2, 12, [9, 4]),
            "left_padded": (vlm_cache.BatchKVCache([0, 3]), 2, 10, [10, 7]),
        }
        out = {}
        for name, (cache, rows, length, real) in cases.items():
            h = mx.zeros((rows, length, 8))
            mask = create_attention_mask(h, [cache])
            offsets, firsts = prefill.cache_rows(cache, rows)
            keys, _ = cache.update_and_fetch(mx.zeros((rows, 2, length, 8)), mx.zeros((rows, 2, length, 8)))
            width = keys.shape[2]
            j = mx.arange(width)[None, None, :]
            i = mx.arange(length)[None, :, None]
            rule = (j >= firsts[:, None, None]) & (j <= offsets[:, None, None] + i)
            if isinstance(mask, str):  # "causal": the queries are the last `length` positions
                want = j <= (width - length) + i
                want = mx.broadcast_to(want, rule.shape)
            else:
                want = mask[:, 0, :, :width]
            # The real queries of each row: a piece's first `n`, a padded row's last `n`.
            spans = [(0, n) if name != "left_padded" else (length - n, length) for n in real]
            out[name] = [(np.array(rule[b, s:e]), np.array(want[b, s:e])) for b, (s, e) in enumerate(spans)]
        return out

    for name, rows in on_own_thread(work).items():
        for rule, want in rows:
            np.testing.assert_array_equal(rule, want, err_msg=name)
