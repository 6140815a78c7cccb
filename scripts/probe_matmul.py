#!/usr/bin/env python3
"""The few-row matmul kernel (engine/few_row_matmul.py) against MLX's matmul, per layer shape
of a decode step: agreement with a float32 reference, and time per call in a compiled chain
of dependent calls over distinct weights (so they come from memory, not L2), launched as the
server launches a step; `--sweep` also times other launch shapes of the kernel.

    python scripts/probe_matmul.py --rows 1 8 32 [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import time

import mlx.core as mx

from vlmserve.engine import few_row_matmul

# (name, N, K, bias) of a Qwen2-VL-2B layer: fused q/k/v, o_proj, fused gate/up, down_proj, tied logits
SHAPES = [("qkv", 2048, 1536, True), ("o_proj", 1536, 1536, False), ("gate_up", 17920, 1536, False),
          ("down", 1536, 8960, False), ("logits", 151936, 1536, False)]


def cublas(x, w, b=None):
    return x @ w.T if b is None else mx.addmm(b, x, w.T)


def per_call_us(fn, weights, x, repeats: int = 10) -> tuple[float, float]:
    """(µs per call, host µs per call) in one compiled graph that calls fn once per weight, each
    call waiting for the previous one (as a decode step's layers do): the next input is the
    input plus 0 × the output's first column, one small elementwise kernel more per call."""
    def chain(x, *flat):
        for w in zip(*[iter(flat)] * len(weights[0])):
            x = x + 0 * fn(x, *w)[..., :1]
        return x
    step = mx.compile(chain)
    flat = [t for w in weights for t in w]
    mx.eval(step(x, *flat))
    host, t0 = 0.0, time.perf_counter()
    outs = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs.append(step(x, *flat))
        mx.async_eval(outs[-1])
        host += time.perf_counter() - t
    mx.eval(outs)
    calls = repeats * len(weights)
    return (time.perf_counter() - t0) * 1e6 / calls, host * 1e6 / calls


def sweep_configs(m: int):
    mt = -(-m // 8)
    for f, warps, u in itertools.product((1, 2, 4), (4, 8, 16, 32), (1, 2, 4, 8)):
        regs = 8 * u * f + 4 * u * mt + 4 * f * mt + 24  # an estimate: one block must fit the SM's 64K
        if regs * 32 * warps <= 65536 and max(1, warps // 2) * f * mt * 4 * 128 <= 48 * 1024:
            yield mt, f, warps, u


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--sweep", action="store_true")
    a = p.parse_args()
    dtype = mx.bfloat16
    chosen = few_row_matmul._launch_shape
    for name, n, k, has_bias in SHAPES:
        copies = max(8, -(-400_000_000 // (n * k * 2)))  # > 400 MB in all: past the L2 cache
        weights = [(mx.random.normal((n, k)) * k ** -0.5).astype(dtype) for _ in range(copies)]
        weights = [(w, (mx.random.normal((n,)) * 0.1).astype(dtype)) if has_bias else (w,) for w in weights]
        mx.eval(weights)
        for m in a.rows:
            x = mx.random.normal((m, 1, k)).astype(dtype)
            w = weights[0]
            ref = x.astype(mx.float32) @ w[0].astype(mx.float32).T + (w[1].astype(mx.float32) if has_bias else 0)
            if m > few_row_matmul.MAX_ROWS:
                print(f"{name:>8} N={n:6d} K={k:5d} M={m:2d}: past MAX_ROWS, cuBLAS's", flush=True)
                continue
            ours, theirs = few_row_matmul.matmul(x, *w), cublas(x, *w)
            err_ours = mx.abs(ours.astype(mx.float32) - ref).max().item()
            err_theirs = mx.abs(theirs.astype(mx.float32) - ref).max().item()
            t_ours, h_ours = per_call_us(few_row_matmul.matmul, weights, x)
            t_theirs, h_theirs = per_call_us(cublas, weights, x)
            print(f"{name:>8} N={n:6d} K={k:5d} M={m:2d}: kernel {t_ours:6.1f} us (host {h_ours:4.1f}, "
                  f"{n * k * 2 / t_ours / 1e3:5.0f} GB/s) err {err_ours:.3g} {chosen(m, n, k)} | mlx {t_theirs:6.1f} us "
                  f"(host {h_theirs:4.1f}, {n * k * 2 / t_theirs / 1e3:5.0f} GB/s) err {err_theirs:.3g}", flush=True)
            if not a.sweep:
                continue
            results = []
            for cfg in sweep_configs(m):
                if n % (16 * cfg[1]):
                    continue
                few_row_matmul._launch_shape = lambda *_, cfg=cfg: cfg
                try:  # a build that needs more registers than its block can have fails to launch
                    err = mx.abs(few_row_matmul.matmul(x, *w).astype(mx.float32) - ref).max().item()
                    results.append((per_call_us(few_row_matmul.matmul, weights, x)[0], cfg, err))
                except RuntimeError as exc:
                    print(f"      {cfg}: {exc}", flush=True)
            few_row_matmul._launch_shape = chosen
            results.sort()
            print("      best (us, (MT, F, WARPS, U), err):",
                  ", ".join(f"{t:.1f} {c} {e:.3g}" for t, c, e in results[:6]), flush=True)
        del weights
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
