"""The README's main job end to end: `memra-obs demo` on the embedded defaults publishes
the legacy lines, /metrics and the span file; the README starts with the two commands."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from memra_obs.legacy import FirstTokenLine, PhaseLine, VerifyLine, parse_line

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_starts_with_the_two_commands():
    """The first code block holds exactly the main job and the test suite, and both exist."""
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    cmds = [line.split("#")[0].strip() for line in block]
    assert cmds == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    for c in cmds:
        assert (ROOT / c.split()[1]).is_file()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_demo_publishes_lines_metrics_and_spans(tmp_path):
    """Embedded defaults: stderr lines that parse, /metrics with exemplars, OTLP-JSON spans."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env["MEMRA_OBS_METRICS_ADDR"] = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "memra_obs.cli", "demo", "--duration", "6", "--seed", "3"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        body = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "memra_spec_rounds_total{" not in body:
            time.sleep(0.5)
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/metrics",
                    headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                )
                body = urllib.request.urlopen(req, timeout=2).read().decode()
            except OSError:
                continue
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert 'memra_spec_rounds_total{family="glm5"}' in body
    assert "# {" in body and "trace_id=" in body, "exemplars in the OpenMetrics exposition"
    kinds = {type(parse_line(line)).__name__ for line in err.splitlines() if line.startswith("[")
             and not line.startswith("[memra-obs]")}  # fmt: skip
    assert {PhaseLine.__name__, VerifyLine.__name__, FirstTokenLine.__name__} <= kinds
    assert "[memra-obs] demo done: sessions=" in err
    spans = (tmp_path / "memra-obs-spans.jsonl").read_text().splitlines()
    assert spans
    names = {
        s["name"]
        for line in spans
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    }
    assert {"spec.session", "spec.burst", "spec.round", "spec.verify", "spec.first_token"} <= names
