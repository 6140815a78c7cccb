"""Batch captioning client (vlmserve.caption) against fake OpenAI-shaped servers on 127.0.0.1
(against the real vlmserve server and --in-process: e2e/caption/test_caption.py)."""

from __future__ import annotations

import asyncio
import base64
import csv
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.caption import FAST, FIXTURE_IMAGES, SCRIPT, caption, read_jsonl


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_caption(data: bytes) -> str:
    return "cap-" + hashlib.sha256(data).hexdigest()[:12]


# ---- a fake OpenAI-compatible server whose behaviour the test controls ------------------------------
class FakeServer:
    """Caption = hash of the image bytes (data URI) or 'url:<url>'; records every request."""

    def __init__(
        self,
        model: str = "fake-vlm",
        delay: float = 0.0,
        fail_first: int = 0,
        fail_status: int = 503,
        retry_after: str | None = None,
        bad: set[str] = frozenset(),
        api_key: str | None = None,
    ):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.model, self.delay, self.fail_first, self.fail_status = model, delay, fail_first, fail_status
        self.retry_after, self.bad, self.api_key = retry_after, set(bad), api_key
        self.requests: list[dict] = []  # every chat request: {"url", "mime", "prompt", "model", "status", "caption"}
        self.lock = threading.Lock()

        async def models(request: Request):
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        async def chat(request: Request):
            body = await request.json()
            parts = body["messages"][-1]["content"]
            url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
            prompt = next(p["text"] for p in parts if p["type"] == "text")
            if url.startswith("data:"):
                header, b64 = url.split(",", 1)
                mime = header[5:].split(";")[0]
                caption = expected_caption(base64.b64decode(b64))
            else:
                mime, caption = None, "url:" + url
            entry = {
                "url": url if not url.startswith("data:") else None,
                "mime": mime,
                "prompt": prompt,
                "model": body.get("model"),
                "caption": caption,
                "max_tokens": body.get("max_tokens"),
                "temperature": body.get("temperature"),
            }
            with self.lock:
                self.requests.append(entry)
                failing = self.fail_first > 0
                if failing:
                    self.fail_first -= 1
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                entry["status"] = 401
                return JSONResponse({"error": {"message": "bad key", "type": "authentication_error"}}, 401)
            if failing:
                entry["status"] = self.fail_status
                headers = {"retry-after": self.retry_after} if self.retry_after is not None else {}
                return JSONResponse(
                    {"error": {"message": "busy", "type": "server_error"}}, self.fail_status, headers=headers
                )
            if caption in self.bad:
                entry["status"] = 400
                return JSONResponse(
                    {"error": {"message": "invalid image", "type": "invalid_request_error", "code": "invalid_image"}},
                    400,
                )
            if self.delay:
                await asyncio.sleep(self.delay)
            entry["status"] = 200
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "model": self.model,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": caption}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
                }
            )

        import uvicorn

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)

    def start(self) -> FakeServer:
        self.thread.start()
        while not self.uv.started:
            assert self.thread.is_alive()
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)

    def hits(self, caption: str | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.requests if caption is None or r["caption"] == caption)


