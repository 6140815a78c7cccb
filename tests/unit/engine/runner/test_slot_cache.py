"""The slot KV cache (engine/runner/slot_cache.py): capacity fitted to the rows it holds."""

from __future__ import annotations

from support.helpers import on_own_thread


def test_fit_capacity_keeps_rows_and_only_halves_or_more():
    import mlx.core as mx

    from vlmserve.engine.runner.slot_cache import SlotBatch

    def work():
        kv = SlotBatch(2, (2, 4, 4), mx.float32, slots=2, capacity=1000)
        assert kv.capacity == 1024
        kv.keys = [mx.random.normal(k.shape, key=mx.random.key(i)) for i, k in enumerate(kv.keys)]
        before = [mx.array(k[:, :, :300]) for k in kv.keys]
        kv.fit_capacity(300)  # 512 is half of 1024: shrink
        assert kv.capacity == 512 and kv.keys[0].shape == (2, 2, 512, 4) and kv.values[1].shape == (2, 2, 512, 4)
        assert all(mx.array_equal(k[:, :, :300], b).item() for k, b in zip(kv.keys, before))
        kv.fit_capacity(300)  # needs 512 of 512: no change
        assert kv.capacity == 512
        kv.fit_capacity(257)  # needs 512 again (256 < 257): no change
        assert kv.capacity == 512
        kv.fit_capacity(200)
        assert kv.capacity == 256

    on_own_thread(work)


def test_the_buffers_widen_to_the_kv_dtype_prefill_produced_and_never_narrow():
    import mlx.core as mx

    from vlmserve.engine.runner.slot_cache import SlotBatch

    def work():
        kv = SlotBatch(2, (2, 4, 4), mx.bfloat16, slots=1, capacity=1)
        kv.write(0, [(mx.full((1, 2, 3, 4), 1.5, mx.bfloat16), mx.full((1, 2, 3, 4), -2.0, mx.bfloat16))] * 2, 3)
        kv.widen(mx.float32)  # float32 KV of an image prompt joins: kept as float32, not rounded
        assert kv.dtype == mx.float32 and all(a.dtype == mx.float32 for a in kv.arrays())
        assert kv.keys[0][0, :, :3].tolist() == [[[1.5] * 4] * 3] * 2
        kv.widen(mx.bfloat16)
        assert kv.dtype == mx.float32

    on_own_thread(work)
