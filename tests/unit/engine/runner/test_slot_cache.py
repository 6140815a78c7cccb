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
