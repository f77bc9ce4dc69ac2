"""promtool on deploy/prometheus: the config, the rules, and the rules' unit tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROM = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found (apt-get install prometheus)"
)


def promtool(*args: str) -> str:
    r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=PROM)
    assert r.returncode == 0, f"promtool {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def test_check_config():
    """prometheus.yml is valid and its rule_files glob finds the rule files."""
    out = promtool("check", "config", "prometheus.yml")
    n = len(list((PROM / "rules").glob("*.rules.yml")))
    assert f"SUCCESS: {n} rule files found" in out, out


def test_check_rules():
    """Every rule file parses and its expressions are valid PromQL."""
    promtool("check", "rules", *sorted(str(p) for p in (PROM / "rules").glob("*.rules.yml")))


def test_rule_unit_tests():
    """The alert and recording-rule unit tests pass (each alert fires, and only, when meant)."""
    tests = sorted(str(p) for p in (PROM / "tests").glob("*.test.yml"))
    assert tests
    promtool("test", "rules", *tests)


def test_every_alert_has_a_unit_test():
    """No alert goes untested: each alertname appears in an alert_rule_test."""
    import yaml

    alerts = {
        r["alert"]
        for f in (PROM / "rules").glob("*.rules.yml")
        for g in yaml.safe_load(f.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tested = {
        t["alertname"]
        for f in (PROM / "tests").glob("*.test.yml")
        for case in yaml.safe_load(f.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
        if t.get("exp_alerts")
    }
    assert alerts <= tested, f"alerts never seen firing in a test: {sorted(alerts - tested)}"


def test_every_alert_names_a_readme_section_as_its_runbook():
    """Each alert's `runbook` annotation names a section the README has (the project publishes
    no URL, so a runbook_url would be made up), in the form `README.md, section "TITLE"`."""
    import re

    import yaml

    readme = (PROM.parent.parent / "README.md").read_text()
    sections = {m.group(1).strip() for m in re.finditer(r"^#{2,4} (.+)$", readme, re.M)}
    for f in (PROM / "rules").glob("*.rules.yml"):
        for g in yaml.safe_load(f.read_text())["groups"]:
            for r in g["rules"]:
                if "alert" not in r:
                    continue
                runbook = r.get("annotations", {}).get("runbook", "")
                m = re.fullmatch(r'README\.md, section "(.+)"', runbook)
                assert m, f"{r['alert']}: runbook {runbook!r}"
                assert m.group(1) in sections, f"{r['alert']}: no README section {m.group(1)!r}"


#: Dashboard panels whose queries deploy/prometheus/tests/memra-dashboard.test.yml runs (full
#: titles: "Acceptance" is also the start of "Acceptance rate", and a row's title).
DASHBOARD_PANELS_TESTED = (
    "First-token waterfall (mean per request)",
    # The idle-worker case: a ratio, a ratio with group_left, a mean and two quantiles read
    # "No data" (no sample), not NaN, while nothing moves.
    "Acceptance",
    "Phase share of round wall",
    "Mean phase time per round",
    "Round p99",
    "Round wall p99 by worker",
    "Verify sub-split (level 2)",  # a level-1 worker beside a level-2 one: no verify of its own
)
#: Grafana's variables as a user leaves them (All), and the range and rate interval (4 scrape
#: intervals of 1m) those tests use.
GRAFANA_VARS = {
    "$job": ".*",
    "$instance": ".*",
    "$family": ".*",
    "$__range": "30m",
    "$__rate_interval": "4m",
}


def test_dashboard_queries_under_unit_test_are_the_dashboards():
    """memra-dashboard.test.yml runs the committed dashboard's own queries, not a stale copy
    (the first-token waterfall's bars: per request, so the unindented ones add up to TTFT; the
    ratios and quantiles of an idle worker: no sample rather than 0/0 = NaN)."""
    import json

    import yaml

    board = json.loads(
        (PROM.parent.parent / "grafana" / "dashboards" / "memra-spec.json").read_text()
    )
    cases = yaml.safe_load((PROM / "tests" / "memra-dashboard.test.yml").read_text())["tests"]
    tested = [t["expr"] for case in cases for t in case.get("promql_expr_test", [])]
    for title in DASHBOARD_PANELS_TESTED:
        (panel,) = (p for p in board["panels"] if p["type"] != "row" and p["title"] == title)
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert any(expr in t for t in tested), (title, expr)
