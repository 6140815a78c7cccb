"""How the run-batched vision attention (models/qwen2_vl/vision_attention.py) cuts segments
into runs (the features against mlx_vlm's: e2e/models/qwen2_vl/test_vision_attention.py)."""

from __future__ import annotations

import pytest

from vlmserve.models.qwen2_vl.vision_attention import segment_runs


def test_segment_runs_groups_consecutive_equal_lengths():
    assert segment_runs([0, 4, 8, 12, 15, 18, 20]) == [(0, 3, 4), (12, 2, 3), (18, 1, 2)]
    assert segment_runs([0, 5, 5, 9]) == [(0, 1, 5), (5, 1, 4)]  # empty segments are skipped
    assert segment_runs([0]) == []


def test_power_of_two_pieces_cut_runs_largest_first():
    from vlmserve.models.qwen2_vl.vision_attention import power_of_two_pieces

    assert power_of_two_pieces([(0, 13, 4), (52, 2, 3), (58, 1, 5)]) == [
        (0, 8, 4),
        (32, 4, 4),
        (48, 1, 4),
        (52, 2, 3),
        (58, 1, 5),
    ]
    assert power_of_two_pieces([(0, 32, 10)]) == [(0, 32, 10)]


def test_segment_attention_runs_one_sdpa_per_piece_and_notes_each_plan(monkeypatch):
    """cuDNN's route: one SDPA per power-of-two piece of each run of equal segments, each piece's
    shape noted as planned; the features equal one SDPA per segment."""
    import numpy as np

    from support.helpers import on_own_thread
    from vlmserve.engine.ops.attention_plans import AttentionPlans
    from vlmserve.models.qwen2_vl import vision_attention

    monkeypatch.setattr(vision_attention.cuda_kernels, "cudnn_enabled", lambda: True)
    bounds = [0, 6, 12, 18, 23]  # three segments of 6 (pieces of 2 and 1), one of 5

    def run():
        import mlx.core as mx

        q, k, v = (mx.random.normal((23, 2, 16), key=mx.random.key(i)) for i in range(3))
        plans = AttentionPlans()
        layout = vision_attention._Layout(mx.array(bounds, dtype=mx.int32))
        got = vision_attention.segment_attention(q, k, v, layout, 0.25, plans)
        keys = [(mx.float32, 2, 16, n, length) for n, length in ((2, 6), (1, 6), (1, 5))]
        ref = [
            mx.fast.scaled_dot_product_attention(*(t[lo:hi].transpose(1, 0, 2)[None] for t in (q, k, v)), scale=0.25)
            for lo, hi in zip(bounds, bounds[1:])
        ]
        ref = mx.concatenate([r[0].transpose(1, 0, 2) for r in ref])
        return np.array(got), np.array(ref), [plans.planned(key) for key in keys]

    got, ref, planned = on_own_thread(run)
    assert planned == [True, True, True]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_cudnns_route_is_taken_past_the_work_per_call_or_for_one_large_call(monkeypatch):
    """The thresholds: total work against CUDNN_WORK per cuDNN call, or one call's against
    CUDNN_LARGEST (here with every plan built)."""
    from support.helpers import on_own_thread
    from vlmserve.engine.ops.attention_plans import AttentionPlans
    from vlmserve.models.qwen2_vl import vision_attention

    monkeypatch.setattr(vision_attention.cuda_kernels, "cudnn_enabled", lambda: True)
    monkeypatch.setattr(vision_attention, "CUDNN_WORK", 60)

    def decide(bounds, largest):
        import mlx.core as mx

        monkeypatch.setattr(vision_attention, "CUDNN_LARGEST", largest)
        layout = vision_attention._Layout(mx.array(bounds, dtype=mx.int32))
        plans = AttentionPlans()
        with plans.building():  # every shape planned
            return vision_attention._takes_cudnn(layout, "bf16", 2, 16, 0.25, plans)

    # one segment of 10 and one of 2: work 104 < 2 calls x 60; the larger call's 100
    assert on_own_thread(lambda: [decide([0, 10, 12], 100), decide([0, 10, 12], 101)]) == [True, False]
    assert on_own_thread(lambda: decide([0, 10, 20], 1000))  # one call of two: 200 >= 60


