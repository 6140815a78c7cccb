"""Fused q/k/v and gate/up projections (engine/ops/fused_projections.py) on tiny layers
(identical logits for every fixture family: integration/engine/ops/test_fused_projections.py)."""

from __future__ import annotations

import numpy as np

from support.helpers import on_own_thread


def test_a_part_called_on_another_input_uses_its_own_rows():
    def work():
        import mlx.core as mx
        import mlx.nn as nn

        from vlmserve.engine.ops import fused_projections

        mx.random.seed(3)
        block = nn.Module()
        block.q_proj, block.k_proj, block.v_proj = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)
        x, other = mx.random.normal((2, 3, 16)), mx.random.normal((2, 3, 16))
        expected = [np.array(block.q_proj(x)), np.array(block.k_proj(other)), np.array(block.v_proj(x))]
        assert fused_projections.install(block) == 1
        # k on a different input than q: its own rows; v on q's input again: q's fused output
        got = [np.array(block.q_proj(x)), np.array(block.k_proj(other)), np.array(block.v_proj(x))]
        return expected, got

    expected, got = on_own_thread(work)
    for e, g in zip(expected, got):
        assert np.array_equal(e, g)


def test_mismatched_projections_are_left_alone():
    def work():
        import mlx.nn as nn

        from vlmserve.engine.ops import fused_projections

        mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=True)
        attn = nn.Module()
        attn.q_proj, attn.k_proj = nn.Linear(16, 8), nn.Linear(16, 8)  # no v_proj
        return fused_projections.install(mlp) + fused_projections.install(attn), type(mlp.gate_proj).__name__

    assert on_own_thread(work) == (0, "Linear")
