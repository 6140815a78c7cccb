"""Per-request image bounds (`mm_processor_kwargs`) are held to the operator's limits."""

from __future__ import annotations

import pytest

from vlmserve.entrypoints.openai.chat_request import parse_pixel_bounds
from vlmserve.entrypoints.openai.errors import APIError

LIMIT = 50_000_000  # --max-image-pixels' default


def test_bounds_pass_through_within_the_limits():
    assert parse_pixel_bounds(None, None, LIMIT) == (None, None)
    assert parse_pixel_bounds({"min_pixels": 4096, "max_pixels": 1 << 20}, None, LIMIT) == (4096, 1 << 20)


@pytest.mark.parametrize("cap", [None, 1 << 20])
def test_a_small_image_is_never_scaled_past_what_the_server_would_decode(cap):
    """Without --max-pixels a min_pixels of 2^30 once scaled a 4x4 image to 10 GB of pixels."""
    low, high = parse_pixel_bounds({"min_pixels": 1 << 30, "max_pixels": 1 << 30}, cap, LIMIT)
    assert low == high == (cap or LIMIT)
    assert parse_pixel_bounds({"min_pixels": 1 << 30}, 10**12, LIMIT) == (LIMIT, None)


@pytest.mark.parametrize(
    "bad", [{"do_resize": False}, {"min_pixels": 10}, {"min_pixels": 9000, "max_pixels": 4000}, []]
)
def test_bad_bounds_are_a_400(bad):
    with pytest.raises(APIError) as err:
        parse_pixel_bounds(bad, None, LIMIT)
    assert err.value.status == 400
