"""benchmarks/bench.py, the W1 load generator, against the tiny qwen2_vl server."""

from __future__ import annotations

import json
import sys
import time

import pytest

from support.helpers import ROOT

# load generator processes against the server
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the spawned load generators import it by name too
    import bench as module

    yield module
    sys.path.remove(str(ROOT / "benchmarks"))


def wait_ready(server) -> None:
    with server.client() as c:
        for _ in range(600):
            if c.get("/ready").status_code == 200:
                return
            time.sleep(0.1)
    raise TimeoutError("server not ready")


@pytest.mark.parametrize("processes", [1, 2])
def test_closed_loop_from_load_generator_processes(qwen_server, bench, tmp_path, processes):
    wait_ready(qwen_server)
    out = tmp_path / "w.json"
    code = bench.main(
        [
            "--url",
            qwen_server.base_url,
            "--concurrency",
            "3",
            "--max-tokens",
            "3",
            "--image-size",
            "56",
            "--prompt-words",
            "5",
            "--client-processes",
            str(processes),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    level = json.loads(out.read_text())["runs"][0]["levels"][0]
    assert level["ok"] == level["requests"] == 6
    assert level["client_processes"] == processes
    assert level["output_tokens_mean"] == 3
    sent = [row[0] for row in level["timeline"]]
    assert len(sent) == 6 and sent == sorted(sent) and sent[0] == 0.0
    # closed loop: every request ends within the level, and the level's wall covers the last one
    assert all(0 < ttft <= e2e for _, ttft, e2e in level["timeline"])
    assert max(s + e2e for s, _, e2e in level["timeline"]) <= level["wall_s"] + 1e-3
    assert level["output_tok_s"] == pytest.approx(18 / level["wall_s"])


def test_new_shape_probe_records_each_long_prompt_and_the_streams_gaps(qwen_server, bench):
    import asyncio

    import new_shape_probe

    wait_ready(qwen_server)
    records = asyncio.run(new_shape_probe.probe(qwen_server.base_url, [300, 300], streams=2, max_tokens=8))
    assert [r["status"] for r in records] == [200, 200]
    assert all(r["prompt_tokens"] > 300 for r in records)
    assert all(r["worst_gap_ms"] >= r["median_worst_gap_ms"] >= 0 for r in records)


def test_mixed_workload_repeats_its_requests_or_their_shapes_and_reports_each_pass(qwen_server, bench, tmp_path):
    settings = {"workload": "mixed", "image_size": 0, "prompt_words": 0, "max_tokens": 0}
    specs = [bench.request_spec(i, settings) for i in range(200)]
    assert specs[:20] == [bench.request_spec(i, settings) for i in range(20)]  # a second pass sends the same
    fresh = [bench.request_spec(i, settings | {"variant": 3}) for i in range(20)]  # same shapes, new content
    for old, new in zip(specs[:20], fresh):
        assert new["max_tokens"] == old["max_tokens"] and len(new["prompt"].split()) == len(old["prompt"].split())
        assert new["prompt"] != old["prompt"]
        assert (new["image"] is None) == (old["image"] is None) and (
            new["image"] is None or new["image"] != old["image"]
        )
        if new["image"] is not None:
            assert _png_size(new["image"]) == _png_size(old["image"])
    text_only = sum(s["image"] is None for s in specs) / len(specs)
    assert 0.05 < text_only < 0.3
    assert {s["max_tokens"] for s in specs} <= set(range(32, 257)) and len({s["prompt"] for s in specs}) > 50

    wait_ready(qwen_server)
    out = tmp_path / "mixed.json"
    args = ["--url", qwen_server.base_url, "--workload", "mixed", "--passes", "3", "--concurrency", "3"]
    assert bench.main([*args, "--new-content-from", "3", "--requests-per-level", "4", "--out", str(out)]) == 0
    levels = json.loads(out.read_text())["runs"][0]["levels"]
    assert [(lv["pass"], lv["new_content"]) for lv in levels] == [(1, False), (2, False), (3, True)]
    assert all(lv["ok"] == lv["requests"] == 4 for lv in levels)


def _png_size(uri: str) -> tuple[int, int]:
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).size


def test_multiturn_reports_reuse_across_turns_and_one_tower_run_per_image(qwen_server, bench, tmp_path):
    """benchmarks/multiturn.py: later turns report cached tokens; requests about one image at
    once run the vision tower once (the server's mm caches are on by default)."""
    import multiturn

    wait_ready(qwen_server)
    out = tmp_path / "m.json"
    args = ["--url", qwen_server.base_url, "--chats", "2", "--turns", "3", "--same-image", "4"]
    code = multiturn.main([*args, "--image-size", "84x56", "--max-tokens", "4", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    turns = result["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    # A new image: at most the template's text before it is reused.
    assert turns[0]["cached_tokens"] < turns[0]["prompt_tokens"] // 2
    assert all(t["cached_tokens"] > turns[0]["prompt_tokens"] // 2 for t in turns[1:])
    assert all(t["prompt_tokens"] > prev["prompt_tokens"] for prev, t in zip(turns, turns[1:]))
    # The server's phases per turn: turn 1 runs the vision tower; every turn prefills.
    assert turns[0]["vision_ms"] > 0 and all(t["prefill_forwards"] >= 1 and t["prefill_ms"] > 0 for t in turns)
    assert all(t["preprocess_ms"] > 0 and t["server_ttft_ms"] > 0 for t in turns)
    shared = result["same_image"]
    assert shared["feature_cache_queries"] == 4 and shared["vision_tower_runs"] == 1


def test_the_first_use_probe_sends_every_case_twice_and_records_both(qwen_server, tmp_path):
    """benchmarks/first_use_probe.py: every feature case answered, first and second times kept."""
    import subprocess

    wait_ready(qwen_server)
    out = tmp_path / "first_use.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "first_use_probe.py"), "--url", qwen_server.base_url]
        + ["--max-tokens", "4", "--out", str(out)],
        check=True,
        timeout=300,
    )
    results = json.loads(out.read_text())
    assert [r["case"] for r in results][:3] == ["greedy", "temperature", "top_p"] and len(results) >= 14
    assert all(r["first_s"] > 0 and r["second_s"] > 0 and r["built"] == [] for r in results)
    # Every case is answered; this fixture's chat template takes no tools (a 400 that says so).
    assert {r["case"]: r["status"] for r in results if r["status"] != 200} == {"tool_choice": 400}