@pytest.fixture
def fake():
    servers: list[FakeServer] = []

    def make(**kwargs) -> FakeServer:
        servers.append(FakeServer(**kwargs).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def make_pngs(folder: Path, n: int, nested: bool = True) -> dict[str, str]:
    """n distinct tiny PNGs (some in subfolders); returns {path: expected caption}."""
    from PIL import Image

    expected = {}
    for i in range(n):
        sub = folder / f"d{i % 3}" if nested and i % 2 else folder
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"img_{i:04d}.png"
        Image.new("RGB", (4 + i % 5, 4), (i % 256, (i * 7) % 256, (i // 256) * 40)).save(path)
        expected[str(path)] = expected_caption(path.read_bytes())
    (folder / "notes.txt").write_text("not an image")
    return expected


def spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_rows(path: Path, n: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the run did not write enough rows in time")


# ---- folders --------------------------------------------------------------------------------------------
def test_folder_of_200_pngs_one_row_per_image(tmp_path, fake):
    server = fake(delay=0.002)
    expected = make_pngs(tmp_path / "imgs", 200)
    out = tmp_path / "captions.jsonl"
    assert caption(tmp_path / "imgs", "--out", out, "--server", server.url, "--concurrency", "8", *FAST) == 0
    rows = read_jsonl(out)
    assert len(rows) == 200
    assert {r["path"]: r["caption"] for r in rows} == expected
    assert all(r["error"] is None and r["model"] == "fake-vlm" and r["server"] == server.url for r in rows)
    assert all(r["prompt_tokens"] == 10 and r["completion_tokens"] == 3 and r["latency_s"] >= 0 for r in rows)
    assert server.hits() == 200
    assert {r["mime"] for r in server.requests} == {"image/png"}
    assert {r["model"] for r in server.requests} == {"fake-vlm"}  # from GET /v1/models


def test_fixture_images_mime_types_and_options(tmp_path, fake):
    server = fake()
    out = tmp_path / "c.jsonl"
    assert (
        caption(
            FIXTURE_IMAGES,
            "-o",
            out,
            "--server",
            server.url + "/v1/",
            "--model",
            "m",
            "--prompt",
            "Alt text?",
            "--max-tokens",
            "7",
            "--temperature",
            "0",
            *FAST,
        )
        == 0
    )
    files = sorted(p for p in FIXTURE_IMAGES.iterdir() if p.is_file())
    rows = {r["path"]: r for r in read_jsonl(out)}
    assert set(rows) == {str(p) for p in files}
    for p in files:
        assert rows[str(p)]["caption"] == expected_caption(p.read_bytes())
    mimes = {"png": "image/png", "jpg": "image/jpeg", "gif": "image/gif", "webp": "image/webp"}
    assert sorted(r["mime"] for r in server.requests) == sorted(mimes[p.suffix[1:]] for p in files)
    assert {(r["prompt"], r["model"], r["max_tokens"], r["temperature"]) for r in server.requests} == {
        ("Alt text?", "m", 7, 0)
    }


def test_glob_and_existing_output_is_not_clobbered(tmp_path, fake):
    server = fake()
    expected = make_pngs(tmp_path / "imgs", 10, nested=False)
    out = tmp_path / "c.jsonl"
    assert caption(str(tmp_path / "imgs" / "img_000*.png"), "-o", out, "--server", server.url, *FAST) == 0
    assert {r["path"]: r["caption"] for r in read_jsonl(out)} == expected
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, *FAST) == 2  # exists: needs --resume
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--resume", *FAST) == 0
    assert server.hits() == 10  # nothing left to do
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--overwrite", "--limit", "3", *FAST) == 0
    assert len(read_jsonl(out)) == 3


# ---- interruption and resume ----------------------------------------------------------------------------
def _check_complete(out: Path, expected: dict[str, str]) -> None:
    rows = read_jsonl(out)
    assert len(rows) == len(expected), "duplicates or missing rows"
    assert {r["path"]: r["caption"] for r in rows} == expected


def test_sigint_midway_then_resume(tmp_path, fake):
    server = fake(delay=0.01)
    expected = make_pngs(tmp_path / "imgs", 200)
    out = tmp_path / "c.jsonl"
    proc = spawn(tmp_path / "imgs", "-o", out, "--server", server.url, "--concurrency", "4", *FAST)
    wait_rows(out, 40, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err
    partial = read_jsonl(out)  # every line whole and valid
    assert 40 <= len(partial) < 200
    assert len({r["path"] for r in partial}) == len(partial)
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--resume", *FAST) == 0
    _check_complete(out, expected)
    assert server.hits() <= 200 + 4 + 4  # only the abandoned in-flight requests were asked twice


def test_sigkill_and_truncated_last_line_then_resume(tmp_path, fake):
    server = fake(delay=0.01)
    expected = make_pngs(tmp_path / "imgs", 120)
    out = tmp_path / "c.jsonl"
    proc = spawn(tmp_path / "imgs", "-o", out, "--server", server.url, "--concurrency", "4", *FAST)
    wait_rows(out, 30, proc)
    proc.kill()
    proc.communicate(timeout=30)
    some_path = next(iter(expected))
    with open(out, "ab") as f:  # what a power cut mid-write leaves behind
        f.write(b'{"path": "' + some_path.encode() + b'", "capti')
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--resume", *FAST) == 0
    _check_complete(out, expected)
    # A resume of a complete file with a garbage tail only repairs it.
    with open(out, "ab") as f:
        f.write(b"\x00\x00garbage")
    hits = server.hits()
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--resume", *FAST) == 0
    assert server.hits() == hits
    _check_complete(out, expected)


def test_csv_output_with_partial_record_resumes(tmp_path, fake):
    server = fake()
    expected = make_pngs(tmp_path / "imgs", 20, nested=False)
    out = tmp_path / "c.csv"
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--limit", "12", *FAST) == 0
    with open(out, "ab") as f:
        f.write(b'imgs/x.png,,"a caption with\nan embedded newline an')  # cut mid-record
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--resume", *FAST) == 0
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {r["path"]: r["caption"] for r in rows} == expected
    assert server.hits() == 20
    assert rows[0]["prompt_tokens"] == "10" and rows[0]["error"] == ""


def test_csv_quotes_newlines_round_trip():
    from vlmserve.caption.output import encode_csv, read_csv

    header = (
        b"path,prompt,caption,model,finish_reason,prompt_tokens,completion_tokens,latency_s,server,attempts,error\n"
    )
    good = {"path": "a,b.png", "caption": 'two\nlines, "quoted"', "prompt_tokens": 5, "latency_s": 0.5}
    data = header + encode_csv(good) + encode_csv({"path": "bad.png", "caption": None, "error": "HTTP 400: x"})
    existing = read_csv(data)
    assert [r["caption"] for r in existing.rows] == [good["caption"]]
    assert existing.rows[0]["prompt_tokens"] == 5 and existing.failed == 1 and not existing.partial_tail
    cut = read_csv(data + encode_csv(good)[:-9])
    assert cut.partial_tail and len(cut.rows) == 1


# ---- several servers, retries, errors -------------------------------------------------------------------
def test_two_servers_share_the_work(tmp_path, fake):
    expected = make_pngs(tmp_path / "imgs", 200)
    a, b = fake(delay=0.005), fake(delay=0.005)
    out = tmp_path / "c.jsonl"
    assert caption(tmp_path / "imgs", "-o", out, "--server", a.url, "--server", b.url, "--concurrency", "4", *FAST) == 0
    rows = read_jsonl(out)
    assert {r["path"]: r["caption"] for r in rows} == expected
    assert a.hits() + b.hits() == 200
    assert a.hits() > 60 and b.hits() > 60  # each > 30%
    assert sum(r["server"] == a.url for r in rows) == a.hits()


def test_two_servers_retry_503_and_400_not_retried(tmp_path, fake):
    expected = make_pngs(tmp_path / "imgs", 100)
    bad_path, bad_caption = next(iter(expected.items()))
    a = fake(delay=0.005, bad={bad_caption})
    b = fake(delay=0.005, bad={bad_caption}, fail_first=6, retry_after="0")
    out = tmp_path / "c.jsonl"
    assert (
        caption(tmp_path / "imgs", "-o", out, "--server", a.url, "--server", b.url, "--concurrency", "4", *FAST) == 1
    )  # one image failed
    rows = read_jsonl(out)
    assert len(rows) == 100
    by_path = {r["path"]: r for r in rows}
    assert by_path[bad_path]["caption"] is None and "400" in by_path[bad_path]["error"]
    assert by_path[bad_path]["attempts"] == 1
    assert a.hits(bad_caption) + b.hits(bad_caption) == 1  # never retried
    ok = {p: c for p, c in expected.items() if p != bad_path}
    assert {r["path"]: r["caption"] for r in rows if not r["error"]} == ok
    assert sum(1 for r in b.requests if r["status"] == 503) == 6  # all retried, none recorded as errors
    assert {r["server"] for r in rows} == {a.url, b.url}
    # Resume retries the failed row (the image is still bad) and keeps one row per image.
    assert caption(tmp_path / "imgs", "-o", out, "--server", a.url, "--resume", *FAST) == 1
    rows = read_jsonl(out)
    assert len(rows) == 100 and len({r["path"] for r in rows}) == 100
    assert a.hits(bad_caption) + b.hits(bad_caption) == 2


def test_retries_exhausted_and_dead_server_tolerated(tmp_path, fake):
    expected = make_pngs(tmp_path / "imgs", 6, nested=False)
    down = fake(fail_first=10**6, fail_status=500)
    out = tmp_path / "c.jsonl"
    assert caption(tmp_path / "imgs", "-o", out, "--server", down.url, "--retries", "2", "--model", "m", *FAST) == 1
    rows = read_jsonl(out)
    assert len(rows) == 6 and all("HTTP 500" in r["error"] and r["attempts"] == 3 for r in rows)
    assert down.hits() == 18
    # A server that refuses connections: the healthy one takes the work.
    healthy = fake()
    dead = f"http://127.0.0.1:{_free_port()}"
    out2 = tmp_path / "d.jsonl"
    assert (
        caption(
            tmp_path / "imgs", "-o", out2, "--server", f"{dead},{healthy.url}", "--model", "m", "--retries", "20", *FAST
        )
        == 0
    )
    assert {r["path"]: r["caption"] for r in read_jsonl(out2)} == expected
    # Without --model the dead one is dropped at discovery; with only dead servers it is a usage error.
    out3 = tmp_path / "e.jsonl"
    assert caption(tmp_path / "imgs", "-o", out3, "--server", dead, "--server", healthy.url, *FAST) == 0
    assert {r["server"] for r in read_jsonl(out3)} == {healthy.url}
    assert caption(tmp_path / "imgs", "-o", tmp_path / "f.jsonl", "--server", dead, *FAST) == 2


def test_unauthorized_stops_the_run(tmp_path, fake):
    server = fake(api_key="secret")
    make_pngs(tmp_path / "imgs", 5, nested=False)
    out = tmp_path / "c.jsonl"
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, *FAST) == 2
    assert read_jsonl(out) == []  # nothing recorded: a resume with the right key does everything
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, "--api-key", "secret", "--resume", *FAST) == 0
    assert len(read_jsonl(out)) == 5


# ---- manifests and URLs ---------------------------------------------------------------------------------
def test_jsonl_and_csv_manifests_with_per_row_prompts(tmp_path, fake):
    server = fake()
    expected = make_pngs(tmp_path / "imgs", 6, nested=False)
    paths = sorted(expected)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "\n".join(
            json.dumps({"path": os.path.relpath(p, tmp_path), **({"prompt": f"P{i}"} if i % 2 else {})})
            for i, p in enumerate(paths[:3])
        )
        + "\n"
    )
    manifest_csv = tmp_path / "m.csv"
    with open(manifest_csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "prompt", "other"])
        for i, p in enumerate(paths[3:]):
            w.writerow([p, f"C{i}, with comma" if i != 1 else "", "x"])
    out = tmp_path / "c.jsonl"
    assert caption(manifest, manifest_csv, "-o", out, "--server", server.url, "--prompt", "DEFAULT", *FAST) == 0
    prompts = {r["caption"]: r["prompt"] for r in server.requests}
    want = {
        expected[paths[0]]: "DEFAULT",
        expected[paths[1]]: "P1",
        expected[paths[2]]: "DEFAULT",
        expected[paths[3]]: "C0, with comma",
        expected[paths[4]]: "DEFAULT",
        expected[paths[5]]: "C2, with comma",
    }
    assert prompts == want
    rows = read_jsonl(out)
    assert len(rows) == 6
    rel = {r["path"]: r for r in rows}
    assert rel[os.path.relpath(paths[1], tmp_path)]["prompt"] == "P1"  # path recorded as the manifest wrote it
    assert "prompt" not in rel[os.path.relpath(paths[0], tmp_path)]


def test_same_image_two_prompts_is_two_rows(tmp_path, fake):
    server = fake()
    expected = make_pngs(tmp_path / "imgs", 1, nested=False)
    (path,) = expected
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"path": path, "prompt": p}) + "\n" for p in ("short", "long", "short")))
    out = tmp_path / "c.jsonl"
    assert caption(manifest, "-o", out, "--server", server.url, *FAST) == 0
    assert sorted(r["prompt"] for r in read_jsonl(out)) == ["long", "short"]
    assert caption(manifest, "-o", out, "--server", server.url, "--resume", *FAST) == 0
    assert server.hits() == 2


