"""--preprocess-processes: the whole of a request's CPU work in spawned processes."""

from __future__ import annotations

import base64
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from support.helpers import MODELS, chat_body, data_uri, free_port, images, run, wait_ready
from support.server import start_server

# spawned preprocessing processes beside the server
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def process_server():
    server = start_server("qwen2_vl", preprocess_processes=2)
    server.state.admission.in_process_preprocess_limit = 0  # every request to the processes (what these test)
    yield server
    server.stop()


def _ask(server, body):
    with server.client() as c:
        return c.post("/v1/chat/completions", json=body)


def test_processes_answer_as_the_thread_pool_does(process_server, qwen_server):
    assert process_server.state.preprocess_processes is not None
    assert qwen_server.state.preprocess_processes is None
    uris = [data_uri(p) for p in images()[:2]]
    body = chat_body(qwen_server.model_id, "Compare the two pictures.", uris, max_tokens=12, temperature=0)
    by_threads, by_processes = _ask(qwen_server, body), _ask(process_server, body)
    assert by_threads.status_code == by_processes.status_code == 200, by_processes.text
    # cached_tokens depends on what each server saw before (the session server reuses earlier prompts)
    usage = [
        {k: v for k, v in r.json()["usage"].items() if k != "prompt_tokens_details"} for r in (by_processes, by_threads)
    ]
    assert usage[0] == usage[1]
    assert by_processes.json()["usage"]["prompt_tokens"] > 20  # the images' tokens are in it
    assert by_processes.json()["choices"][0]["message"] == by_threads.json()["choices"][0]["message"]


def _jobs(server, pool: str) -> float:
    return (
        server.state.metrics.registry.get_sample_value(
            "vlmserve:preprocess_requests_total", {"model_name": server.model_id, "pool": pool}
        )
        or 0.0
    )


def test_a_lone_request_stays_on_the_threads_and_a_burst_overflows_to_the_processes(process_server):
    state = process_server.state
    state.admission.in_process_preprocess_limit = 1
    try:
        before = _jobs(process_server, "threads"), _jobs(process_server, "processes")
        body = chat_body(process_server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=4, temperature=0)
        for _ in range(2):  # one at a time: each finds the thread pool idle
            assert _ask(process_server, body).status_code == 200
        assert (_jobs(process_server, "threads"), _jobs(process_server, "processes")) == (before[0] + 2, before[1])
        # While one request holds the thread pool's share, the next ones go to the processes.
        admission = state.admission
        assert [admission.reserve(1) for _ in range(3)] == [True, False, False]
        admission.end_job(True)
        admission.release_choices(1)
        assert admission.reserve(1) is True  # the share is free again
        for in_process in (True, False, False):
            admission.end_job(in_process)
            admission.release_choices(1)
        assert state.pending_requests == state.pending_choices == state.admission._in_process_jobs == 0
    finally:
        state.admission.in_process_preprocess_limit = 0


def test_a_bad_image_is_reported_from_the_process_as_a_400(process_server):
    garbage = "data:image/png;base64," + base64.b64encode(b"not a png at all" * 8).decode()
    r = _ask(process_server, chat_body(process_server.model_id, "What is this?", [garbage], max_tokens=4))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_image"
    assert error["param"] == "messages[0].content[0]"


def test_the_processes_outlive_a_ctrl_c_meant_for_the_server(process_server):
    # A terminal's Ctrl-C (or a service manager's SIGTERM) reaches the whole process group; the
    # server drains on it and needs its preprocessing meanwhile.
    children = multiprocessing.active_children()
    assert children
    for child in children:
        os.kill(child.pid, signal.SIGINT)
        os.kill(child.pid, signal.SIGTERM)
    body = chat_body(process_server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=4, temperature=0)
    assert _ask(process_server, body).status_code == 200
    assert all(child.is_alive() for child in children)


def test_a_killed_process_fails_its_request_and_a_new_pool_serves_the_next(process_server):
    body = chat_body(process_server.model_id, "Describe it.", [data_uri(images()[0])], max_tokens=4, temperature=0)
    assert _ask(process_server, body).status_code == 200
    children = multiprocessing.active_children()
    assert len(children) >= 2  # the pool's processes are this test process's children
    for child in children:
        os.kill(child.pid, signal.SIGKILL)
    for child in children:
        child.join(10)
    failed = _ask(process_server, body)
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "preprocess_failed"
    again = _ask(process_server, body)
    assert again.status_code == 200, again.text
    assert process_server.state.pending_requests == 0  # every reservation was released


def test_a_process_that_cannot_load_the_processor_fails_the_start_with_a_reason(tmp_path):
    from vlmserve.config import ServerConfig
    from vlmserve.inputs.pool import PreprocessProcesses

    pool = PreprocessProcesses(tmp_path / "no-model-here", 4096, ServerConfig(preprocess_processes=1), None)
    with pytest.raises(RuntimeError, match="preprocessing process failed to start"):
        run(pool.start())


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_no_process_outlives_the_server_after_a_preprocessing_process_was_killed():
    """Every worker holds its pool's queue open too: once a sibling died, the others used to
    wait on it forever after the server exited."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vlmserve.cli", "serve", str(MODELS / "qwen2_vl"), "--port", str(port)]
        + ["--preprocess-processes", "3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: set[int] = set()
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_ready(base)
        seen.update(_children(server.pid))
        spawned = sorted(p for p in seen if "spawn_main" in _cmdline(p))
        os.kill(spawned[1], signal.SIGKILL)  # a preprocessing process: the first spawned is the engine
        body = chat_body("qwen2_vl", "Hi", max_tokens=2)
        for _ in range(3):
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
            seen.update(_children(server.pid))
        seen.update(_children(server.pid))
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in seen if _alive(p)] == []
    finally:
        if server.poll() is None:
            server.kill()
        for pid in seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
