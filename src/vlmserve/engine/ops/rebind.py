"""Swap a function mlx_vlm's model modules look up by name (rotate_half, the attention entry point).

mlx_vlm imports these into each model module, so replacing one means rebinding that name in
every loaded `mlx_vlm.models*` module that holds the old function, and only there.
"""

from __future__ import annotations

import sys
from typing import Any


def rebind_in_mlx_vlm(name: str, old: Any, new: Any) -> int:
    """Bind `name` to `new` wherever a loaded mlx_vlm model module binds it to `old`; returns how many."""
    changed = 0
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("mlx_vlm.models") and module is not None and getattr(module, name, None) is old:
            setattr(module, name, new)
            changed += 1
    return changed
