"""A generic family's vision tower on CUDA (engine/ops/tower_attention.py): its attention calls
of a shape without a cuDNN plan take the plan-free kernel and are queued; idle time runs the
tower call again under `building()`, which builds their plans, and from then on they go to
MLX's SDPA. Here on any backend, with cuDNN said to be on and a stand-in for the kernel that
computes the same attention, so the embeddings match exactly either way."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import checkpoint, image_prompt
from support.helpers import MODELS, on_own_thread


def _checkpoint(name, tmp_path_factory):
    return checkpoint(name, "float32", tmp_path_factory.mktemp("tower"))


# Idefics3's model drops all-zero images before its tower (its processor's padding): a rebuild on
# zeros would meet no shape of the real call.
# Mistral 3's Pixtral tower runs image by image (models/pixtral/tower.py): two of one size.
CASES = {"llava": ((80, 64),), "idefics3": ((100, 60), (40, 40)), "mistral3": ((80, 64), (48, 96), (64, 64), (80, 64))}


def test_stand_in_pixels_keep_blank_images_blank_and_no_memory_of_the_real_ones():
    from vlmserve.models.generic import _stand_in_pixels

    pixels = np.random.default_rng(0).random((1, 3, 3, 4, 4), dtype=np.float32)
    pixels[0, 1] = 0  # a padding image
    make = _stand_in_pixels(pixels)
    out = make()
    assert out.shape == pixels.shape and out.dtype == pixels.dtype
    assert not out[0, 1].any() and (out[0, 0] == 1).all() and (out[0, 2] == 1).all()
    assert all(not isinstance(c.cell_contents, np.ndarray) or c.cell_contents.size <= 3 for c in make.__closure__)
    flat = _stand_in_pixels(np.zeros((5, 7), np.uint16))()  # patches, not images: ones
    assert (flat == 1).all() and flat.dtype == np.uint16


@pytest.mark.parametrize("name", sorted(CASES))
def test_new_tower_shapes_run_plan_free_until_their_plans_are_built(name, monkeypatch, tmp_path_factory):
    from vlmserve.engine.ops import prefill_attention, tower_attention
    from vlmserve.models.registry import load_model_adapter, model_type_of

    path = _checkpoint(name, tmp_path_factory)
    prepared = image_prompt(path, CASES[name])

    plan_free, through_mlx = [], []
    monkeypatch.setattr(tower_attention, "available", lambda: True)
    monkeypatch.setattr(prefill_attention, "serves", lambda *args: True)

    def run():
        import mlx.core as mx

        real = mx.fast.scaled_dot_product_attention

        def stand_in(q, k, v, scale):  # the kernel's result, laid out as it returns it: (B, L, Hq * D)
            plan_free.append(q.shape)
            out = real(q, k, v, scale=scale)
            return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)

        monkeypatch.setattr(prefill_attention, "attend_unmasked", stand_in)
        model = load_model_adapter(path, model_type_of(path))
        first = np.array(model.embed_prompt(prepared).embeds)
        queued, first_calls = model.attention_plans.pending(), list(plan_free)

        def counting(*args, **kwargs):
            through_mlx.append(args[0].shape)
            return real(*args, **kwargs)

        mx.fast.scaled_dot_product_attention = counting  # what a routed call hands on to MLX
        try:
            while model.attention_plans.pending():
                model.build_next_attention_plan()
            built = list(through_mlx)
            second = np.array(model.embed_prompt(prepared).embeds)
            again = through_mlx[len(built) :]
            restored = mx.fast.scaled_dot_product_attention is counting
        finally:
            mx.fast.scaled_dot_product_attention = real
        return first, second, queued, first_calls, built, again, restored, model.routes_tower_attention

    first, second, queued, first_calls, built, again, restored, routes = on_own_thread(run)
    assert routes and first_calls  # the tower's calls ran plan-free
    assert queued == len(set(first_calls))  # a shape each
    assert built == first_calls  # the rebuild met the very shapes, each through MLX (cuDNN there)
    assert again == first_calls and plan_free == first_calls  # then they went to MLX
    assert restored  # the rebinding is undone after each tower call
    np.testing.assert_array_equal(second, first)


def test_warm_up_builds_the_plans_of_its_images_shapes(monkeypatch):
    """`warm_vision` runs the request's tower call under `building()`: its shapes go to MLX from then on."""
    from vlmserve.engine.ops import prefill_attention, tower_attention
    from vlmserve.models.registry import load_model_adapter, model_type_of

    path = MODELS / "llava"
    prepared = image_prompt(path)
    monkeypatch.setattr(tower_attention, "available", lambda: True)
    monkeypatch.setattr(prefill_attention, "serves", lambda *args: True)
    plan_free = []
    monkeypatch.setattr(prefill_attention, "attend_unmasked", lambda *args: plan_free.append(1) / 0)

    def run():
        import mlx.core as mx

        model = load_model_adapter(path, model_type_of(path))
        runs = model.warm_vision(prepared, 4)
        mx.eval(model.embed_prompt(prepared).embeds)
        return runs, model.attention_plans.pending()

    assert on_own_thread(run) == (1, 0)
    assert not plan_free  # the request's shapes had their plans from warm-up


