"""Qwen3-VL and Qwen3.5 (whose vision tower is Qwen3-VL's): the generic adapter, the tower's
call indexed on the host (tower.py), and Qwen3.5's attention given a view of the paged pool it
reads as mlx_vlm's batch cache."""

from __future__ import annotations

from typing import Any

from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache
from vlmserve.models.generic import GenericModel
from vlmserve.models.qwen3_vl import tower


class _BatchCacheLike(PagedLayerCache):
    """Qwen3.5's attention cuts the mask it is given to `_idx + 1` positions where its cache has
    `_idx` and `left_padding` (mlx_vlm's batch cache), and else to the longest row's length, read
    back from the device: the paged view's mask spans the width of its gather, which this keeps."""

    left_padding = None

    @property
    def _idx(self) -> int:
        return self.width - 1


class Qwen3VLModel(GenericModel):
    def install_fast_paths(self) -> None:
        tower.install(self.model.vision_tower)
        super().install_fast_paths()

    def decode(self, tokens, batch_cache: list[Any], positions):
        for cache in batch_cache:
            if type(cache) is PagedLayerCache:
                cache.__class__ = _BatchCacheLike
        return super().decode(tokens, batch_cache, positions)
