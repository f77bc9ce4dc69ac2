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
    args += ["--k", "3", "1"]
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
    assert [r["short_run_k"] for r in out["runs"]] == [3, 1]
    for run in out["runs"]:
        assert 1 <= run["recommended_k"] <= 3 and 0 < run["ratio_vs_best"] <= 1.0
        assert run["advice"]["estimate"] is True and run["advice"]["clock"] == "host"
        assert run["advice"]["plain_step_source"] == "verify_fit"
    assert out["runs"][0]["estimated_speedup_measured_plain"] is not None
    assert not out["advice_constant_k"]["identifiable"] and out["plain_tokens_per_s"] > 0
