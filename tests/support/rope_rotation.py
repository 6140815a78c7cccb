"""mlx_vlm's rotate_half against ours (engine/ops/rope_rotation.py), for the rope tests."""

from __future__ import annotations


def with_and_without_gather(run) -> dict:
    """run() with mlx_vlm's rotate_half, then with ours; leaves the binding as it found it
    (a server started earlier in this test run may have installed ours)."""
    from mlx_vlm.models import rope_utils

    from vlmserve.engine.ops import rope_rotation

    installed = rope_utils.rotate_half is rope_rotation.rotate_half
    rope_rotation.uninstall()
    try:
        original = run()
        assert rope_rotation.install() >= 1
        assert rope_utils.rotate_half is rope_rotation.rotate_half
        return {"original": original, "gather": run()}
    finally:
        if not installed:
            rope_rotation.uninstall()
