"""Micro-benchmark: where a quantized model's prompt forward loses time against its bf16 twin.

For each model given, and for a quantized one each way its many-row linear layers can run, it
times one prompt forward of `--rows` prompts' next `--piece` positions after `--before` cached
ones (host time until the forward is queued, total time until the device is done; as
prefill_pieces.py measures them) and one vision-tower call over `--images` images:
  - `kernel`: the weight dequantized by vlmserve's kernel, then a dense matmul (the default);
  - `mx-dequantize`: the same with `mx.dequantize`;
  - `qmm`: MLX's quantized matmul at every row count;
  - `dense`: every quantized linear layer replaced by a dense one holding its weight
    dequantized once (the floor that any dequantize-as-you-load matmul could reach).

    python benchmarks/quantized_prefill.py /root/models/qwen2-vl-2b-bf16 /root/models/qwen2-vl-2b-4bit
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from prefill_pieces import _states, _time, _ways  # noqa: E402
from vlmserve.engine.ops import many_row_dequantized  # noqa: E402
from vlmserve.models.registry import load_model_adapter  # noqa: E402


def _dense_copy(module: nn.Module) -> int:
    """Replace every quantized linear layer under `module` by a dense one of its dequantized weight."""
    count = 0
    for _, owner in list(module.named_modules()):
        for name, child in list(owner.children().items()):
            if isinstance(child, nn.QuantizedLinear):
                w = mx.dequantize(child.weight, child.scales, child.biases, child.group_size, child.bits)
                dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in child)
                dense.update({"weight": w, **({"bias": child.bias} if "bias" in child else {})})
                owner[name] = dense
                group = getattr(owner, "_group", None)  # a fused projection's layer (fused_projections)
                if group is not None and group.fused is child:
                    group.fused = dense
                count += 1
    mx.eval(module.parameters())
    return count


def _variant(name: str):
    """Set how many-row quantized layers run; returns a function undoing it."""
    saved = many_row_dequantized.MIN_ROWS, many_row_dequantized._kernel_serves
    if name == "qmm":
        many_row_dequantized.MIN_ROWS = 1 << 40
    elif name == "mx-dequantize":
        many_row_dequantized._kernel_serves = lambda layer: False

    def undo():
        many_row_dequantized.MIN_ROWS, many_row_dequantized._kernel_serves = saved

    return undo


def _tower_ms(model, images: int, side: int) -> float:
    tower = model.model.vision_tower
    grid_side = side // 14
    pixels = mx.random.normal((images * grid_side * grid_side, 3 * 2 * 14 * 14)).astype(mx.bfloat16)
    grid = np.tile([1, grid_side, grid_side], (images, 1))
    mx.eval(pixels)
    run = (lambda: model._tower(pixels, grid)) if hasattr(model, "_tower") else (lambda: tower(pixels, mx.array(grid)))
    return _time(run, 5)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--piece", type=int, default=512)
    ap.add_argument("--before", type=int, default=0)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--side", type=int, default=448)
    args = ap.parse_args()
    for path in args.models:
        config = json.loads((path / "config.json").read_text())
        model = load_model_adapter(path, config["model_type"], ())
        quantized = "quantization" in config
        for variant in ("kernel", "mx-dequantize", "qmm", "dense") if quantized else ("bf16",):
            undo = _variant(variant)
            if variant == "dense":
                _dense_copy(model.model)
            result = {"model": path.name, "variant": variant}
            for rows in args.rows:
                states = _states(model, rows, args.before, args.piece)
                fn = _ways(model, states, args.before, args.before + args.piece)["together"]
                _time(fn, 2)
                host, total = _time(fn, 5)
                result[f"rows{rows}_host_ms"], result[f"rows{rows}_total_ms"] = round(host, 2), round(total, 2)
            _tower_ms(model, args.images, args.side)
            result["tower_ms"] = round(_tower_ms(model, args.images, args.side), 2)
            print(json.dumps(result), flush=True)
            undo()
        del model
        mx.clear_cache()


if __name__ == "__main__":
    main()
