"""HeldPixels: both sides' record of the pixels the engine process holds, least recently used
out first within a byte budget; both sides agree as long as they note the same requests in order."""

from __future__ import annotations

import numpy as np

from vlmserve.engine.held_pixels import HeldPixels


def test_held_pixels_come_back_and_the_least_recently_used_go_first():
    engine, server = HeldPixels(max_bytes=100), HeldPixels(max_bytes=100)
    arrays = {name: {"pixel_bytes": np.zeros(40, np.uint8)} for name in "abc"}
    # c pushes b out (a was used since), b coming back pushes a out, and a coming back pushes c out.
    for key in ("a", "b", "a", "c", "b", "a"):
        held = server.note((key,), arrays[key])
        got = engine.note((key,), arrays[key], keep=True)
        assert (held is None) == (got is None)  # the serving side knows what the engine holds
        if got is not None:
            assert got is arrays[key]
    assert [engine.note((k,), {}) is not None for k in ("b", "a")] == [True, True]  # left out: held
    assert len(engine) == len(server) == 2


def test_an_image_past_the_budget_is_never_held():
    held = HeldPixels(max_bytes=10)
    big = {"pixel_values": np.zeros(11, np.uint8)}
    assert held.note(("big",), big, keep=True) is None
    assert held.note(("big",), big, keep=True) is None and len(held) == 0


def test_only_pixel_arrays_are_held():
    inputs = {"pixel_bytes": np.zeros(3), "pixel_values": np.zeros(2), "image_grid_thw": np.ones((1, 3))}
    assert sorted(HeldPixels.pixels(inputs)) == ["pixel_bytes", "pixel_values"]