def test_url_inputs_pass_through_unchanged(tmp_path, fake):
    server = fake()
    urls = ["http://images.example.com/a.png?x=1&y=%20", "https://cdn.example.org/b/c.jpg"]
    listing = tmp_path / "urls.txt"
    listing.write_text("# a comment\n" + "\n".join(urls) + "\n\n")
    out = tmp_path / "c.jsonl"
    assert caption(listing, "https://x.example/one.webp", "-o", out, "--server", server.url, *FAST) == 0
    sent = [r["url"] for r in server.requests]
    assert sorted(sent) == sorted(urls + ["https://x.example/one.webp"])
    assert {r["path"]: r["caption"] for r in read_jsonl(out)} == {u: "url:" + u for u in sent}


def test_missing_file_is_an_error_row_and_bad_input_is_usage_error(tmp_path, fake):
    server = fake()
    listing = tmp_path / "list.txt"
    listing.write_text("nope.png\n")
    out = tmp_path / "c.jsonl"
    assert caption(listing, "-o", out, "--server", server.url, *FAST) == 1
    (row,) = read_jsonl(out)
    assert row["path"] == "nope.png" and "cannot read" in row["error"] and server.hits() == 0
    assert caption(tmp_path / "missing_dir", "-o", tmp_path / "x.jsonl", "--server", server.url, *FAST) == 2


