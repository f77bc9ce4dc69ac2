"""bench/bench_tail.py still runs every stage (on a small input; the figures are not judged)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_tail


@pytest.mark.parametrize("extra", [[], ["--trace-only"]])
def test_bench_tail_runs_every_stage(capsys, extra):
    assert bench_tail.main(["--sessions", "12", "--repeat", "1", *extra]) == 0
    out = capsys.readouterr().out
    for stage in ("parse", "rebuild", "+prom ", "prom alone", "+prom+spans"):
        assert f"\n{stage}" in out, stage
    assert "the goal of 100,000 tagged lines/s" in out
    assert "+prom published every one of the input's" in out  # not a fast parse of nothing
