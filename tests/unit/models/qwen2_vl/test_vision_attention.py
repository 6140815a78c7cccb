"""How the run-batched vision attention (models/qwen2_vl/vision_attention.py) cuts segments
into runs (the features against mlx_vlm's: e2e/models/qwen2_vl/test_vision_attention.py)."""

from __future__ import annotations

from vlmserve.models.qwen2_vl.vision_attention import segment_runs


def test_segment_runs_groups_consecutive_equal_lengths():
    assert segment_runs([0, 4, 8, 12, 15, 18, 20]) == [(0, 3, 4), (12, 2, 3), (18, 1, 2)]
    assert segment_runs([0, 5, 5, 9]) == [(0, 1, 5), (5, 1, 4)]  # empty segments are skipped
    assert segment_runs([0]) == []


def test_power_of_two_pieces_cut_runs_largest_first():
    from vlmserve.models.qwen2_vl.vision_attention import power_of_two_pieces

    assert power_of_two_pieces([(0, 13, 4), (52, 2, 3), (58, 1, 5)]) == [
        (0, 8, 4),
        (32, 4, 4),
        (48, 1, 4),
        (52, 2, 3),
        (58, 1, 5),
    ]
    assert power_of_two_pieces([(0, 32, 10)]) == [(0, 32, 10)]
