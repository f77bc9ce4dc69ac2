"""bench/bench_advisor_gpu.py runs end to end on CPU (--dry-run: the same logic on a sleep-timed
fake loop) and writes the JSON the H200 run is read from; the figures are not judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_advisor_gpu.py"


def test_dry_run_writes_the_report(tmp_path: Path):
    """Short run -> advice, sweep, plain loop, table and $OUT/advisor.json, torch never imported."""
    probe = (
        "import runpy, sys; rc = runpy.run_path(sys.argv[1])['main'](sys.argv[2:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    args = ["--dry-run", "--short-rounds", "80", "--sweep-max", "3", "--sweep-rounds", "20"]
    env = {**os.environ, "OUT": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", probe, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "advised k=" in r.stdout and "plain loop:" in r.stdout
    out = json.loads((tmp_path / "advisor.json").read_text())
    assert [m["k"] for m in out["measured"]] == [1, 2, 3]
    assert 1 <= out["recommended_k"] <= 3 and out["advice"]["estimate"] is True
    assert out["advice"]["clock"] == "host" and out["advice"]["plain_step_source"] == "verify_fit"
    assert out["advice_measured_plain"]["plain_step_source"] == "measured"
    assert not out["advice_constant_k"]["identifiable"]
    assert out["ratio_vs_best"] <= 1.0 and out["plain_tokens_per_s"] > 0
