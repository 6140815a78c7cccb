"""The pool check's tolerance (decode_batch.probe_tolerance): the fixed one at least, twice the
model's own paths' difference, never past its ceiling, and a NaN or infinite difference loosens
nothing past it."""

from __future__ import annotations

import math

from vlmserve.engine.runner.decode_batch import MAX_TOLERANCE, NOISE_FACTOR, PROBE_TOLERANCE, probe_tolerance


def test_it_follows_the_own_paths_between_its_floor_and_ceiling():
    assert probe_tolerance(0.0) == PROBE_TOLERANCE
    assert probe_tolerance(0.035) == NOISE_FACTOR * 0.035
    assert probe_tolerance(0.5) == MAX_TOLERANCE


def test_a_nan_or_infinite_difference_gives_a_finite_bound():
    assert probe_tolerance(math.nan) == PROBE_TOLERANCE
    assert probe_tolerance(math.inf) == MAX_TOLERANCE