def test_a_family_that_routes_its_tower_itself_is_left_alone(monkeypatch):
    """Qwen-VL's towers plan their own attention (models/qwen2_vl/vision_attention.py)."""
    from vlmserve.engine.ops import cuda_kernels, tower_attention
    from vlmserve.models.registry import load_model_adapter, model_type_of

    monkeypatch.setattr(cuda_kernels, "cudnn_enabled", lambda: True)  # where Qwen-VL plans its own
    monkeypatch.setattr(tower_attention, "available", lambda: True)
    path = MODELS / "qwen2_vl"
    model = on_own_thread(lambda: load_model_adapter(path, model_type_of(path)))
    assert not model.routes_tower_attention and model.attention_plans is not None


def test_a_tower_call_that_fails_queues_nothing(monkeypatch):
    """A shape is queued only once its tower call returned: a request that fails there (a bad
    input, the device's memory) must not leave a rebuild that fails and keeps the shape off cuDNN."""
    from vlmserve.engine.ops import prefill_attention, tower_attention
    from vlmserve.models.registry import load_model_adapter, model_type_of

    path = MODELS / "llava"
    prepared = image_prompt(path)
    monkeypatch.setattr(tower_attention, "available", lambda: True)
    monkeypatch.setattr(prefill_attention, "serves", lambda *args: True)

    def run():
        import mlx.core as mx

        real = mx.fast.scaled_dot_product_attention

        def stand_in(q, k, v, scale):
            out = real(q, k, v, scale=scale)
            return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)

        monkeypatch.setattr(prefill_attention, "attend_unmasked", stand_in)
        model = load_model_adapter(path, model_type_of(path))
        projector = model.model.multi_modal_projector

        class Broken:  # the merge after the tower raises
            def __call__(self, *args, **kwargs):
                raise RuntimeError("no room")

        model.model.multi_modal_projector = Broken()
        try:
            model.embed_prompt(prepared)
        except RuntimeError:
            pass
        failed_pending = model.attention_plans.pending()
        model.model.multi_modal_projector = projector
        mx.eval(model.embed_prompt(prepared).embeds)
        return failed_pending, model.attention_plans.pending(), real is mx.fast.scaled_dot_product_attention

    assert on_own_thread(run) == (0, 1, True)


def test_a_tower_calls_signature_holds_what_lays_out_its_attention():
    """Shapes and dtypes of its inputs and its image grids' values; not inputs as long as the
    prompt (token types: a new key for every prompt length), nor other inputs' values (an
    image's original size)."""
    from vlmserve.models.generic import _call_signature
    from vlmserve.protocol import PreparedRequest

    def prepared(length, size, grid):
        inputs = {
            "pixel_values": np.zeros((2, 3, 8, 8), np.float32),
            "token_type_ids": np.zeros((1, length), np.int64),
            "image_sizes": np.array([size]),
            "image_grid_thw": np.array([grid]),
        }
        return PreparedRequest(prompt_ids=np.zeros(length, np.int32), model_inputs=inputs, num_images=1)

    base = _call_signature(prepared(20, (480, 640), (1, 4, 4)))
    assert _call_signature(prepared(31, (480, 640), (1, 4, 4))) == base
    assert _call_signature(prepared(20, (600, 800), (1, 4, 4))) == base
    assert _call_signature(prepared(20, (480, 640), (1, 4, 6))) != base
