#!/usr/bin/env python3
"""Time one batched decode step three ways on a loaded model: mlx_vlm's BatchKVCache (eager),
the slot cache (eager) and the slot cache under mx.compile; check they pick the same tokens.

    python scripts/probe_decode.py MODEL --batch 32 --prompt 370 --steps 64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
from mlx_vlm.models import cache as vlm_cache

from vlmserve.engine import vision_attention
from vlmserve.engine.model import VLM
from vlmserve.engine.slot_cache import SlotBatch, make_decode_step


def _timed(fn, reps: int = 3) -> tuple[float, float, mx.array]:
    """(ms inside the async_eval call: host-side launch cost, ms until done, output) of the last rep."""
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        mx.async_eval(out)
        launched = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
    return (launched - t) * 1000, (done - t) * 1000, out


def probe_vision(vlm, n: int) -> None:
    """Qwen2-VL-style towers take several images in one call (patches concatenated, grid per image).
    VLM swaps in run-batched attention (engine/vision_attention.py); time mlx_vlm's own too."""
    tower = vlm.model.vision_tower
    vc = vlm.model.config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    grid = 448 // vc.patch_size
    dtype = tower.patch_embed.proj.weight.dtype
    pix = [mx.random.normal((grid * grid, dim)).astype(dtype) for _ in range(n)]
    thw = mx.array([[1, grid, grid]])
    allpix, allthw = mx.concatenate(pix), mx.concatenate([thw] * n)
    _, each, _ = _timed(lambda: [tower(x, thw, output_hidden_states=False) for x in pix])
    launch, many, batched = _timed(lambda: tower(allpix, allthw, output_hidden_states=False))
    if vision_attention.uninstall(tower):
        launch0, many0, ref = _timed(lambda: tower(allpix, allthw, output_hidden_states=False))
        vision_attention.install(tower)
    else:  # a tower VLM leaves as mlx_vlm made it
        launch0, many0, ref = launch, many, batched
    diff = mx.abs(batched.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    print(f"vision x{n}: one call per image {each:.1f} ms; one call, mlx_vlm attention {many0:.1f} ms "
          f"(launch {launch0:.1f}); one call, run-batched attention {many:.1f} ms (launch {launch:.1f}); "
          f"max |diff| {diff:.3g}", flush=True)


def probe_prefill(vlm, n: int, length: int) -> None:
    """One left-padded batched prefill of n prompts (what the scheduler does for a group)."""
    lm = vlm.language_model
    ids = mx.random.randint(10, 1000, (n, length)).astype(mx.int32)
    kw = {"position_ids": mx.broadcast_to(mx.arange(length)[None, None], (3, n, length))} if vlm.uses_mrope else {}

    def run():
        cache = [vlm_cache.BatchKVCache([0] * n) for _ in lm.model.layers]
        return [lm(ids, cache=cache, **kw).logits[:, -1]] + [c.state for c in cache]

    launch, total, _ = _timed(run)
    print(f"prefill {n} x {length}: {total:.1f} ms (launch {launch:.1f} ms), "
          f"{n * length / total:.0f} tokens/ms", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=370)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--vision", type=int, default=0, help="also time N 448px images: one call each vs one call")
    p.add_argument("--prefill", type=int, default=0, help="also time one batched prefill of N prompts")
    a = p.parse_args()
    vlm = VLM(Path(a.model))
    if a.vision:
        probe_vision(vlm, a.vision)
    if a.prefill:
        probe_prefill(vlm, a.prefill, a.prompt)
    lm = vlm.language_model
    B, L = a.batch, a.prompt
    mx.random.seed(0)
    ids = mx.random.randint(10, 1000, (B, L)).astype(mx.int32)
    mrope = "qwen" in vlm.info.model_type
    pos = mx.broadcast_to(mx.arange(L)[None, None], (3, B, L)) if mrope else None
    kw = {"position_ids": pos} if mrope else {}
    cache = [vlm_cache.BatchKVCache([0] * B) for _ in lm.model.layers]
    logits = lm(ids, cache=cache, **kw).logits[:, -1]
    first = mx.argmax(logits, -1).astype(mx.int32)
    mx.eval(first, [c.state for c in cache])

    def run(name, step_fn):
        tok = first
        outs = []
        t_first = None
        times = []
        launch = 0.0
        for i in range(a.steps):
            t = time.perf_counter()
            tok = step_fn(tok, L + i)
            t_launch = time.perf_counter()
            mx.async_eval(tok)
            launch += time.perf_counter() - t_launch
            outs.append(tok)
            if i == 0:
                mx.eval(tok)
                t_first = time.perf_counter() - t
            times.append(time.perf_counter())
        mx.eval(outs)
        end = time.perf_counter()
        steady = (end - times[0]) / (a.steps - 1)
        print(f"{name:>14}: first step {t_first * 1000:8.1f} ms, steady {steady * 1000:6.2f} ms/step "
              f"({B / steady:7.0f} tok/s), inside async_eval {launch * 1000 / a.steps:5.2f} ms/step", flush=True)
        return mx.stack(outs).tolist()

    # 1) mlx_vlm BatchKVCache, eager (a fresh copy of the prefilled cache each run)
    def copy_batch():
        out = []
        for c in cache:
            n = vlm_cache.BatchKVCache([0] * B)
            n.state = tuple(mx.array(x) for x in c.state)
            out.append(n)
        return out

    bc = copy_batch()

    def step_batch(tok, n):
        kw2 = {}
        if mrope:
            kw2["position_ids"] = mx.broadcast_to(mx.full((1, B, 1), n, dtype=mx.int32), (3, B, 1))
        return mx.argmax(lm(tok[:, None], cache=bc, **kw2).logits[:, -1], -1).astype(mx.int32)

    ref = run("BatchKVCache", step_batch)

    for compiled in (False, True):
        k0, v0 = cache[0].state[0], cache[0].state[1]
        sb = SlotBatch(len(cache), (k0.shape[1], k0.shape[3], v0.shape[3]), k0.dtype, B, L + a.steps + 1)
        for s in range(B):
            sb.write(s, [(c.state[0][s:s + 1], c.state[1][s:s + 1]) for c in cache], L)
        mx.eval(sb.arrays())
        fn = make_decode_step(vlm.decode, compiled)
        lengths = [L] * sb.slots

        def step_slot(tok, n):
            positions = mx.full((sb.slots,), n, dtype=mx.int32) if mrope else None
            out = fn(tok, positions, mx.array(lengths[:], dtype=mx.int32), *sb.arrays())
            k = len(sb.keys)
            sb.keys, sb.values = list(out[1:1 + k]), list(out[1 + k:])
            for i in range(B):
                lengths[i] += 1
            return mx.argmax(out[0], -1).astype(mx.int32)

        got = run("slot compiled" if compiled else "slot eager", step_slot)
        same = sum(x == y for r1, r2 in zip(ref, got) for x, y in zip(r1, r2))
        print(f"{'':>14}  tokens equal to BatchKVCache: {same}/{B * a.steps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
