"""A generic family's vision tower on CUDA at image sizes it has not met (engine/ops/tower_attention.py).

For each size after the first (the first builds the plan-free kernel): a request's embedding
three times through vlmserve's route (attention shapes without a cuDNN plan run the plan-free
kernel) and then three times through MLX's own (cuDNN, which builds a plan per new shape on the
first call), in ms, and how far the two routes' embeddings are apart (largest difference over
the largest value); then the idle rebuilds of the queued shapes (their plans exist by then,
from MLX's pass), and the route's times once they are planned.

    python benchmarks/tower_shapes.py MODEL_DIR 40x40,56x56,112x56,112x112,224x224
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from chat_requests import prepared_chats  # benchmarks/, the script's directory
from vlmserve.models.registry import load_model_adapter, model_type_of


def _timed(model, requests, routes: bool) -> list[tuple[list[float], np.ndarray]]:
    model.routes_tower_attention = routes
    out = []
    for prepared in requests:
        times = []
        for _ in range(3):
            mx.synchronize()
            t0 = time.perf_counter()
            embeds = model.embed_prompt(prepared).embeds
            mx.eval(embeds)
            times.append(round((time.perf_counter() - t0) * 1e3, 1))
        out.append((times, np.array(embeds.astype(mx.float32))))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("sizes", help="WxH,WxH,... (the first warms the kernel)")
    args = p.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    requests = prepared_chats(args.model, sizes, "What is it?", context=8192)
    model = load_model_adapter(args.model, model_type_of(args.model))
    if not model.routes_tower_attention:
        raise SystemExit("this model's tower does not take the route here (CUDA with cuDNN, a generic family)")
    mx.eval(model.embed_prompt(requests[0]).embeds)
    routed = _timed(model, requests[1:], True)
    queued = model.attention_plans.pending()
    cudnn = _timed(model, requests[1:], False)
    for size, (t_route, e_route), (t_mlx, e_mlx) in zip(sizes[1:], routed, cudnn):
        apart = np.abs(e_route - e_mlx).max() / max(1e-6, np.abs(e_mlx).max())
        print(f"{size[0]}x{size[1]}: route ms {t_route}, MLX's ms {t_mlx}, apart {apart:.1e}")
    t0, builds = time.perf_counter(), 0
    while model.attention_plans.pending():
        model.build_next_attention_plan()
        mx.synchronize()
        builds += 1
    # MLX's pass above built these plans already: this times the tower reruns, not the plans' builds.
    print(f"{queued} shapes queued; {builds} idle rebuilds in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    print("route once built, ms:", [t for t, _ in _timed(model, requests[1:], True)])


if __name__ == "__main__":
    main()
