"""The committed tiny fixtures are reproducible and usable with plain mlx_vlm.

MLX work runs on a dedicated thread of this test (registered with the vlmserve thread guard when
one is active in this test run), so it never counts as an off-worker call of the server tests.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT, on_own_thread

FIXTURES = ROOT / "fixtures"
SCRIPT = ROOT / "scripts" / "make_fixtures.py"

MODELS = ["qwen2_vl", "llava", "qwen2_5_vl", "gemma3"]
# image tokens per fixture image (see scripts/make_fixtures.py docstring)
IMAGE_TOKENS = {
    "qwen2_vl": {
        "small_64x48.png": 4,
        "photo_100x80.jpg": 12,
        "alpha_40x40.png": 4,
        "large_224x160.jpg": 48,
        "pattern_72x56.webp": 6,
        "anim_48x48.gif": 4,
    },
    "llava": {
        name: 16
        for name in (
            "small_64x48.png",
            "photo_100x80.jpg",
            "alpha_40x40.png",
            "large_224x160.jpg",
            "pattern_72x56.webp",
            "anim_48x48.gif",
        )
    },
}
IMAGE_TOKENS["qwen2_5_vl"] = IMAGE_TOKENS["qwen2_vl"]
IMAGE_TOKENS["gemma3"] = {name: 4 for name in IMAGE_TOKENS["llava"]}


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_regenerate_is_byte_identical(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    committed = _files(FIXTURES)
    rebuilt = _files(tmp_path)
    assert sorted(committed) == sorted(rebuilt), sorted(set(committed) ^ set(rebuilt))
    differ = [k for k in committed if committed[k] != rebuilt[k]]
    assert not differ, f"rebuilt fixtures differ: {differ}"


class _DropPadding:
    """mlx_vlm's LlavaProcessor forwards `padding=` to the image processor, which transformers
    5.x rejects (real llava checkpoints too); drop it."""

    def __init__(self, ip):
        self._ip = ip

    def __call__(self, images, **kwargs):
        kwargs.pop("padding", None)
        return self._ip(images, **kwargs)

    def __getattr__(self, name):
        return getattr(self._ip, name)


def _load(name):
    from mlx_vlm import load

    model, processor = load(str(FIXTURES / "models" / name))
    if name == "llava":
        processor.image_processor = _DropPadding(processor.image_processor)
    return model, processor


def _stream(model, processor, prompt, image, max_tokens):
    from mlx_vlm import stream_generate

    chunks = list(stream_generate(model, processor, prompt, image=[str(image)], max_tokens=max_tokens, temperature=0.0))
    last = chunks[-1]
    text = "".join(c.text for c in chunks)
    return text, list(last.token_ids), last.generation_tokens, last.finish_reason


@pytest.mark.parametrize("name", MODELS)
def test_fixture_generates(name):
    def work():
        import time

        from mlx_vlm import generate
        from mlx_vlm.prompt_utils import apply_chat_template

        t0 = time.perf_counter()
        model, processor = _load(name)
        load_s = time.perf_counter() - t0
        prompt = apply_chat_template(processor, model.config, "Describe this image.", num_images=1)
        image = FIXTURES / "images" / "small_64x48.png"
        out = {"load_s": load_s, "prompt": prompt}
        for max_tokens in (32, 7):
            r1 = generate(
                model, processor, prompt, image=[str(image)], max_tokens=max_tokens, temperature=0.0, verbose=False
            )
            t0 = time.perf_counter()
            text, ids, n, finish = _stream(model, processor, prompt, image, max_tokens)
            out[max_tokens] = dict(
                gen=r1,
                text=text,
                ids=ids,
                n=n,
                finish=finish,
                gen_s=time.perf_counter() - t0,
                decoded=processor.tokenizer.decode(ids),
            )
        return out

    out = on_own_thread(work)
    for max_tokens in (32, 7):
        o = out[max_tokens]
        assert o["gen"].generation_tokens == max_tokens
        assert o["n"] == max_tokens and len(o["ids"]) == max_tokens
        assert o["finish"] == "length"
        assert o["gen"].text == o["text"], "generate() and stream_generate() disagree"
        assert o["text"] == o["decoded"], "streamed text differs from a full decode"
        assert o["text"].strip()
    # greedy is deterministic and prefix-consistent
    assert out[32]["ids"][:7] == out[7]["ids"]
    ids = out[32]["ids"]
    assert len(set(ids)) >= 8, f"degenerate output: {ids}"
    assert out["load_s"] < 5.0


@pytest.mark.parametrize("name", MODELS)
def test_fixture_image_token_counts(name):
    def work():
        from mlx_vlm.prompt_utils import apply_chat_template
        from mlx_vlm.utils import load_image

        model, processor = _load(name)
        prompt = apply_chat_template(processor, model.config, "Hi.", num_images=1)
        cfg = model.config
        image_id = getattr(cfg, "image_token_id", None) or cfg.image_token_index
        counts = {}
        for fname in IMAGE_TOKENS[name]:
            img = load_image(str(FIXTURES / "images" / fname))
            inputs = processor(text=[prompt], images=[img])
            counts[fname] = int((inputs["input_ids"] == image_id).sum().item())
        return counts

    assert on_own_thread(work) == IMAGE_TOKENS[name]


def test_a_resized_text_model_gets_a_tower_whose_output_it_takes(tmp_path):
    """make_fixtures --text-config: where the tower's output size was the text model's hidden size
    (Qwen-VL families), it follows a new one, and the checkpoint loads."""
    from support.families import make_fixtures

    def work():
        import json

        from mlx_vlm import load

        text = {"hidden_size": 96, "num_attention_heads": 3, "head_dim": 32, "intermediate_size": 192}
        path = make_fixtures().write_checkpoint("qwen3_5", tmp_path, text_config=text)
        load(str(path))
        config = json.loads((path / "config.json").read_text())
        return config["text_config"]["hidden_size"], config["vision_config"]["out_hidden_size"]

    assert on_own_thread(work) == (96, 96)
