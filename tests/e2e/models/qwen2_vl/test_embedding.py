"""Qwen-VL image prompts embedded from host-side indices (models/qwen2_vl/embedding.py) equal
mlx_vlm's own code bit for bit: M-RoPE positions, merged embeddings, Qwen2-VL and Qwen2.5-VL
tower features, and pixels shipped as bfloat16 bits from preprocessing."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import images
from support.server import start_server
from vlmserve.inputs.media import MediaPolicy, decode_image
from vlmserve.inputs.preprocess import Preprocessor
from vlmserve.models.pixels import to_bfloat16_bits
from vlmserve.models.qwen2_vl import embedding as qwen_embedding
from vlmserve.protocol import ChatMessage, ChatRequest, ImageRef, SamplingParams

GRIDS = [(1, 16, 16), (1, 8, 12), (1, 16, 16), (2, 4, 4)]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def grid_server(request):
    server = start_server(request.param)
    yield server
    server.stop()


def _ids(cfg, layout, merge):
    """A prompt from ("text", n) and ("image", (t, h, w)) pieces, images wrapped as the template does."""
    special = {cfg.vision_start_token_id, cfg.image_token_id, cfg.video_token_id}
    text_ids = [i for i in range(100, 200) if i not in special]
    ids: list[int] = []
    for kind, value in layout:
        if kind == "text":
            ids += text_ids[:value]
        else:
            t, h, w = value
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // merge**2) + [text_ids[-1]]
    return np.array(ids, dtype=np.int32)


LAYOUTS = [
    [("text", 5), ("image", (1, 8, 8)), ("text", 7)],
    [("text", 3), ("image", (1, 16, 16)), ("text", 4), ("image", (1, 8, 12)), ("text", 2)],
    [("image", (1, 4, 8)), ("image", (2, 4, 4))],  # image first, adjacent images, two frames, no text after
    [("text", 1), ("image", (1, 12, 4))],
]


def test_mrope_positions_match_get_rope_index(grid_server):
    import mlx.core as mx

    lm = grid_server.engine.core.model.language_model
    cfg = lm.config
    merge = cfg.vision_config.spatial_merge_size

    def both(layout):
        ids = _ids(cfg, layout, merge)
        grid = np.array([v for k, v in layout if k == "image"])
        ours = qwen_embedding.mrope_positions(
            ids,
            grid,
            image_token=cfg.image_token_id,
            video_token=cfg.video_token_id,
            vision_start=cfg.vision_start_token_id,
            merge=merge,
        )
        pos, delta = lm.get_rope_index(mx.array(ids)[None], mx.array(grid), None, mx.ones((1, len(ids)), mx.int32))
        return ours, np.array(pos)[:, 0], int(np.array(delta).reshape(-1)[0])

    for layout in LAYOUTS:
        ours, ref_pos, ref_delta = grid_server.on_worker(both, layout)
        assert ours is not None
        np.testing.assert_array_equal(ours[0], ref_pos)
        assert ours[0].dtype == np.int32 and ours[1] == ref_delta

    text_only = np.arange(100, 120, dtype=np.int32)
    kw = dict(
        image_token=cfg.image_token_id,
        video_token=cfg.video_token_id,
        vision_start=cfg.vision_start_token_id,
        merge=merge,
    )
    assert qwen_embedding.mrope_positions(text_only, np.zeros((0, 3), int), **kw) is None
    with_video = np.concatenate([_ids(cfg, LAYOUTS[0], merge), [cfg.video_token_id]]).astype(np.int32)
    assert qwen_embedding.mrope_positions(with_video, np.array([(1, 8, 8)]), **kw) is None  # mlx_vlm's own path


def test_host_built_towers_equal_mlx_vlm_and_padded_rows_change_no_feature(grid_server):
    """Qwen2-VL's and Qwen2.5-VL's tower calls built on the host equal mlx_vlm's bit for bit;
    rows past the images (zeros in a segment of their own, as CUDA's row buckets add) change no
    image's features; the idle warm-up runs a call of each row bucket."""
    vlm = grid_server.state.engine.core.model
    host_tower = {"qwen2_vl": qwen_embedding.qwen2_vl_tower, "qwen2_5_vl": qwen_embedding.qwen2_5_vl_tower}[
        vlm.info.model_type
    ]

    def compare():
        import mlx.core as mx

        from vlmserve.models.qwen2_vl.adapter import TOWER_ROW_STEP

        tower = vlm.model.vision_tower
        vc = vlm.model.config.vision_config
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        patches = sum(t * h * w for t, h, w in GRIDS)
        pixels = mx.random.normal((patches, dim), key=mx.random.key(1))
        ref = tower(pixels, mx.array(GRIDS), output_hidden_states=False)
        own = host_tower(tower, pixels, np.array(GRIDS))
        padded = host_tower(tower, pixels, np.array(GRIDS), rows=patches + 36)
        vlm._warm_tower_rows(2 * TOWER_ROW_STEP)  # two images of a row step: no error, features made
        return np.array(ref), np.array(own), np.array(padded), patches

    ref, own, padded, patches = grid_server.on_worker(compare)
    assert own.shape == (patches // 4, ref.shape[1])
    np.testing.assert_array_equal(own, ref)
    np.testing.assert_allclose(padded, own, rtol=1e-5, atol=1e-5)


def test_tower_rows_round_up_only_where_the_one_launch_serves_and_cudnn_would_not(qwen_server, monkeypatch):
    from vlmserve.models.qwen2_vl import vision_attention

    vlm = qwen_server.engine.core.model
    grid = np.array(GRIDS)
    off = vlm._tower_rows(grid)  # on CPU the one launch does not serve: calls keep their rows
    monkeypatch.setattr(vlm, "pads_tower_rows", True)
    padded = vlm._tower_rows(grid)
    monkeypatch.setattr(vision_attention, "may_take_cudnn", lambda seqlens: True)
    large = vlm._tower_rows(grid)
    assert (off, padded, large) == (None, 1024, None)  # 640 patches


def _prepared(server, preprocessor=None):
    pre = preprocessor or server.state.preprocessor
    imgs = [decode_image(p.read_bytes(), MediaPolicy()) for p in images()]
    cases = [
        ("What is in this image?", imgs[1:2]),
        ("Describe the picture.", []),
        ("Compare the two images.", [imgs[0], imgs[2]]),
        ("Name one colour.", imgs[3:4]),
    ]
    out = []
    for text, ims in cases:
        parts = [("image", ImageRef("x", "x")) for _ in ims] + [("text", text)]
        out.append(pre.encode(pre.render(ChatRequest([ChatMessage("user", parts)], SamplingParams())), ims))
    return out


def test_embed_prompts_equal_mlx_vlm_get_input_embeddings(grid_server):
    """The adapter's batched path against mlx_vlm's get_input_embeddings fed the same tower features."""
    vlm = grid_server.engine.core.model
    prepared = _prepared(grid_server)

    def compare():
        import mlx.core as mx

        calls = []
        original = vlm.model.get_input_embeddings
        vlm.model.get_input_embeddings = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            ours = vlm.embed_prompts(prepared)
        finally:
            del vlm.model.get_input_embeddings
        assert len(calls) == 1  # the text-only prompt; the image prompts took the host-index path
        refs = []
        for p in prepared:
            if not p.has_pixels:
                refs.append(vlm.embed_prompt(p))
                continue
            inputs = vlm.stage_inputs(p)
            features = vlm.model.vision_tower(inputs["pixel_values"].astype(mx.float32), inputs["image_grid_thw"])
            refs.append(vlm.embed_prompt(p, features, inputs))
        return [(np.array(s.embeds), np.array(s.position_ids), s.position_offset) for s in ours], [
            (np.array(s.embeds), np.array(s.position_ids), s.position_offset) for s in refs
        ]

    ours, refs = grid_server.on_worker(compare)
    for (e, pos, delta), (re, rpos, rdelta) in zip(ours, refs):
        np.testing.assert_allclose(e, re, rtol=1e-5, atol=1e-6)  # tower batching: one call vs one per request
        np.testing.assert_array_equal(pos, rpos)
        assert delta == rdelta


def test_merge_equals_mlx_vlm_merge(qwen_server):
    vlm = qwen_server.engine.core.model
    cfg = vlm.model.config
    ids = _ids(cfg, LAYOUTS[1], 2)
    n = int((ids == cfg.image_token_id).sum())

    def compare():
        import mlx.core as mx

        embeds = mx.random.normal((1, len(ids), 16), key=mx.random.key(2))
        features = mx.random.normal((n, 16), key=mx.random.key(3))
        ours = qwen_embedding.merge_image_features(embeds, features, ids, cfg.image_token_id)
        ref = type(vlm.model).merge_input_ids_with_image_features(
            cfg.image_token_id, cfg.video_token_id, features, embeds, mx.array(ids)[None]
        )
        return np.array(ours), np.array(ref)

    def one_feature_short():
        import mlx.core as mx

        qwen_embedding.merge_image_features(mx.zeros((1, len(ids), 4)), mx.zeros((n - 1, 4)), ids, cfg.image_token_id)

    ours, ref = qwen_server.on_worker(compare)
    np.testing.assert_array_equal(ours, ref)
    with pytest.raises(ValueError, match="image features"):
        qwen_server.on_worker(one_feature_short)


def test_bfloat16_bits_round_as_mlx_casts(qwen_server):
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.normal(0, 2, 20000).astype(np.float32),
            # exact ties between two bfloat16 values (round to even both ways), subnormals, extremes
            (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
            np.array([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, np.inf, -np.inf, 65504.0], np.float32),
        ]
    )

    def mlx_bits():
        import mlx.core as mx

        return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))

    np.testing.assert_array_equal(to_bfloat16_bits(x), qwen_server.on_worker(mlx_bits))
    assert to_bfloat16_bits(np.array([np.nan], np.float32))[0] & 0x7FC0 == 0x7FC0  # still a NaN


