"""examples/: the README's loop, runnable as it is written there, publishes what it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from memra_obs.legacy import FirstTokenLine, PhaseLine, SummaryLine, parse_line

ROOT = Path(__file__).resolve().parent.parent


def test_the_minimal_loop_prints_its_lines_and_writes_its_spans(tmp_path):
    """``MEMRA_SPEC_TRACE=1 MEMRA_SPEC_PROF=1 python examples/minimal_loop.py`` (its docstring's
    command, with spans to a file): phase lines, one first-token profile and one round-log
    summary a request, and a session span each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_SPEC_TRACE="1", MEMRA_SPEC_PROF="1", MEMRA_OBS_SINKS="otel",
               MEMRA_OBS_SPANS_FILE=str(tmp_path / "spans.jsonl"), PYTHONPATH=str(ROOT))  # fmt: skip
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "minimal_loop.py"), "2"],
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    kinds = [type(parse_line(x)) for x in p.stderr.splitlines()]
    assert kinds.count(FirstTokenLine) == 2 and kinds.count(SummaryLine) == 2
    assert kinds.count(PhaseLine) >= 2 * 3  # 64 tokens at most 5 a round, 6 rounds a burst
    names = [s["name"] for line in (tmp_path / "spans.jsonl").read_text().splitlines()
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]
             for s in ss["spans"]]  # fmt: skip
    assert names.count("spec.session") == 2 and "spec.round" in names


def test_the_readme_points_at_it():
    assert "examples/minimal_loop.py" in (ROOT / "README.md").read_text()
