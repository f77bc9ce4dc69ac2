"""Dashboards as code: the committed JSON is what the generator writes, and it is wired the way
the stack needs (datasource variable, exemplars on latency panels, Jaeger behind trace ids)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "grafana"
BOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))


def _panels(board: dict) -> list[dict]:
    out = []
    for p in board["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def test_dashboard_json_is_fresh():
    """Regenerating from grafana/*.py gives the committed JSON byte for byte."""
    pytest.importorskip(
        "grafana_foundation_sdk", reason="grafana-foundation-sdk (dev dependency) not installed"
    )
    r = subprocess.run(
        [sys.executable, str(GRAFANA / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def test_k8s_generated_files_are_fresh():
    """deploy/k8s/generated/ matches exporters/fleet and deploy/prometheus/rules."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "k8s" / "render.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("path", BOARDS, ids=[p.name for p in BOARDS])
def test_dashboard_wiring(path: Path):
    """Variables for datasource/job/instance/family; every query goes through $datasource;
    panel ids unique; panels inside the 24-column grid; exemplars on for latency panels."""
    board = json.loads(path.read_text())
    names = [v["name"] for v in board["templating"]["list"]]
    assert names[:4] == ["datasource", "job", "instance", "family"], names
    assert board["templating"]["list"][0]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(board)]
    assert len(ids) == len(set(ids)) and 0 not in ids, ids
    for p in _panels(board):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert t["refId"], p["title"]
    latency = [
        p
        for p in _panels(board)
        if any("_seconds_bucket" in t.get("expr", "") for t in p.get("targets", []))
    ]
    needing = [p for p in latency if p["type"] in ("heatmap", "timeseries")]
    assert needing
    for p in needing:
        assert any(t.get("exemplar") for t in p["targets"]), (
            f"exemplars off on latency panel {p['title']!r}"
        )


def test_dashboard_covers_the_issue_list():
    """The panels the stack promises exist (titles are what users look for)."""
    titles = {p["title"] for b in BOARDS for p in _panels(json.loads(b.read_text()))}
    for want in (
        "Per-round wall distribution",
        "Round wall p50 / p90 / p99",
        "Phase share of round wall",
        "Verify sub-split (level 2)",
        "Acceptance rate",
        "Drafted, accepted and committed tokens per round",
        "Slow-round share",
        "First-token waterfall (mean per request)",
        "Free GPU memory before / after session setup",
        "Exporter drops and errors",
    ):
        assert want in titles, want
    kinds = {p["type"] for b in BOARDS for p in _panels(json.loads(b.read_text()))}
    assert "heatmap" in kinds


def test_waterfall_orders_every_first_token_phase():
    """The waterfall's field order names each SpecFirstTokenProf ms field exactly once."""
    records = pytest.importorskip("memra_obs.records")
    fields = [f[: -len("_ms")] for f in records.FIRST_TOKEN_MS_FIELDS]
    for b in BOARDS:
        for p in _panels(json.loads(b.read_text())):
            if p["title"].startswith("First-token waterfall"):
                org = next(t for t in p["transformations"] if t["id"] == "organize")
                order = [k for k in org["options"]["indexByName"] if k != "Time"]
                assert sorted(order) == sorted(fields), set(order) ^ set(fields)
                return
    pytest.fail("no waterfall panel")


def test_datasource_provisioning_links_exemplars_to_jaeger():
    """Prometheus exemplars' trace_id opens the Jaeger datasource; the uids line up."""
    docs = [
        yaml.safe_load(p.read_text())
        for p in (GRAFANA / "provisioning" / "datasources").glob("*.yaml")
    ]
    sources = {d["uid"]: d for doc in docs for d in doc["datasources"]}
    prom = next(d for d in sources.values() if d["type"] == "prometheus")
    jaeger = next(d for d in sources.values() if d["type"] == "jaeger")
    dest = prom["jsonData"]["exemplarTraceIdDestinations"]
    assert {"name": "trace_id", "datasourceUid": jaeger["uid"]}.items() <= dest[0].items(), dest
    assert prom.get("isDefault") is True


def test_datasource_time_interval_matches_scrape_interval():
    """Grafana's $__rate_interval is built from timeInterval: it must be the scrape interval."""
    prom_yml = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    docs = [
        yaml.safe_load(p.read_text())
        for p in (GRAFANA / "provisioning" / "datasources").glob("*.yaml")
    ]
    prom = next(d for doc in docs for d in doc["datasources"] if d["type"] == "prometheus")
    assert prom["jsonData"]["timeInterval"] == prom_yml["global"]["scrape_interval"]


def test_heatmap_cells_do_not_count_a_round_several_times():
    """A heatmap cell is one step wide; increase() over $__rate_interval (4 scrape intervals,
    wider than the step at the default 30m range) counts each round in ~4 cells."""
    import re as _re

    board = json.loads((ROOT / "grafana" / "dashboards" / "memra-spec.json").read_text())
    for p in board["panels"]:
        if p["type"] != "heatmap":
            continue
        for t in p["targets"]:
            assert not _re.search(r"increase\([^()]*\[\$__rate_interval\]\)", t["expr"]), (
                p["title"],
                t["expr"],
            )


def test_throughput_vs_k_says_it_is_one_loops_rate():
    """The advisor's tokens/s is E(k) / t_round(k): one loop's rate. `memra-obs demo
    --concurrency 4` showed ~590 at the current k beside a Tokens / s stat of ~1570, so the
    panel must say which it is, or a user reads k as costing 60% of the throughput."""
    board = json.loads((ROOT / "grafana" / "dashboards" / "memra-spec.json").read_text())
    (desc,) = [
        p["description"] for p in _panels(board) if p["title"] == "Throughput vs k (estimate)"
    ]
    assert "one loop's rate" in desc and "Tokens / s" in desc, desc


def test_throughput_vs_k_repeats_per_family_and_the_advice_is_held_over_10m():
    """With $family at its default All, the bars of every family shared each k (the x axis
    read 1,1,2,2,...); and the instant recommended k flipped 28-47 times in 5 minutes of a
    steady demo (neighbouring k within 1%): the panel shows its 10-minute median."""
    board = json.loads((ROOT / "grafana" / "dashboards" / "memra-spec.json").read_text())
    by_title = {p["title"]: p for p in _panels(board)}
    assert by_title["Throughput vs k (estimate)"]["repeat"] == "family"
    (var,) = [v for v in board["templating"]["list"] if v["name"] == "family"]
    assert var.get("multi") or var.get("includeAll")  # a repeat needs several values
    exprs = [t["expr"] for t in by_title["Recommended k (estimate) and current k"]["targets"]]
    assert "quantile_over_time(0.5, memra_spec_recommended_k{" in exprs[0]


def test_slow_round_share_says_how_many_of_a_tailed_workers_rounds_were_measured():
    """A worker read by memra-obs tail at trace level 1: every round past the logged rows
    carries its burst's mean wall, never slow: the panel read 0.8% where the worker had 3.3%,
    and nothing on the dashboard said why. It now plots the share measured one by one."""
    board = json.loads((ROOT / "grafana" / "dashboards" / "memra-spec.json").read_text())
    row = 'memra_obs_tail_rounds_total{job=~"$job", instance=~"$instance", source="row"}'
    (panel,) = [p for p in _panels(board) if p["title"] == "Slow-round share"
                and any(row in t["expr"] for t in p["targets"])]  # fmt: skip
    assert "MemraSpecSlowRoundShareRising" in panel["description"]  # the alert's own panel
    assert "memra-obs tail" in panel["description"]
