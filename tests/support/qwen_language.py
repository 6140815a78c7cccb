"""A random-weight Qwen2-VL / Qwen2.5-VL language model for the layer-path tests (MLX thread only)."""

from __future__ import annotations

from support.helpers import MODELS


def language_model(name: str, tied: bool, dtype: str):
    """A random-weight language model of the fixture's family with 32-wide heads (the fixtures'
    are 16 wide, narrower than the attention kernel takes)."""
    import importlib
    import json

    import mlx.core as mx

    family = importlib.import_module(f"mlx_vlm.models.{name}")
    config = json.loads((MODELS / name / "config.json").read_text())
    text = dict(
        config,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
        tie_word_embeddings=tied,
    )
    import mlx.nn as nn

    mx.random.seed(0)
    lm = family.LanguageModel(family.TextConfig.from_dict(text), family.ModelConfig.from_dict(config))
    dtype, _, bits = dtype.partition("+")
    lm.set_dtype(getattr(mx, dtype))
    if bits:  # "+4bit": affine, groups of 64, as mlx-vlm's convert makes them
        nn.quantize(lm, group_size=64, bits=int(bits.removesuffix("bit")))
    mx.eval(lm.parameters())
    return lm


def composed_forward(monkeypatch, module, record, applies) -> list:
    """Route the server's calls of `module.forward` (decode.py's or prefill.py's) to its composed
    ops (`kernels=False`), so a routing test runs on any backend; `applies` stands in for
    `module.applies`. Returns the list that gets `record(*args)` of each call."""
    calls = []
    original = module.forward

    def composed(*args, kernels=True):
        calls.append(record(*args))
        return original(*args, kernels=False)

    monkeypatch.setattr(module, "forward", composed)
    monkeypatch.setattr(module, "applies", applies)
    return calls