def test_pixels_shipped_as_bfloat16_embed_as_cast_on_device(qwen_server):
    """With a bf16 tower (ModelInfo.pixel_dtype), pixels cast during preprocessing give the
    same embeddings as float32 pixels cast by the model."""
    from mlx.utils import tree_map

    st = qwen_server.state
    vlm = qwen_server.engine.core.model
    as_bf16 = Preprocessor(
        st.preprocessor.processor, st.context_length, st.config, pixel_dtype="bfloat16", model_type="qwen2_vl"
    )
    shipped, plain = _prepared(qwen_server, as_bf16), _prepared(qwen_server)
    assert shipped[0].bfloat16_inputs == {"pixel_table"} and shipped[0].model_inputs["pixel_table"].dtype == np.uint16
    assert not plain[0].bfloat16_inputs and qwen_server.engine.info.pixel_dtype is None  # the fixture is float32

    def compare():
        import mlx.core as mx

        tower = vlm.model.vision_tower
        saved = tree_map(lambda a: a, tower.parameters())
        tower.set_dtype(mx.bfloat16)
        try:
            a = [np.array(s.embeds.astype(mx.float32)) for s in vlm.embed_prompts(shipped)]
            b = [np.array(s.embeds.astype(mx.float32)) for s in vlm.embed_prompts(plain)]
        finally:
            tower.update(saved)
            # Features of the bf16 tower were cached under these images: later tests on this
            # server must not be served them.
            qwen_server.engine.core.forget_prefixes()
        return a, b

    a, b = qwen_server.on_worker(compare)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_pixels_copied_in_pieces_are_the_same_array(grid_server):
    # The worker copies large inputs in pieces (the event loop waits out one piece, not one image).
    from vlmserve.models.generic import _COPY_PIECE_BYTES, host_to_mx

    def compare(array):
        import mlx.core as mx

        ours, whole = host_to_mx(array), mx.array(array)
        return ours.shape == whole.shape and ours.dtype == whole.dtype and mx.array_equal(ours, whole).item()

    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.uint16, np.float64, np.int64):
        for shape in [(1024, 1176), (1, 3, 448, 448), (7,)]:
            host = (rng.random(shape) * 1000).astype(dtype)
            assert host.nbytes > _COPY_PIECE_BYTES or shape == (7,)
            for array in (host, np.swapaxes(host, 0, -1)):  # also a non-contiguous one
                assert grid_server.on_worker(compare, array), (dtype, shape)


