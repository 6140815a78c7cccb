"""A generic family's vision tower on CUDA (engine/ops/tower_attention.py): its attention calls
of a shape without a cuDNN plan take the plan-free kernel and are queued; idle time runs the
tower call again under `building()`, which builds their plans, and from then on they go to
MLX's SDPA. Here on any backend, with cuDNN said to be on and a stand-in for the kernel that
computes the same attention, so the embeddings match exactly either way."""

from __future__ import annotations

import numpy as np
from PIL import Image

from support.helpers import MODELS, on_own_thread


def _image_prompt(path):
    from vlmserve.config import ServerConfig
    from vlmserve.inputs.preprocess import Preprocessor
    from vlmserve.models.processor import load_processor
    from vlmserve.models.registry import model_type_of
    from vlmserve.protocol import ChatMessage, ChatRequest, SamplingParams

    pre = Preprocessor(load_processor(path), 4096, ServerConfig(), model_type=model_type_of(path))
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 80, 3), dtype=np.uint8))
    chat = ChatRequest([ChatMessage("user", [("image", None), ("text", "What is it?")])], SamplingParams())
    try:
        return pre.encode(pre.render(chat), [image])
    finally:
        pre.close()


def test_new_tower_shapes_run_plan_free_until_their_plans_are_built(monkeypatch):
    from vlmserve.engine.ops import prefill_attention, tower_attention
    from vlmserve.models.registry import load_model_adapter, model_type_of

    path = MODELS / "llava"
    prepared = _image_prompt(path)

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
        layers = len(model.model.vision_tower.vision_model.encoder.layers)
        first = np.array(model.embed_prompt(prepared).embeds)
        queued, first_calls = model.attention_plans.pending(), len(plan_free)

        def counting(*args, **kwargs):
            through_mlx.append(args[0].shape)
            return real(*args, **kwargs)

        mx.fast.scaled_dot_product_attention = counting  # what a routed call hands on to MLX
        try:
            while model.attention_plans.pending():
                model.build_next_attention_plan()
            built = len(through_mlx)
            second = np.array(model.embed_prompt(prepared).embeds)
            again = len(through_mlx) - built
            restored = mx.fast.scaled_dot_product_attention is counting
        finally:
            mx.fast.scaled_dot_product_attention = real
        return layers, first, second, queued, first_calls, built, again, restored, model.routes_tower_attention

    layers, first, second, queued, first_calls, built, again, restored, routes = on_own_thread(run)
    assert routes
    assert first_calls == layers and queued == 1  # every layer's call plan-free; one shape queued
    assert built == layers  # the queued build ran the tower again, each call through MLX (cuDNN there)
    assert again == layers and len(plan_free) == first_calls  # then the shape went to MLX
    assert restored  # the rebinding is undone after each tower call
    np.testing.assert_array_equal(second, first)


def test_warm_up_builds_the_plans_of_its_images_shapes(monkeypatch):
    """`warm_vision` runs the request's tower call under `building()`: its shapes go to MLX from then on."""
    from vlmserve.engine.ops import prefill_attention, tower_attention
    from vlmserve.models.registry import load_model_adapter, model_type_of

    path = MODELS / "llava"
    prepared = _image_prompt(path)
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
    prepared = _image_prompt(path)
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
