"""Qwen3-VL and Qwen3.5 (whose vision tower is Qwen3-VL's): the generic adapter, the tower's
call indexed on the host (tower.py), and Qwen3.5's attention given views of the KV it reads as
mlx_vlm's batch caches."""

from __future__ import annotations

from typing import Any

from vlmserve.engine.ops.paged_layer_cache import PagedLayerCache
from vlmserve.engine.ops.paged_prefill_cache import PagedPiecesCache
from vlmserve.models.generic import GenericModel
from vlmserve.models.qwen3_vl import tower
from vlmserve.models.ragged_cache import RaggedLayerCache


class _MaskKeptWhole:
    """Qwen3.5's attention cuts the mask it is given to `_idx` + its query length positions where
    its cache has `_idx` and `left_padding` (mlx_vlm's batch caches), and else to the longest
    row's length, read back from the device. A view's mask spans its width (the pool's gather, or
    the rows' keys side by side): an `_idx` of that width keeps it whole."""

    left_padding = None

    @property
    def _idx(self) -> int:
        return self.width


class _PagedView(_MaskKeptWhole, PagedLayerCache):
    pass


class _RaggedView(_MaskKeptWhole, RaggedLayerCache):
    pass


class _PoolPiecesView(_MaskKeptWhole, PagedPiecesCache):
    @property
    def width(self) -> int:
        return self.layout.width


class Qwen3VLModel(GenericModel):
    def install_fast_paths(self) -> None:
        tower.install(self.model.vision_tower)
        super().install_fast_paths()

    def prefill_batch(self, states, lengths: list[int], bucket: int = 1):
        """Qwen3.5's forward runs a left-padded batch row by row, each at its own length (mlx_vlm
        strips every row's padding first): new prompts take the right-padded pieces forward, one
        forward at the bucketed length, and their caches merge as a left-padded batch's would."""
        if not self.has_state_layers or not self.prefills_pieces:
            return super().prefill_batch(states, lengths, bucket)
        try:
            logits = self.prefill_pieces(states, [(0, n) for n in lengths], bucket)
        except Exception:  # noqa: BLE001 - logged there (pieces then go one at a time): mlx_vlm's way
            return super().prefill_batch(states, lengths, bucket)
        return self.merge_caches([state.cache for state in states]), logits

    def decode(self, tokens, batch_cache: list[Any], positions):
        for cache in batch_cache:
            if type(cache) is PagedLayerCache:
                cache.__class__ = _PagedView
        return super().decode(tokens, batch_cache, positions)

    def prefill_pieces(self, states, spans, bucket: int = 1, caches: list | None = None):
        caches = caches or self._pieces_caches(states, [e - s for s, e in spans])
        for cache in caches:
            if type(cache) is RaggedLayerCache:
                cache.__class__ = _RaggedView
            elif type(cache) is PagedPiecesCache:
                cache.__class__ = _PoolPiecesView
        return super().prefill_pieces(states, spans, bucket, caches)