@pytest.mark.parametrize("dtype", ["bfloat16", None])
def test_packed_frames_expand_on_the_worker_to_the_processors_pixels(qwen_server, dtype):
    """Preprocessing ships uint8 frames and a value table; the worker's patches (engine/packed_pixels.py)
    are the processor's own pixel values, cast as the model casts them, for every image of a request."""
    from vlmserve.models.qwen2_vl.image_processor import cast_pixels

    st = qwen_server.state
    pre = Preprocessor(
        st.preprocessor.processor, st.context_length, st.config, pixel_dtype=dtype, model_type="qwen2_vl"
    )
    prepared = [p for p in _prepared(qwen_server, pre) if p.num_images]
    assert {p.num_images for p in prepared} == {1, 2} and all("pixel_bytes" in p.model_inputs for p in prepared)
    inner = pre.processor.image_processor.inner  # mlx_vlm's processor, unwrapped
    imgs = [decode_image(p.read_bytes(), MediaPolicy()) for p in images()]
    want = [
        cast_pixels(np.asarray(inner(images=ims)["pixel_values"]), dtype)
        for ims in (imgs[1:2], [imgs[0], imgs[2]], imgs[3:4])
    ]

    def expand():
        import mlx.core as mx

        out = [qwen_server.engine.core.model.stage_inputs(p)["pixel_values"] for p in prepared]
        return [np.array(x.view(mx.uint16)) if x.dtype == mx.bfloat16 else np.array(x) for x in out]

    for got, expected in zip(qwen_server.on_worker(expand), want):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    pre.close()
