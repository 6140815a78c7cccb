"""Qwen3-VL's vision tower call indexed on the host (models/qwen3_vl/tower.py) equals mlx_vlm's
own call bit for bit, features and deepstack features, on several images and a video's frames;
Qwen3.5's tower is Qwen3-VL's."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import session_checkpoint
from support.server import start_server

pytestmark = pytest.mark.slow

GRIDS = [(1, 16, 16), (1, 8, 12), (2, 4, 4), (1, 6, 10)]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_the_host_indexed_tower_call_equals_mlx_vlms(family, tmp_path_factory):
    server = start_server(str(session_checkpoint(family, "float32", tmp_path_factory)), warmup_image_sizes=())
    try:
        tower = server.state.engine.core.model.model.vision_tower

        def compare():
            import mlx.core as mx

            from vlmserve.models.qwen3_vl import tower as host_tower

            original = next(c for c in type(tower).__mro__ if c.__name__ == "VisionModel").__call__
            vc = server.state.engine.core.model.model.config.vision_config
            dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
            pixels = mx.random.normal((sum(t * h * w for t, h, w in GRIDS), dim), key=mx.random.key(3))
            grid = mx.array(GRIDS)
            ours, ours_deep = tower(pixels, grid)
            ref, ref_deep = original(tower, pixels, grid)
            return (
                type(tower).__name__,
                host_tower.install(tower),
                np.array(ours),
                np.array(ref),
                [np.array(d) for d in ours_deep],
                [np.array(d) for d in ref_deep],
            )

        name, installed, ours, ref, ours_deep, ref_deep = server.on_worker(compare)
    finally:
        server.stop()
    assert name.startswith("HostIndexed") and installed  # the server's tower takes the call
    assert ours.shape[0] == sum(t * h * w for t, h, w in GRIDS) // 4
    np.testing.assert_array_equal(ours, ref)
    assert len(ours_deep) == len(ref_deep)
    for a, b in zip(ours_deep, ref_deep):
        np.testing.assert_array_equal(a, b)


def test_only_towers_running_qwen3_vls_own_code_take_the_call():
    """A subclass that overrides what the call mirrors (mlx_vlm's Qwen3-VL-MoE tower is a copy of
    its own) keeps its own call."""
    from mlx_vlm.models.qwen3_vl.vision import VisionModel

    from vlmserve.models.qwen3_vl import tower as host_tower

    class Overrides(VisionModel):
        def rot_pos_emb(self, grid_thw):
            return super().rot_pos_emb(grid_thw)

    class Same(VisionModel):
        pass

    plain = Same.__new__(Same)  # no weights: only the class matters
    other = Overrides.__new__(Overrides)
    assert host_tower.install(plain) and type(plain).__name__ == "HostIndexedSame"
    assert not host_tower.install(other) and type(other) is Overrides
    assert not host_tower.install(object.__new__(type("Unrelated", (), {})))
