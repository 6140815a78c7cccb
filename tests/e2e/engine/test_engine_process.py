"""--engine-process: the MLX worker in a spawned process, the same server around it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.helpers import MODELS, chat_body, data_uri, free_port, images
from support.reference import mlx_vlm_text
from support.server import start_server

# the engine in a spawned process (or `vlmserve serve` in a subprocess)
pytestmark = pytest.mark.slow

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def process_server():
    server = start_server("qwen2_vl", engine_process=True)
    yield server
    process = server.engine.process
    server.stop()
    assert process.exitcode == 0  # stopped by the server, not killed


def _post(server, body):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(server, body) -> tuple[str, dict]:
    text, usage = "", None
    with (
        server.client() as c,
        c.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
                else:
                    usage = chunk["usage"]
    return text, usage


def _wait(predicate, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_runs_in_another_process(process_server):
    process = process_server.engine.process
    assert process.is_alive() and process.pid != os.getpid()
    with process_server.client() as c:
        assert c.get("/ready").status_code == 200
        assert c.get("/health").json() == {"status": "ok", "reason": None}


@pytest.mark.parametrize("image_index", [0, 1, None])
def test_greedy_matches_mlx_vlm_generate(process_server, qwen_server, image_index):
    """Same tokens as mlx_vlm.generate on the model (computed in this process's in-process server)."""
    paths = [] if image_index is None else [images()[image_index]]
    text = "Describe this image in detail." if paths else "Write a haiku about the sea."
    expected = mlx_vlm_text(qwen_server, text, paths, MAX_TOKENS)
    body = chat_body(process_server.model_id, text, [data_uri(p) for p in paths], max_tokens=MAX_TOKENS, temperature=0)
    out = _post(process_server, body)
    assert out["choices"][0]["message"]["content"] == expected
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    streamed, usage = _stream_text(process_server, body)
    assert streamed == expected
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # the text one now hits the prefix cache
        assert usage[key] == out["usage"][key]


def test_concurrent_requests_each_equal_alone(process_server):
    model = process_server.model_id
    bodies = [
        chat_body(
            model, f"Story number {i}.", [data_uri(images()[i % 2])], max_tokens=16, temperature=0, ignore_eos=True
        )
        for i in range(6)
    ]
    alone = [_post(process_server, b)["choices"][0]["message"]["content"] for b in bodies]

    async def together():
        async with httpx.AsyncClient(base_url=process_server.base_url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
        return [r.json()["choices"][0]["message"]["content"] for r in rs]

    assert asyncio.run(together()) == alone


def test_metrics_come_from_the_engine_process(process_server):
    def scrape():
        with process_server.client() as c:
            text = c.get("/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = scrape()
    _post(
        process_server,
        chat_body(process_server.model_id, "Hello", [data_uri(images()[0])], max_tokens=8, ignore_eos=True),
    )
    after = scrape()
    for name in (
        "vlmserve:decode_step_seconds_count",
        "vlmserve:request_queue_time_seconds_count",
        "vlmserve:vision_encode_seconds_count",
        "vlmserve:prefill_seconds_count",
    ):
        assert after[name] > before[name], name
    assert after["vlmserve:generation_tokens_total"] - before["vlmserve:generation_tokens_total"] == 8
    assert after["vlmserve:num_requests_running"] == 0


def test_thread_guard_holds_in_the_engine_process(process_server):
    _post(process_server, chat_body(process_server.model_id, "Hi", max_tokens=4))
    engine = process_server.engine
    _wait(lambda: engine.guard_calls > 0)  # the guard runs there and has seen MLX calls
    assert engine.guard_violations == []


def test_client_leaving_cancels_in_the_engine(process_server):
    body = chat_body(process_server.model_id, "Go on forever.", max_tokens=20000, ignore_eos=True, stream=True)
    engine = process_server.engine
    with process_server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"content"' in line and '"content": ""' not in line and '"content":""' not in line:
                break  # the first token: the request is decoding
        _wait(lambda: engine.num_running == 1)
    _wait(lambda: engine.num_running == 0 and engine.num_waiting == 0)


def test_engine_process_death_fails_streams_and_health():
    server = start_server("qwen2_vl", engine_process=True, warmup=False, engine_restarts=0)
    try:
        engine = server.engine
        # Ready without warm-up: the KV budget's blocks are reported from the start (not 0 free
        # until the engine's first report, which an autoscaler would read as full).
        assert engine.cache_gauges().kv_blocks_total > 0
        lines: list[str] = []
        body = chat_body(server.model_id, "Go on.", max_tokens=20000, ignore_eos=True, stream=True)
        with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 3:
                        os.kill(engine.process.pid, signal.SIGKILL)
        error = json.loads(lines[-1])["error"]
        assert error["message"] == "the inference worker stopped unexpectedly"
        assert error["code"] == "worker_unavailable"  # the server's failure, not the request's
        with server.client() as c:
            r = c.get("/health")  # dead, then (no restarts allowed) given up on
            assert r.status_code == 503 and r.json()["reason"] in (
                "inference worker died",
                "engine could not be restarted",
            )
            r = c.post("/v1/chat/completions", json=chat_body(server.model_id, "Hi", max_tokens=4))
            assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
    finally:
        server.stop()


def test_a_dead_engine_is_started_again_and_served_after_warm_up():
    server = start_server("qwen2_vl", engine_process=True, warmup=True)
    try:
        first = server.engine.process.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        with server.client() as c:
            saw_not_ready = False
            while time.monotonic() < deadline:
                if c.get("/ready").status_code == 503:
                    saw_not_ready = True
                elif saw_not_ready:
                    break
                time.sleep(0.05)
            assert saw_not_ready and c.get("/ready").status_code == 200
            r = c.post("/v1/chat/completions", json=chat_body(server.model_id, "Hi", max_tokens=3))
            assert r.status_code == 200, r.text
        assert server.engine.process.pid != first
    finally:
        server.stop()


def test_an_engine_that_cannot_be_started_again_stops_the_server():
    server = start_server("qwen2_vl", engine_process=True, warmup=False, engine_restarts=1)
    fatal = threading.Event()
    server.state.stop_serving = fatal.set
    try:
        # The next engine fails to load: its model directory is gone.
        server.state.config = dataclasses.replace(server.state.config, model="/nonexistent/model")
        os.kill(server.engine.process.pid, signal.SIGKILL)
        assert fatal.wait(60)
        assert server.state.load_error is not None
    finally:
        server.stop()


def test_engine_death_gives_waiting_requests_a_503_they_may_retry():
    """A request the server could not finish is retried elsewhere by clients (x-should-retry), never a 500."""
    import threading
    import time

    server = start_server("qwen2_vl", engine_process=True, warmup=False)
    try:
        engine = server.engine
        body = chat_body(server.model_id, "Go on.", max_tokens=20000, ignore_eos=True)

        def kill_when_running():
            deadline = time.monotonic() + 60
            while engine.num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            os.kill(engine.process.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_running)
        killer.start()
        with server.client() as c:
            r = c.post("/v1/chat/completions", json=body)
        killer.join()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "worker_unavailable"
        assert r.headers["x-should-retry"] == "true"
        with server.client() as c:
            metrics = c.get("/metrics").text
        running = [line for line in metrics.splitlines() if line.startswith("vlmserve:num_requests_running")]
        assert running and float(running[0].split()[-1]) == 0  # not the count before the death
    finally:
        server.stop()


def test_load_failure_in_the_engine_process_names_the_reason(tmp_path):
    from vlmserve.config import ServerConfig
    from vlmserve.entrypoints.openai.app import ServerState

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(MODELS / "qwen2_vl"):
        if name != "model.safetensors":
            (broken / name).write_bytes((MODELS / "qwen2_vl" / name).read_bytes())
    state = ServerState(ServerConfig(model=str(broken), engine_process=True, warmup=False))

    async def start():
        try:
            await state.start()
        finally:
            await state.engine.stop()

    with pytest.raises(RuntimeError, match="safetensors"):
        asyncio.run(start())
    assert state.engine.process.exitcode is not None  # nothing left running


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads children from Linux's /proc")
def test_engine_process_exits_when_the_server_is_killed():
    """No orphan holding the model: a server killed with SIGKILL closes the pipe, and its engine stops."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlmserve.cli", "serve", str(MODELS / "qwen2_vl"), "--port", str(port), "--no-warmup"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def ready() -> bool:
            assert proc.poll() is None, "the server exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        _wait(ready, 90)
        children = set()
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
        assert children, "the engine runs in a child process by default"
        proc.kill()
        proc.wait(10)
        _wait(lambda: all(_gone(pid) for pid in children), 30)
    finally:
        if proc.poll() is None:
            proc.kill()


_SERVING_SIDE = """
import sys
import threading
from vlmserve.entrypoints.openai.app import ServerState
from vlmserve.config import ServerConfig
from vlmserve.models.processor import load_processor
state = ServerState(ServerConfig(model=sys.argv[1], engine_process=True))
load_processor(sys.argv[1])
print(sorted(m for m in sys.modules if m in {"vlmserve.engine.inprocess", "vlmserve.engine.sched.scheduler",
                                               "vlmserve.models.generic", "vlmserve.engine.worker"}))
"""


def test_serving_side_never_imports_the_engine():
    # Beside an engine process the HTTP process only preprocesses: no model, scheduler or worker.
    out = subprocess.run(
        [sys.executable, "-c", _SERVING_SIDE, str(MODELS / "qwen2_vl")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


class _Recording:
    """The client's outgoing queue, recording what goes to the engine process."""

    def __init__(self, inner):
        self.inner, self.sent = inner, []

    def put(self, message):
        self.sent.append(message)
        self.inner.put(message)

    def get(self):
        return self.inner.get()


def test_the_choices_of_one_request_send_its_inputs_once(process_server, monkeypatch):
    from vlmserve.engine import messages as msg

    client = process_server.engine
    outgoing = _Recording(client._outgoing)
    monkeypatch.setattr(client, "_outgoing", outgoing)
    body = chat_body(process_server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=8, temperature=0)
    choices = _post(process_server, {**body, "n": 3})["choices"]
    assert len(choices) == 3 and len({c["message"]["content"] for c in choices}) == 1  # greedy: all alike
    adds = [m for m in outgoing.sent if isinstance(m, msg.AddRequest)]
    assert len(adds) == 3 and len({a.inputs_key for a in adds}) == 1
    assert [a.prepared is not None for a in adds] == [True, False, False]  # the pixels crossed once
    released = [m.inputs_key for m in outgoing.sent if isinstance(m, msg.ReleaseInputs)]
    assert released == [adds[0].inputs_key] and client._inputs == {}


def test_an_image_sent_again_crosses_to_the_engine_once(process_server, monkeypatch):
    """Its pixel arrays go with the first request only (held_pixels.py); later ones, another
    question or a later turn about it, answer as when they carried them."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from vlmserve.engine import messages as msg
    from vlmserve.engine.held_pixels import HeldPixels

    client = process_server.engine
    outgoing = _Recording(client._outgoing)
    monkeypatch.setattr(client, "_outgoing", outgoing)
    buffer = io.BytesIO()  # pixels no other test sends
    Image.fromarray(np.random.default_rng(11).integers(0, 256, (60, 90, 3), dtype=np.uint8)).save(buffer, "PNG")
    image = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    ask = [chat_body(process_server.model_id, q, [image], max_tokens=8, temperature=0) for q in ("What?", "Why?")]
    first, second, again = (_post(process_server, b)["choices"][0]["message"]["content"] for b in ask + ask[:1])
    adds = [m for m in outgoing.sent if isinstance(m, msg.AddRequest)]
    assert [a.pixels_held for a in adds] == [False, True, True]
    assert [bool(HeldPixels.pixels(a.prepared.model_inputs)) for a in adds] == [True, False, False]
    assert "image_grid_thw" in adds[1].prepared.model_inputs  # what is not pixels travels each time
    assert again == first and second  # the held pixels answer as the sent ones


def test_a_hung_engine_ends_its_requests_refuses_new_ones_and_does_not_block_shutdown():
    """SIGSTOP on the engine process: past --stall-timeout, in-flight requests end with a retryable
    error and new ones get a retryable 503; once it runs again, requests are served; and a
    server whose engine hangs still shuts down."""
    import time

    server = start_server("qwen2_vl", engine_process=True, warmup=False, stall_timeout=1.0, drain_timeout=1.0)
    stopped = False
    try:
        pid = server.engine.process.pid
        lines: list[str] = []
        body = chat_body(server.model_id, "Go on.", max_tokens=20000, ignore_eos=True, stream=True)
        t0 = time.monotonic()
        with server.client(timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 3:
                        os.kill(pid, signal.SIGSTOP)
                        stopped, t0 = True, time.monotonic()
        assert time.monotonic() - t0 < 10
        error = json.loads(lines[-1])["error"]
        assert error["code"] == "worker_unavailable" and "stalled" in error["message"]
        with server.client() as c:
            r = c.post("/v1/chat/completions", json=chat_body(server.model_id, "Hi", max_tokens=2))
            assert r.status_code == 503 and r.headers["x-should-retry"] == "true"
            os.kill(pid, signal.SIGCONT)
            stopped = False
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                r = c.post("/v1/chat/completions", json=chat_body(server.model_id, "Hi", max_tokens=2))
                if r.status_code == 200:
                    break
                time.sleep(0.2)
            assert r.status_code == 200, r.text
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < 1.0 + 5.0 + 10.0  # drain timeout + the engine's answer + the reaping
        assert not server.thread.is_alive()
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        server.stop()
