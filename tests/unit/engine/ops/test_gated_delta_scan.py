"""The gated delta rule's prompt kernel (engine/ops/gated_delta_scan.py): the kernel against
mlx_vlm's per-token ops on CUDA, and which calls its routing sends to it (on every backend; the
hybrid family's logits through the routing: integration/engine/ops/test_gated_delta_scan.py)."""

from __future__ import annotations

import numpy as np
import pytest

from support.helpers import on_own_thread, per_token_gated_delta_ops
from vlmserve.engine.ops import gated_delta_scan


def _inputs(batch, length, k_heads, v_heads, k_dim, v_dim, dtype, vector_gate=False, seed=0):
    """Inputs in the ranges a layer gives the rule: unit-norm keys and queries (queries scaled
    by 1/sqrt(Dk)), gates in (0.5, 1), betas in (0, 1), a nonzero state."""
    import mlx.core as mx

    key = iter(mx.random.split(mx.random.key(seed), 6))
    t = getattr(mx, dtype)

    def unit(shape, k):
        x = mx.random.normal(shape, key=k)
        return x / mx.linalg.norm(x, axis=-1, keepdims=True)

    q = (unit((batch, length, k_heads, k_dim), next(key)) * k_dim**-0.5).astype(t)
    k = unit((batch, length, k_heads, k_dim), next(key)).astype(t)
    v = mx.random.normal((batch, length, v_heads, v_dim), key=next(key)).astype(t)
    gate_shape = (batch, length, v_heads, k_dim) if vector_gate else (batch, length, v_heads)
    g = mx.random.uniform(0.5, 1.0, gate_shape, key=next(key))
    beta = mx.random.uniform(0.0, 1.0, (batch, length, v_heads), key=next(key)).astype(t)
    state = mx.random.normal((batch, v_heads, v_dim, k_dim), key=next(key)) * 0.1
    return q, k, v, g, beta, state


# (batch, length, key heads, value heads, key dim, value dim, vector gate, left padding per row)
_CASES = {
    "decode_step": (5, 1, 16, 32, 128, 128, False, None),  # one position a row, grouped heads
    "two_tokens": (1, 2, 2, 2, 128, 128, False, None),
    "qwen3_5_heads": (2, 150, 16, 16, 128, 128, False, None),
    "grouped_heads": (3, 70, 2, 4, 128, 64, False, [0, 13, 69]),
    "vector_gate": (2, 33, 2, 2, 64, 32, True, [5, 0]),
    "wide_keys": (1, 40, 1, 2, 256, 128, False, None),
    # four value heads a key head; value rows that leave the last block part empty
    "odd_value_rows": (2, 17, 1, 4, 32, 18, False, [0, 3]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 2e-2), ("float16", 4e-3)])
@pytest.mark.parametrize("case", list(_CASES))
def test_kernel_matches_mlx_vlm_per_token_ops(case, dtype, atol):
    batch, length, k_heads, v_heads, k_dim, v_dim, vector_gate, pads = _CASES[case]

    def compare():
        import mlx.core as mx

        q, k, v, g, beta, state = _inputs(batch, length, k_heads, v_heads, k_dim, v_dim, dtype, vector_gate)
        mask = None
        if pads is not None:
            mask = mx.arange(length)[None, :] >= mx.array(pads)[:, None]
        ref_y, ref_state = per_token_gated_delta_ops()(q, k, v, g, beta, state, mask)
        runs = [gated_delta_scan.scan(q, k, v, g, beta, state, mask) for _ in range(2)]
        keep = np.ones((batch, length), bool) if mask is None else np.array(mask)
        as_np = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
        dtypes = [(y.dtype == q.dtype, s.dtype == mx.float32) for y, s in runs]
        return keep, as_np(ref_y), as_np(ref_state), [(as_np(y), as_np(s)) for y, s in runs], dtypes

    keep, ref_y, ref_state, runs, dtypes = on_own_thread(compare)
    (y, state), (y2, state2) = runs
    assert dtypes == [(True, True)] * 2  # the output in the queries' dtype, the state in float32
    assert y.shape == ref_y.shape and state.shape == ref_state.shape
    np.testing.assert_allclose(y[keep], ref_y[keep], atol=atol * max(1.0, np.abs(ref_y).max()))
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-4 * np.abs(ref_state).max())
    np.testing.assert_array_equal(y, y2)  # the same from call to call
    np.testing.assert_array_equal(state, state2)


