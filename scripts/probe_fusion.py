#!/usr/bin/env python3
"""Count the primitives of one compiled decode step and time it, with and without the rewrites
that cut kernels (engine/fused_projections.py, engine/rope_rotation.py, and on CUDA
engine/decode_attention.py, engine/qwen_decode.py and engine/few_row_matmul.py); check the logits agree (the attention
kernel agrees to rounding only).

    python scripts/probe_fusion.py MODEL --batch 32 --capacity 512 --steps 64
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_vlm.utils import load_model

from vlmserve.engine import decode_attention, rope_rotation
from vlmserve.engine.model import VLM
from vlmserve.engine.slot_cache import SlotBatch, make_decode_step


def primitives(outputs) -> collections.Counter:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        labels = re.findall(r'label ="([^"]+)"', f.read())
    return collections.Counter(lab.split()[0] for lab in labels if not lab[0].isdigit())


def time_steps(step, kv0: SlotBatch, tokens, lengths, positions, steps: int) -> tuple[float, float, float]:
    """Run `steps` greedy decode steps pipelined like the server (step N+1 launched before N is
    read), after 3 untimed ones. Returns ms per step, host ms per step (building the graph plus
    launching it) and ms per step inside `mx.async_eval` alone."""
    kv, tok = kv0.arrays(), tokens
    for i in range(steps + 3):
        if i == 3:
            mx.eval(tok)
            t0, host, inside = time.perf_counter(), 0.0, 0.0
        t = time.perf_counter()
        o = step(tok, None if positions is None else positions + i, lengths + i, *kv)
        tok, kv = mx.argmax(o[0], -1).astype(mx.int32), list(o[1:])
        launch = time.perf_counter()
        mx.async_eval(tok, kv)
        end = time.perf_counter()
        if i >= 3:
            host, inside = host + end - t, inside + end - launch
    mx.eval(tok)
    return ((time.perf_counter() - t0) * 1000 / steps, host * 1000 / steps, inside * 1000 / steps)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    a = p.parse_args()
    vlm = VLM(Path(a.model))  # fused projections + gather rotate_half, as the server runs
    plain = load_model(Path(a.model), lazy=False)
    B = a.batch
    mx.random.seed(0)
    kv0 = SlotBatch(*vlm.kv_layout(), slots=B, capacity=a.capacity)
    kv0.keys = [mx.random.normal(k.shape).astype(k.dtype) for k in kv0.keys]
    kv0.values = [mx.random.normal(v.shape).astype(v.dtype) for v in kv0.values]
    tokens = mx.random.randint(0, min(1000, vlm.info.vocab_size), (B,)).astype(mx.int32)
    lengths = mx.full((B,), a.capacity // 2, dtype=mx.int32)
    positions = lengths + 7 if vlm.uses_mrope else None
    mx.eval(kv0.arrays(), tokens)

    fast = vlm.fast_decode

    def with_model(model, rope: bool, attention: bool = False, qwen_step: bool = False, matmul: bool = False):
        def decode(*args):
            (rope_rotation.install if rope else rope_rotation.uninstall)()  # while tracing
            (decode_attention.install if attention else decode_attention.uninstall)()
            os.environ["VLMSERVE_FEW_ROW_MATMUL"] = "1" if matmul else "0"
            vlm.model, vlm.language_model = model, model.language_model
            vlm.fast_decode = qwen_step and fast
            return VLM.decode(vlm, *args)
        return make_decode_step(decode, True)

    served = vlm.model
    variants = [("mlx_vlm modules", with_model(plain, False)),
                ("+ fused projections", with_model(served, False)),
                ("+ gather rotate_half", with_model(served, True)),
                ("+ decode attention kernel", with_model(served, True, True)),
                ("+ qwen decode step", with_model(served, True, True, True)),
                ("+ few-row matmul kernel", with_model(served, True, True, True, True))]
    ref = None
    for name, step in variants:
        out = step(tokens, positions, lengths, *kv0.arrays())
        counts = primitives(out)
        mx.eval(out)
        logits = out[0].astype(mx.float32)
        ref = logits if ref is None else ref
        diff = mx.abs(logits - ref).max().item()
        ms, launch, inside = time_steps(step, kv0, tokens, lengths, positions, a.steps)
        print(f"{name:>26}: {sum(counts.values()):5d} primitives, {ms:6.2f} ms/step (eval {inside:4.2f}) "
              f"({B / ms * 1000:6.0f} tok/s), host {launch:5.2f} ms/step, "
              f"max|dlogit| vs mlx_vlm {diff:.3g}", flush=True)
        print("   ", dict(counts.most_common()), flush=True)
    rope_rotation.install()
    decode_attention.install()
    vlm.fast_decode = fast
    os.environ.pop("VLMSERVE_FEW_ROW_MATMUL")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