def test_helpers():
    from vlmserve.caption.client import normalize_server
    from vlmserve.caption.payload import sniff_mime
    from vlmserve.caption.retry import backoff_delay, parse_retry_after

    assert normalize_server("gpu1:8000/v1/") == "http://gpu1:8000"
    assert sniff_mime(b"\xff\xd8\xff\xe0....", "looks.png") == "image/jpeg"  # bytes win over the extension
    assert sniff_mime(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image/webp"
    assert parse_retry_after("3") == 3.0 and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert 2.0 <= backoff_delay(3, 1.0, 60.0) <= 4.0 and backoff_delay(10, 1.0, 5.0) <= 5.0
    assert backoff_delay(1, 0.01, 1.0, retry_after=2.0) == 2.0


def test_no_mlx_at_import():
    code = "import sys, vlmserve.caption, vlmserve.caption.cli; assert 'mlx' not in sys.modules, 'mlx imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- odd inputs: each image once, a row for every one, never a hang -------------------------------------
def test_a_symlink_loop_is_followed_once(tmp_path, fake):
    server = fake()
    expected = make_pngs(tmp_path / "imgs", 4, nested=False)
    (tmp_path / "imgs" / "sub").mkdir()
    os.symlink(tmp_path / "imgs", tmp_path / "imgs" / "sub" / "loop")
    out = tmp_path / "c.jsonl"
    assert caption(tmp_path / "imgs", "-o", out, "--server", server.url, *FAST) == 0
    assert {r["path"]: r["caption"] for r in read_jsonl(out)} == expected


def test_odd_paths_get_their_rows_and_resume_skips_them(tmp_path, fake):
    """A file name that is not UTF-8, a NUL in a manifest path (unopenable), and U+2028 in a
    CSV output's path: each gets one row; a resume neither redoes nor invents any."""
    from PIL import Image

    server = fake()
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name in (os.fsdecode(b"caf\xe9.png"), "sep\u2028x.png"):
        Image.new("RGB", (5, 4), (len(name), 9, 9)).save(folder / name)
    manifest = tmp_path / "list.jsonl"
    manifest.write_text(json.dumps({"path": "a\u0000b.png"}) + "\n")
    for out in (tmp_path / "c.jsonl", tmp_path / "c.csv"):
        assert caption(folder, manifest, "-o", out, "--server", server.url, "--timeout", "5", *FAST) == 1
        hits = server.hits()
        assert caption(folder, manifest, "-o", out, "--server", server.url, "--resume", *FAST) == 1
        assert server.hits() == hits + 0  # the two images are done; the unopenable path is retried and fails again
        from vlmserve.caption.output import load_existing

        existing = load_existing(out, "csv" if out.suffix == ".csv" else "jsonl")
        assert len(existing.rows) == 2 and not existing.corrupt and not existing.duplicates


def test_every_server_down_stops_the_run_after_give_up_after(tmp_path, fake):
    down = fake(fail_first=10**6, fail_status=503)
    make_pngs(tmp_path / "imgs", 6, nested=False)
    out = tmp_path / "c.jsonl"
    t0 = time.monotonic()
    argv = ["--server", down.url, "--model", "m", "--retries", "1000", "--give-up-after", "0.5", *FAST]
    assert caption(tmp_path / "imgs", "-o", out, *argv) == 2
    assert time.monotonic() - t0 < 20 and read_jsonl(out) == []  # nothing recorded: --resume redoes all


def test_manifest_rows_without_a_path_and_a_misnamed_column(tmp_path, fake, capsys):
    server = fake()
    expected = make_pngs(tmp_path / "imgs", 2, nested=False)
    manifest = tmp_path / "list.csv"
    rows = ["path,note", *(f"{p},x" for p in expected), ",no path here"]
    manifest.write_text("\n".join(rows) + "\n")
    out = tmp_path / "c.jsonl"
    assert caption(manifest, "-o", out, "--server", server.url, *FAST) == 0
    assert {r["path"] for r in read_jsonl(out)} == set(expected)
    assert "1 manifest rows without a path left out (" in capsys.readouterr().err
    bad = caption(manifest, "-o", tmp_path / "d.jsonl", "--path-column", "imgae", "--server", server.url, *FAST)
    assert bad == 2 and "no column 'imgae'" in capsys.readouterr().err


def test_a_data_uri_larger_than_csvs_default_cell_is_read(tmp_path, fake):
    import base64

    server = fake()
    data = os.urandom(120_000)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    manifest = tmp_path / "list.csv"
    manifest.write_text(f'path\n"{uri}"\n')  # quoted: the URI holds a comma
    out = tmp_path / "c.jsonl"
    assert caption(manifest, "-o", out, "--server", server.url, *FAST) == 0
    assert read_jsonl(out)[0]["caption"] == expected_caption(data)


@pytest.mark.parametrize("flag", ["--concurrency", "--timeout", "--give-up-after"])
def test_bad_numbers_are_usage_errors_in_every_mode(tmp_path, flag):
    for mode in ([], ["--ray", "local", "--in-process", "m"]):
        assert caption(tmp_path, "-o", tmp_path / "c.jsonl", flag, "-3", *mode) == 2
