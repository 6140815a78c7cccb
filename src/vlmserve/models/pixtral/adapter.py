"""Pixtral: the generic adapter with the vision tower run once per image, unmasked (tower.py)."""

from __future__ import annotations

from vlmserve.models.generic import GenericModel
from vlmserve.models.pixtral import tower


class PixtralModel(GenericModel):
    def install_fast_paths(self) -> None:
        tower.install(self.model.vision_tower)
        super().install_fast_paths()
