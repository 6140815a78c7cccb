"""The real loading path: a Hugging Face id resolved from a local huggingface_hub cache, offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from support.helpers import MODELS, chat_body, free_port

pytestmark = pytest.mark.slow

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root, repo_id: str, model: str):
    """A huggingface_hub cache holding `model`'s files as `repo_id` at one revision (refs/main)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(MODELS / model, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


def test_a_hugging_face_id_is_served_from_the_local_cache_offline(tmp_path):
    repo_id = "acme/tiny-vlm"
    cache = _hub_cache(tmp_path / "hub", repo_id, "qwen2_vl")
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlmserve.cli", "serve", repo_id, "--port", str(port), "--no-engine-process"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == [repo_id]
        body = chat_body(repo_id, "Hi", max_tokens=3, temperature=0)  # greedy: sampling may draw a stop token
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_id_missing_from_the_offline_cache_fails_with_the_reason(tmp_path):
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", "serve", "acme/not-downloaded", "--port", "0", "--no-engine-process"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "acme/not-downloaded" in proc.stderr


def _without_chat_template(src, dst):
    import json

    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink()
    for name in ("tokenizer_config.json", "processor_config.json"):
        path = dst / name
        if path.exists():
            config = json.loads(path.read_text())
            config.pop("chat_template", None)
            path.write_text(json.dumps(config))
    return dst


def test_a_checkpoint_without_a_chat_template_is_served_with_mlx_vlms_plain_prompt(tmp_path):
    """Prompt-only models (PaliGemma) ship no chat template: the server starts and renders as
    mlx-vlm does (an image token per image, then the text), and answers as mlx_vlm.generate."""
    from support.families import checkpoint
    from support.helpers import IMAGES, data_uri
    from support.reference import mlx_vlm_chat_text
    from support.server import start_server
    from vlmserve.protocol import ChatMessage, ChatRequest, ImageRef, SamplingParams

    path = _without_chat_template(checkpoint("paligemma", "float32", tmp_path), tmp_path / "no-template")
    server = start_server(str(path))
    try:
        image = IMAGES / "photo_100x80.jpg"
        body = chat_body(server.model_id, "caption en", [data_uri(image)], max_tokens=8, temperature=0)
        with server.client() as c:
            r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        messages = [ChatMessage("user", [("image", ImageRef("x", "x")), ("text", "caption en")])]
        assert server.state.preprocessor.render(ChatRequest(messages, SamplingParams())).endswith("caption en")
        assert r.json()["choices"][0]["message"]["content"] == mlx_vlm_chat_text(server, messages, [image], 8)
    finally:
        server.stop()
