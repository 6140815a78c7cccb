"""Pixtral: the generic adapter with the vision tower run once per image, unmasked (tower.py)."""

from __future__ import annotations

from collections.abc import Hashable

from vlmserve.models.generic import GenericModel
from vlmserve.models.pixtral import tower
from vlmserve.protocol import PreparedRequest


class PixtralModel(GenericModel):
    def install_fast_paths(self) -> None:
        tower.install(self.model.vision_tower)
        super().install_fast_paths()

    def tower_call_key(self, prepared: PreparedRequest) -> Hashable:
        """Each image runs on its own: an attention shape's layout is its own, whatever else the
        call holds (a size met before, in a new mix of sizes, finds its plan)."""
        return "per-image" if tower.installed(self.model.vision_tower) else super().tower_call_key(prepared)
