"""A start-up users can watch: the log names each phase in order, with its counts and times."""

from __future__ import annotations

import logging
import re
import time

import httpx

from support.server import start_server

PHASES = (
    r"starting the engine \(in this process\)",
    r"loading weights: \S+ \(qwen2_vl\)",
    r"loaded weights in \d+\.\d s: \d+\.\d\d GB on the device",
    r"KV budget: \d+\.\d\d GB, \d+ blocks of \d+ positions \(\d+ tokens\)",
    r"warm-up 1/(?P<jobs>\d+): warmup-0 in \d+\.\d\d s",
    r"warm-up generations: (?P<done>\d+) in \d+\.\d s",
    r"ready: \S+ \(qwen2_vl\) in \d+\.\d\d s",
)


def test_start_up_logs_each_phase_in_order_with_counts_and_times(caplog):
    caplog.set_level(logging.INFO, logger="vlmserve")
    server = start_server("qwen2_vl")
    try:
        deadline = time.monotonic() + 120
        while httpx.get(f"{server.base_url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.05)
        messages = [record.getMessage() for record in caplog.records]
    finally:
        server.stop()
    found, at = {}, 0
    for phase in PHASES:
        matches = ((i, re.search(phase, message)) for i, message in enumerate(messages[at:], at))
        hit = next(((i, match) for i, match in matches if match), None)
        assert hit is not None, f"no line matching {phase!r} after line {at} of {messages}"
        at = hit[0] + 1
        found.update(hit[1].groupdict())
    assert int(found["jobs"]) == int(found["done"]) > 1  # the counted warm-up is the one that ran
