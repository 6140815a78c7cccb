"""Graceful shutdown of the real CLI process: SIGTERM while 8 streams decode."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from support.helpers import MODELS, free_port

# `vlmserve serve` in a subprocess
pytestmark = pytest.mark.slow

DRAIN = 5.0


def _stream(base, max_tokens, out, started, accepted):
    lines = []
    try:
        with httpx.stream(
            "POST",
            base + "/v1/chat/completions",
            timeout=60,
            json={
                "model": "qwen2_vl",
                "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            lines.append(f"status {r.status_code}")
            accepted.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if '"content": "' in line and '"content": ""' not in line:
                        started.set()
    except Exception as exc:  # noqa: BLE001 - reported by the assertions below
        lines.append(f"exception {exc!r}")
    finally:
        out.append(lines)


def test_sigterm_drains_and_exits_zero():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vlmserve.cli",
            "serve",
            str(MODELS / "qwen2_vl"),
            "--port",
            str(port),
            "--drain-timeout",
            str(DRAIN),
            "--max-num-seqs",
            "6",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server never became ready"
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)

        # 4 short streams running, then 4 endless ones (2 of them wait: --max-num-seqs 6).
        short, long_ = [], []
        threads = []
        for results, max_tokens, n in ((short, 150, 4), (long_, 20000, 4)):
            events, accepted = [], []
            for _ in range(n):
                started, answered = threading.Event(), threading.Event()
                events.append(started)
                accepted.append(answered)
                t = threading.Thread(target=_stream, args=(base, max_tokens, results, started, answered))
                t.start()
                threads.append(t)
            # SIGTERM must find every stream admitted: one still being read or preprocessed
            # would rightly get 503 shutting_down instead of the stream this test checks.
            for e in events if results is short else accepted:
                assert e.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            body = httpx.get(base + "/metrics").text
            if 'vlmserve:num_requests_waiting{model_name="qwen2_vl"} 2.0' in body:
                break
            time.sleep(0.02)

        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        r = httpx.get(base + "/ready", timeout=2)
        assert r.status_code == 503 and r.json()["reason"] == "draining"
        assert httpx.get(base + "/health", timeout=2).status_code == 200
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=5,
            json={"model": "qwen2_vl", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["x-should-retry"] == "true"

        for t in threads:
            t.join(DRAIN + 10)
            assert not t.is_alive(), "a stream hung through shutdown"
        rc = proc.wait(DRAIN + 10)
        elapsed = time.monotonic() - sent
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log[-3000:]
    assert elapsed < DRAIN + 5, elapsed
    assert "Traceback" not in log, log[-3000:]
    # Short streams finished inside the drain; endless ones (running or waiting) got one error event.
    assert len(short) == len(long_) == 4
    for lines in short:
        assert lines[0] == "status 200" and lines[-1] == "[DONE]", (lines[:2], lines[-3:])
        assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
    for lines in long_:
        assert lines[0] == "status 200" and len(lines) > 2, (lines[:2], lines[-3:])
        last = json.loads(lines[-1])
        assert "shutting down" in last["error"]["message"], last
        assert last["error"]["code"] == "worker_unavailable", last  # the server's doing: a client retries it
    assert "drain timeout: ending 4 request(s)" in log


@pytest.mark.parametrize("engine", ["--engine-process", "--no-engine-process"])
def test_exit_when_warm_exits_zero_once_no_warm_up_is_left(engine):
    """`--exit-when-warm` (preparing a machine's kernel cache): ready, then the idle warm-up, then
    a clean exit on its own, status 0, with the engine in its own process or in the server's."""
    proc = subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", "serve", str(MODELS / "qwen2_vl"), "--port", str(free_port())]
        + ["--exit-when-warm", engine],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = proc.stderr
    ready, tokenizer = log.index("ready: qwen2_vl"), log.index("structured outputs: tokenizer built")
    # The idle warm-up (the tokenizer last) may finish on the worker before the server logs ready,
    # on a busy machine: only the exit is bound to come after both.
    assert max(ready, tokenizer) < log.index("exiting (--exit-when-warm)") < log.index("Application shutdown complete")


def test_exit_when_warm_needs_the_warm_up():
    proc = subprocess.run(
        [sys.executable, "-m", "vlmserve.cli", "serve", str(MODELS / "qwen2_vl"), "--exit-when-warm", "--no-warmup"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "cannot go with --no-warmup" in proc.stderr