@pytest.mark.gpu
def test_kernel_starts_from_a_zero_state_when_given_none():
    def compare():
        import mlx.core as mx

        q, k, v, g, beta, _ = _inputs(2, 24, 2, 4, 64, 32, "bfloat16")
        zeros = mx.zeros((2, 4, 32, 64))
        (y, state), (y0, state0) = (gated_delta_scan.scan(q, k, v, g, beta, s) for s in (None, zeros))
        return [np.array(a.astype(mx.float32)) for a in (y, state, y0, state0)]

    y, state, y0, state0 = on_own_thread(compare)
    assert np.abs(state).max() > 0
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(state, state0)


def test_serves_prompts_of_the_shapes_it_takes(monkeypatch):
    monkeypatch.setattr(gated_delta_scan.cuda_kernels, "enabled", lambda: True)

    def serves(length, k_heads, v_heads, k_dim, gate="head", dtype="bfloat16", state="own", mask="own"):
        import mlx.core as mx

        q, k, v, g, beta, s = _inputs(2, length, k_heads, v_heads, k_dim, 64, dtype, gate == "key")
        if gate == "odd":
            g = g[..., :1]
        s = {"own": s, "none": None, "one_row": s[:1]}[state]
        m = {"own": mx.ones((2, length), dtype=mx.bool_), "none": None, "one_row": mx.ones((1, length), dtype=mx.bool_)}
        return gated_delta_scan.serves(q, k, v, g, beta.astype(mx.float32), s, m[mask])

    got = on_own_thread(
        lambda: [
            serves(12, 16, 16, 128),
            serves(12, 2, 4, 64, gate="key"),
            serves(12, 2, 4, 256, dtype="float32"),
            serves(1, 16, 16, 128),  # a decode step
            serves(12, 16, 16, 16),  # a key dim not a multiple of 32
            serves(12, 16, 16, 288),
            serves(12, 4, 6, 128),  # value heads not in whole key-head groups
            serves(12, 16, 16, 128, gate="odd"),
            serves(12, 16, 16, 128, state="none", mask="none"),
            serves(12, 16, 16, 128, state="one_row"),  # a state mlx_vlm's ops would broadcast
            serves(12, 16, 16, 128, mask="one_row"),
        ]
    )
    assert got == [True, True, True, True, False, False, False, False, True, False, False]
    monkeypatch.setattr(gated_delta_scan.cuda_kernels, "enabled", lambda: False)
    assert not on_own_thread(lambda: serves(12, 16, 16, 128))


def test_routing_sends_plain_prompt_calls_to_the_kernel(monkeypatch):
    """Calls that ask for intermediate states or other arguments keep mlx_vlm's implementation."""
    calls = []
    monkeypatch.setattr(gated_delta_scan, "serves", lambda q, *_: q.shape[1] > 1)
    monkeypatch.setattr(gated_delta_scan, "scan", lambda *args: calls.append(("kernel", len(args))) or "kernel")

    def original(q, k, v, g, beta, state=None, mask=None, state_steps=None, C=64):
        calls.append(("original", state_steps))
        return "original"

    route = gated_delta_scan._routed(original)
    assert route.vlmserve_routed is original

    def work():
        import mlx.core as mx

        prompt, step = mx.zeros((1, 5, 2, 32)), mx.zeros((1, 1, 2, 32))
        return [
            route(prompt, prompt, prompt, None, None),
            route(prompt, prompt, prompt, None, None, None, None),
            route(prompt, prompt, prompt, None, None, None, None, None),  # state_steps=None, positional
            route(prompt, prompt, prompt, None, None, state_steps=None),
            route(step, step, step, None, None),
            route(prompt, prompt, prompt, None, None, None, None, 4),
            route(prompt, prompt, prompt, None, None, state_steps=4),
            route(prompt, prompt, prompt, None, None, C=32),
        ]

    got = on_own_thread(work)
    assert got == ["kernel"] * 4 + ["original"] * 4
    assert calls[:4] == [("kernel", 7)] * 4
    assert calls[4:] == [("original", None), ("original", 4), ("original", 4), ("original", None)]