def test_the_towers_builds_are_queued_at_load_as_the_launches_take_them(monkeypatch):
    """The q/k rotation's build is queued for the tower's heads, head dim and activation dtype,
    and is the very build (inputs' dtypes and ranks, template) a launch takes; the one-launch
    attention's build is queued where that kernel serves the tower, with its heads and scale."""
    from types import SimpleNamespace

    from support.helpers import on_own_thread
    from vlmserve.engine.ops import cuda_kernels, prefill_attention
    from vlmserve.models.qwen2_vl import vision_attention

    noted, rotations, launched = [], [], []
    monkeypatch.setattr(prefill_attention, "note_build", lambda *args, **kw: noted.append((args, kw)))
    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)

    def build(inputs, template):
        return tuple((x.dtype, x.ndim) for x in inputs), tuple(template)

    def kernel(*args, **kwargs):
        def launch(*, inputs, output_dtypes, template, **rest):
            import mlx.core as mx

            launched.append((build(inputs, template), tuple(output_dtypes)))
            return [mx.zeros(rest["output_shapes"][0], dtype=output_dtypes[0])]

        return launch

    monkeypatch.setattr(cuda_kernels, "kernel", kernel)
    monkeypatch.setattr(
        cuda_kernels,
        "note_build",
        lambda k, *, inputs, output_dtypes, template: rotations.append((build(inputs, template), tuple(output_dtypes))),
    )

    def load(serves: bool):
        import mlx.core as mx
        from mlx_vlm.models.qwen2_vl.vision import Attention

        monkeypatch.setattr(prefill_attention, "serves", lambda *args: serves)
        tower = SimpleNamespace(blocks=[SimpleNamespace(attn=Attention(64, num_heads=4)) for _ in range(2)])
        vision_attention.install(tower)
        vision_attention.note_builds(tower, mx.bfloat16)
        qkv = mx.zeros((10, 3, 4, 16), dtype=mx.bfloat16)
        vision_attention.rotate_qk(qkv, mx.zeros((10, 8), dtype=mx.float32), rotary=None)
        return mx.bfloat16

    on_own_thread(lambda: load(False))
    assert noted == [] and len(rotations) == 1 and rotations == launched
    bf16 = on_own_thread(lambda: load(True))
    heads = (bf16, 4, 4, 16, 16**-0.5, prefill_attention.UNMASKED_LAYOUT)
    assert noted == [(heads, {"segments": True})]
    assert rotations[0][0][1] == (("T", bf16), ("D", 16), ("HD", 64))


def test_the_prompt_attention_build_is_queued_at_load_in_the_prompts_dtype(monkeypatch):
    """The language model's prompt attention build is queued for its heads and scale, in the dtype
    the prompt's embeddings come out as: the weight's, or a quantized embedding's scales'."""
    from types import SimpleNamespace

    from vlmserve.engine.ops import prefill_attention
    from vlmserve.models.qwen2_vl.adapter import QwenVLModel

    noted = []
    monkeypatch.setattr(prefill_attention, "serves", lambda dtype, *heads: dtype != "uint8")
    monkeypatch.setattr(prefill_attention, "note_build", lambda *args: noted.append(args))
    attn = SimpleNamespace(n_heads=12, n_kv_heads=2, head_dim=128, scale=128**-0.5)

    def model(embed):
        layers = [SimpleNamespace(self_attn=attn)]
        return SimpleNamespace(language_model=SimpleNamespace(model=SimpleNamespace(layers=layers, embed_tokens=embed)))

    QwenVLModel._note_prompt_attention_build(model(SimpleNamespace(weight=SimpleNamespace(dtype="bfloat16"))))
    quantized = SimpleNamespace(weight=SimpleNamespace(dtype="uint32"), scales=SimpleNamespace(dtype="float16"))
    QwenVLModel._note_prompt_attention_build(model(quantized))
    mxfp4 = SimpleNamespace(weight=SimpleNamespace(dtype="uint32"), scales=SimpleNamespace(dtype="uint8"))
    QwenVLModel._note_prompt_attention_build(model(mxfp4))  # not served: nothing queued
    assert noted == [("bfloat16", 12, 2, 128, 128**-0.5), ("float16", 12, 2, 128, 128**-0.5)]


