"""Batch captioning client (vlmserve.caption) against the real vlmserve server and --in-process
(against fake OpenAI-shaped servers: unit/caption/test_caption.py)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from support.caption import FAST, FIXTURE_IMAGES, QWEN, SCRIPT, caption, read_jsonl


# ---- the real server ------------------------------------------------------------------------------------
def _real_server_available() -> str | None:
    try:
        from vlmserve.entrypoints.openai.app import create_app  # noqa: F401
    except ImportError as exc:
        return f"vlmserve.entrypoints.openai.app.create_app is not importable ({exc})"
    if not QWEN.is_dir():
        return "fixtures/models/qwen2_vl is missing"
    return None


def _direct_answers(base_url: str, model: str) -> dict[str, tuple[int, str | None]]:
    from vlmserve.caption.payload import data_uri

    answers = {}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for p in sorted(FIXTURE_IMAGES.iterdir()):
            body = {
                "model": model,
                "max_tokens": 8,
                "temperature": 0,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_uri(p.read_bytes(), p.name)}},
                            {"type": "text", "text": "Describe this image."},
                        ],
                    }
                ],
            }
            r = client.post("/v1/chat/completions", json=body)
            answers[str(p)] = (
                r.status_code,
                r.json()["choices"][0]["message"]["content"].strip() if r.status_code == 200 else None,
            )
    return answers


def _check_against(rows: list[dict], answers: dict) -> None:
    assert {r["path"] for r in rows} == set(answers)
    assert any(status == 200 for status, _ in answers.values())
    for r in rows:
        status, text = answers[r["path"]]
        if status == 200:
            assert r["error"] is None and r["caption"] == text, r
            assert r["completion_tokens"] == 8 or r["finish_reason"] == "stop"
        else:
            assert r["caption"] is None and f"HTTP {status}" in r["error"]


@pytest.mark.skipif(_real_server_available() is not None, reason=str(_real_server_available()))
def test_real_server_captions_equal_direct_greedy_answers(tmp_path, request):
    server = request.getfixturevalue("qwen_server")
    answers = _direct_answers(server.base_url, server.model_id)
    out = tmp_path / "c.jsonl"
    code = caption(
        FIXTURE_IMAGES,
        "-o",
        out,
        "--server",
        server.base_url,
        "--prompt",
        "Describe this image.",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--concurrency",
        "6",
        *FAST,
    )
    rows = read_jsonl(out)
    _check_against(rows, answers)
    assert code == (0 if all(s == 200 for s, _ in answers.values()) else 1)
    assert {r["model"] for r in rows if not r["error"]} == {server.model_id}


@pytest.mark.slow
@pytest.mark.skipif(_real_server_available() is not None, reason=str(_real_server_available()))
def test_in_process_matches_the_server(tmp_path, request):
    server = request.getfixturevalue("qwen_server")
    answers = _direct_answers(server.base_url, server.model_id)
    out = tmp_path / "c.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(FIXTURE_IMAGES),
            "-o",
            str(out),
            "--in-process",
            str(QWEN),
            "--prompt",
            "Describe this image.",
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            *FAST,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stderr
    _check_against(read_jsonl(out), answers)
    assert "done" in proc.stderr
