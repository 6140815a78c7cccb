"""A hybrid family's gated delta layers routed to the kernel (engine/ops/gated_delta_scan)
give mlx_vlm's logits and greedy tokens: a prompt, a left-padded batch of two, and decode steps
through the state. The kernel itself runs on CUDA only (its own test compares it with mlx_vlm's
per-token ops there); here a launch that computes the same rule with those ops stands in for it,
so the routing, the padding and the state hand-over are what is checked, on any backend."""

from __future__ import annotations

import numpy as np
import pytest

from support.families import session_checkpoint
from support.helpers import on_own_thread, padded_greedy_logits, stand_in_gated_delta_kernel

pytestmark = pytest.mark.slow

# a prompt alone, then left-padded beside a shorter one
_PROMPTS = ([[5, 17, 42, 7, 99, 3, 11]], [[5, 17, 42, 7, 99, 3, 11], [8, 23, 4]])


def test_routed_gated_delta_layers_give_mlx_vlm_logits(tmp_path_factory, monkeypatch):
    path = session_checkpoint("qwen3_5", "float32", tmp_path_factory)
    from vlmserve.engine.ops import gated_delta_scan

    launched = stand_in_gated_delta_kernel(monkeypatch)

    def work():
        from mlx_vlm.utils import load_model

        plain, routed = (load_model(path, lazy=False).language_model for _ in range(2))
        reference = [padded_greedy_logits(plain, p) for p in _PROMPTS]
        try:
            count = gated_delta_scan.install(routed, force=True)
            again = gated_delta_scan.install(routed, force=True)
            got = [padded_greedy_logits(routed, p) for p in _PROMPTS]
        finally:
            gated_delta_scan.uninstall()  # the routing is process-wide
        return count, again, reference, got

    count, again, reference, got = on_own_thread(work)
    from mlx_vlm.models import gated_delta
    from mlx_vlm.models.qwen3_5 import gated_delta as qwen3_5_rule

    assert count == 2 and again == 0  # its chunked scan and its per-token ops, routed once
    restored = (qwen3_5_rule.gated_delta_chunked, qwen3_5_rule.gated_delta_ops, gated_delta.gated_delta_ops)
    assert not any(hasattr(fn, "vlmserve_routed") for fn in restored)  # uninstall gave them back
    assert {n > 1 for _, n in launched} == {True, False}  # prompts and decode steps went through the route
    for ref_run, run in zip(reference, got):
        for ref, out in zip(ref_run, run):
            # mlx_vlm's prompt path here is its chunked scan: the same rule, summed in another order
            np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
            assert np.array_equal(out.argmax(-1), ref.argmax(-1))
