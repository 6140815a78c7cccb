"""Quantized-matmul kernels built in side processes: which settings a config calls for, a build
leaves a marker in the kernel cache, and a later start skips what is marked."""

from __future__ import annotations

import json
import logging

from vlmserve.engine import kernel_prebuild


def test_settings_are_the_model_wide_one_and_every_per_layer_override():
    config = {
        "quantization": {
            "group_size": 64,
            "bits": 4,
            "language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
            "vision_tower.blocks.0.attn.qkv": False,
        }
    }
    assert kernel_prebuild.settings(config) == [(4, 64, "affine"), (8, 32, "affine")]
    assert kernel_prebuild.settings({"quantization_config": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}) == [
        (4, 32, "mxfp4")
    ]
    assert kernel_prebuild.settings({"torch_dtype": "bfloat16"}) == []


def test_the_activation_dtype_is_the_models():
    assert kernel_prebuild.activation_dtype({"torch_dtype": "float16"}) == "float16"
    assert kernel_prebuild.activation_dtype({"text_config": {"dtype": "bfloat16"}}) == "bfloat16"
    assert kernel_prebuild.activation_dtype({}) == "bfloat16"


def test_builds_run_leave_markers_and_a_later_start_skips_them(tmp_path, monkeypatch, caplog):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization": {"group_size": 64, "bits": 4}}))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernel_prebuild, "ROW_CLASSES", (1, 16))
    procs = kernel_prebuild.start(model)
    assert len(procs) == 2
    with caplog.at_level(logging.INFO):
        kernel_prebuild.wait(procs, timeout=120)
    assert "2 built in parallel processes (0 failed)" in caplog.text
    markers = sorted(p.name for p in (tmp_path / "ptx" / "vlmserve-prebuilt").iterdir())
    assert markers == ["qmm-bfloat16-affine-b4-g64-m1", "qmm-bfloat16-affine-b4-g64-m16"]
    assert kernel_prebuild.start(model) == []  # all built: nothing to start


def test_nothing_starts_without_a_kernel_cache_or_a_config(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"quantization": {"group_size": 64, "bits": 4}}))
    assert kernel_prebuild.start(tmp_path) == []
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert kernel_prebuild.start(tmp_path / "missing") == []