def test_a_call_takes_one_segments_launch_unless_its_large_attention_has_cudnn_plans(monkeypatch):
    """Where vlmserve's kernel serves the tower's heads: a call with little attention work runs
    all its segments in one launch; a large one runs cuDNN's route once every piece's plan is
    built, and the one launch (queuing the missing plans) until then. Features agree either way
    (stand-ins compute the same attention here)."""
    from types import SimpleNamespace

    import numpy as np

    from support.helpers import on_own_thread
    from vlmserve.engine.ops import prefill_attention
    from vlmserve.engine.ops.attention_plans import AttentionPlans, plan_free_loss_s
    from vlmserve.models.qwen2_vl import vision_attention

    launches = []

    def segments_stand_in(qk, qkv, bounds, longest, scale):
        import mlx.core as mx

        launches.append(("segments", bounds.tolist(), longest))
        outs = []
        for lo, hi in zip(bounds.tolist(), bounds.tolist()[1:]):
            q, k, v = (t[lo:hi, i].transpose(1, 0, 2)[None] for t, i in ((qk, 0), (qk, 1), (qkv, 2)))
            outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(1, 0, 2))
        return mx.concatenate(outs).reshape(qk.shape[0], -1)

    monkeypatch.setattr(vision_attention.cuda_kernels, "cudnn_enabled", lambda: True)
    monkeypatch.setattr(prefill_attention, "serves", lambda *args: True)
    monkeypatch.setattr(prefill_attention, "attend_segments", segments_stand_in)
    monkeypatch.setattr(vision_attention, "CUDNN_WORK", 40)  # patches^2 per cuDNN call
    monkeypatch.setattr(vision_attention, "CUDNN_LARGEST", 1000)

    def run():
        import mlx.core as mx
        from mlx_vlm.models.qwen2_vl.vision import Attention

        attn = Attention(64, num_heads=4)
        plans = AttentionPlans()
        tower = SimpleNamespace(blocks=[SimpleNamespace(attn=attn)])
        vision_attention.install(tower, plans)
        x = mx.random.normal((23, 64), key=mx.random.key(0))
        freqs = mx.random.uniform(0, 3, (23, 8), key=mx.random.key(1))
        small, large = mx.array([0, 6, 11], dtype=mx.int32), mx.array([0, 6, 12, 18, 23], dtype=mx.int32)
        got = {"small": attn(x[:11], small, freqs[:11])}
        calls, queued_small = len(launches), plans.pending()
        got["unplanned"] = attn(x, large, freqs)
        queued = plans.pending()
        lost = sum(w.lost_s for w in plans._wanted.values())
        while plans.pending():
            plans.build_next()
        got["planned"] = attn(x, large, freqs)
        vision_attention.uninstall(tower)  # mlx_vlm's own attention, one SDPA per segment
        ref = {"small": attn(x[:11], small, freqs[:11]), "large": attn(x, large, freqs)}
        got = {k: np.array(v) for k, v in got.items()}
        return got, {k: np.array(v) for k, v in ref.items()}, calls, queued_small, queued, lost

    got, ref, calls, queued_small, queued, lost = on_own_thread(run)
    # 61 < 2 calls x 40: the one launch, nothing queued
    assert calls == 1 and launches[0] == ("segments", [0, 6, 11], 6) and queued_small == 0
    # 133 >= 3 calls (2 x 6, 1 x 6, 1 x 5) x 40: cuDNN, once their plans are built
    assert launches[1] == ("segments", [0, 6, 12, 18, 23], 6) and queued == 3
    # what the whole call lost without cuDNN
    assert lost == pytest.approx(sum(plan_free_loss_s(n, length, 4, 16) for n, length in ((2, 6), (1, 6), (1, 5))))
    assert len(launches) == 2  # built: cuDNN's route
    np.testing.assert_allclose(got["small"], ref["small"], rtol=1e-5, atol=1e-6)
    for key in ("unplanned", "planned"):
        np.testing.assert_allclose(got[key], ref["large"], rtol=1e-5, atol=1e-6)


def test_warm_up_notes_a_plan_for_every_image_count_it_builds(monkeypatch):
    """build_plans (warm-up) builds cuDNN's plan of each count of one image size, laid out as the
    tower lays out its calls, and notes it: calls of that size then find it planned."""
    from types import SimpleNamespace

    from support.helpers import on_own_thread
    from vlmserve.engine.ops.attention_plans import AttentionPlans
    from vlmserve.models.qwen2_vl import vision_attention

    def run():
        import mlx.core as mx
        from mlx_vlm.models.qwen2_vl.vision import Attention

        tower = SimpleNamespace(blocks=[SimpleNamespace(attn=Attention(64, num_heads=4))])
        vision_attention.install(tower)
        plans = AttentionPlans()
        built = vision_attention.build_plans(tower, mx.bfloat16, 36, [1, 2, 4], plans)
        keys = [(mx.bfloat16, 4, 16, n, length) for n, length in ((1, 36), (2, 36), (4, 36), (8, 36), (1, 25))]
        return built, [plans.planned(key) for key in keys]

    built, planned = on_own_thread(run)
    assert built == [1, 2, 4] and planned == [True, True, True, False, False]
