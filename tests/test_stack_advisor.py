"""The "Acceptance & k advisor" dashboard row and the per-position recording rules read the
series issue 15 names, and label every advisor number an estimate."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BOARD = ROOT / "grafana" / "dashboards" / "memra-spec.json"
RULES = ROOT / "deploy" / "prometheus" / "rules" / "memra-recording.rules.yml"
GAUGES = (
    "memra_spec_recommended_k",
    "memra_spec_estimated_speedup",
    "memra_spec_expected_tokens_per_round",
    "memra_spec_estimated_tokens_per_second",
)


def _row(title: str) -> list[dict]:
    panels = json.loads(BOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title)
    out = []
    for p in panels[start + 1 :]:
        if p["type"] == "row":
            break
        out.append(p)
    return out


def test_advisor_row_reads_the_issue_series():
    """The row shows acceptance by position and every advisor gauge; panels built on a gauge
    say "(estimate)" in their title; the throughput-vs-k bars mark the recommended k."""
    row = _row("Acceptance & k advisor")
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in row}
    text = " ".join(exprs.values())
    for name in (*GAUGES, "memra_spec_accepted_tokens_by_position_total"):
        assert name in text, name
    assert "memra_spec_drafted_tokens_by_position_total" in exprs["Acceptance by position"]
    for title, expr in exprs.items():
        if any(g in expr for g in GAUGES):
            assert "(estimate)" in title, title
    bars = next(p for p in row if p["title"] == "Throughput vs k (estimate)")
    assert bars["type"] == "barchart" and bars["options"]["xField"] == "k"
    # every worker's advised k (max by family marked one bar the others did not advise)
    assert 'count_values by (family) ("k", memra_spec_recommended_k{' in bars["targets"][1]["expr"]


def test_per_position_recording_rules():
    """job_family_position level, level:metric:operations names, ratio of the two rates."""
    rules = {
        r["record"]: r["expr"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    ratio = rules["job_family_position:memra_spec_acceptance_by_position:ratio_rate5m"]
    assert "job_family_position:memra_spec_accepted_tokens_by_position:rate5m" in ratio
    assert "job_family_position:memra_spec_drafted_tokens_by_position:rate5m" in ratio
    for kind in ("drafted", "accepted"):
        expr = rules[f"job_family_position:memra_spec_{kind}_tokens_by_position:rate5m"]
        assert expr.startswith("sum by (job, family, position) (rate(")
        assert f"memra_spec_{kind}_tokens_by_position_total[5m]" in expr
    assert (ROOT / "deploy" / "prometheus" / "tests" / "memra-advisor.test.yml").is_file()
