"""benchmarks/piece_lengths.py: each pair's three runs, both ways, on the tiny qwen2_vl model."""

from __future__ import annotations

import json
import subprocess
import sys

from support.helpers import ROOT


def test_each_pair_reports_three_runs_of_both_ways():
    out = subprocess.run(
        [sys.executable, "benchmarks/piece_lengths.py", "fixtures/models/qwen2_vl", "--pairs", "8:5", "16:20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["cached"], r["new"], r["way"]) for r in rows] == [
        (8, 5, "pieces"),
        (8, 5, "single"),
        (16, 20, "pieces"),
        (16, 20, "single"),
    ]
    assert all(r[k] > 0 for r in rows for k in ("first_ms", "second_ms", "third_ms"))
