"""Qwen3-VL and Qwen3.5 (whose vision tower is Qwen3-VL's): the generic adapter, the tower's
call indexed on the host (tower.py)."""

from __future__ import annotations

from vlmserve.models.generic import GenericModel
from vlmserve.models.qwen3_vl import tower


class Qwen3VLModel(GenericModel):
    def install_fast_paths(self) -> None:
        tower.install(self.model.vision_tower)
        super().install_fast_paths()
