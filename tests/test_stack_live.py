"""The dashboards and rules against real data: `memra-obs demo` scraped by a real Prometheus.

Every PromQL expression of every generated dashboard panel (read from the committed JSON, with
the template variables resolved the way Grafana resolves them) and every rule of
deploy/prometheus/rules must return data; a panel with no data fails here. Also: exemplars
carry trace ids that lead to spans the replay pipeline can read.

Needs the `prometheus` binary (Debian's `prometheus` package) and `memra-obs demo`; skipped
only when one of them is missing. Every wait is bounded and every process is killed at the end.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from polling import wait_for

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.rules.yml"))
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

SCRAPE_S = 1  # the live Prometheus scrapes and evaluates every second
CONVERGE_S = 75  # how long the data may take to fill every panel and rule
DEMO_S = 240  # the demo's own upper bound, should teardown never run
LEGACY = ("[glm5-phase", "[spec-prof")  # the demo's legacy stderr lines: noise in a failure


def _demo_missing() -> str | None:
    for mod in ("memra_obs.prom", "memra_obs.demo", "memra_obs.cli"):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not importable yet"
        except ImportError as exc:
            return f"{mod} is not importable yet ({exc})"
    return None


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        PROMETHEUS is None, reason="prometheus binary not found (apt-get install prometheus)"
    ),
    pytest.mark.skipif(_demo_missing() is not None, reason=str(_demo_missing())),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The demo and a Prometheus scraping it, all children of the test process.

    ``in-process``: one `memra-obs demo` serving its own /metrics and writing its own spans.
    ``agent``: the compose topology without Docker: two demo workers in agent mode writing
    rings, one `memra-obs agent` publishing them (/metrics with a `worker` label, the spans).
    """

    def __init__(self, tmp: Path, mode: str) -> None:
        self.tmp = tmp
        self.mode = mode
        self.metrics_port = _free_port()
        self.prom_port = _free_port()
        self.spans_file = tmp / "memra-obs-spans.jsonl"
        self.workers: list[subprocess.Popen] = []
        self.agent: subprocess.Popen | None = None
        self.prom: subprocess.Popen | None = None
        self._logs: list = []
        self.t0 = time.time()

    # -- processes -------------------------------------------------------------------------
    def _spawn(self, log: str, args: list[str], **env_over: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MEMRA_"))}
        env.update(env_over)
        self._logs.append((self.tmp / f"{log}.err").open("wb"))
        return subprocess.Popen(
            [sys.executable, "-m", "memra_obs.cli", *args],
            cwd=self.tmp,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self._logs[-1],
        )

    def start(self) -> None:
        addr = f"127.0.0.1:{self.metrics_port}"
        demo = ["demo", "--duration", str(DEMO_S)]
        if self.mode == "agent":
            rings = self.tmp / "rings"
            rings.mkdir()
            ring_env = {"MEMRA_OBS_AGENT": str(rings)}
            self.agent = self._spawn(
                "agent",
                ["agent"],
                **ring_env,
                MEMRA_OBS_METRICS_ADDR=addr,
                MEMRA_OBS_SPANS_FILE=str(self.spans_file),
                MEMRA_OBS_SPANS_FILE_MAX_BYTES="0",  # every exemplar's trace stays on disk
            )
            for w in ("0", "1"):
                worker_env = {**ring_env, "MEMRA_OBS_METRICS_ADDR": "", "MEMRA_OBS_WORKER": w}
                self.workers.append(self._spawn(f"worker-{w}", demo, **worker_env))
        else:
            self.workers.append(
                self._spawn(
                    "demo",
                    demo,
                    MEMRA_OBS_METRICS_ADDR=addr,
                    MEMRA_OBS_SPANS_FILE=str(self.spans_file),
                    MEMRA_OBS_SPANS_FILE_MAX_BYTES="0",  # every exemplar's trace stays on disk
                )
            )
        wait_for("the demo's /metrics", lambda: self._get(f"{self.metrics_url}/metrics"), 30)

        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "storage": {"exemplars": {"max_exemplars": 100000}},
            "rule_files": [str(p) for p in RULE_FILES],
            "scrape_configs": [
                {"job_name": f"memra-{self.mode}", "static_configs": [{"targets": [addr]}]},
            ],
        }
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._logs.append((self.tmp / "prometheus.err").open("wb"))
        self.prom = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.prom_port}",
                "--enable-feature=exemplar-storage",
                "--log.level=warn",
            ],
            cwd=self.tmp,
            stdout=subprocess.DEVNULL,
            stderr=self._logs[-1],
        )
        wait_for("Prometheus to be ready", lambda: self._get(f"{self.prom_url}/-/ready"), 30)
        self.t0 = time.time()

    @staticmethod
    def _end(proc: subprocess.Popen | None, sig: int) -> None:
        """Signal, a bounded wait, then kill."""
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def stop_demo(self) -> None:
        """Workers first (SIGINT: the demo's Ctrl-C path flushes), then the agent (SIGTERM:
        drains the rings, flushes the spans)."""
        for w in self.workers:
            if w.poll() is None:
                w.send_signal(signal.SIGINT)
        for w in self.workers:
            self._end(w, signal.SIGINT)
        self._end(self.agent, signal.SIGTERM)

    def stop(self) -> None:
        self.stop_demo()
        self._end(self.prom, signal.SIGTERM)
        for f in self._logs:
            f.close()

    # -- HTTP ------------------------------------------------------------------------------
    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def prom_url(self) -> str:
        return f"http://127.0.0.1:{self.prom_port}"

    @staticmethod
    def _get(url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read()

    def api(self, path: str, **params) -> dict:
        """GET a Prometheus API path; returns `data`; raises ValueError with the error text."""
        url = f"{self.prom_url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            body = json.loads(self._get(url))
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def logs(self) -> str:
        """The end of both processes' logs, without the demo's legacy trace lines."""
        out = []
        for p in sorted(self.tmp.glob("*.err")):
            name = p.name
            if p.exists():
                keep = [
                    ln
                    for ln in p.read_text(errors="replace").splitlines()
                    if not ln.startswith(LEGACY)
                ]
                out.append(f"--- {name} (tail) ---\n" + "\n".join(keep[-30:]))
        return "\n".join(out)


@pytest.fixture(scope="module", params=["in-process", "agent"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A running demo scraped every second by a Prometheus with the project's rules loaded."""
    s = Stack(tmp_path_factory.mktemp(f"stack-{request.param}"), request.param)
    try:
        s.start()
        yield s
    finally:
        s.stop()


# -- what Grafana would send -----------------------------------------------------------------
def dashboard_targets() -> list[tuple[str, str, dict]]:
    """(dashboard file, panel title, target) for every Prometheus target of every panel."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        panels = list(board.get("panels", []))
        for p in list(panels):
            panels += p.get("panels", [])  # a collapsed row keeps its panels inside it
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((path.name, p.get("title", "?"), t))
    return out


def query_variables(path: Path) -> list[tuple[str, str, str]]:
    """(name, selector, label) of each `label_values(selector, label)` query variable."""
    board = json.loads(path.read_text())
    out = []
    for v in board.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v["query"] if isinstance(v["query"], str) else v["query"].get("query", "")
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
        assert m, f"{path.name}: variable {v['name']} has a query this test cannot run: {q!r}"
        out.append((v["name"], m.group(1), m.group(2)))
    return out


def substitute(expr: str, variables: dict[str, str], window_s: int) -> str:
    """Grafana's interpolation: template variables and the $__ built-ins for a 1s scrape."""
    # $__rate_interval = max($__interval + scrape interval, 4 * scrape interval) with the
    # datasource's timeInterval = the scrape interval; $__interval is 1s for these ranges.
    builtins = {
        "__rate_interval": f"{max(1 + SCRAPE_S, 4 * SCRAPE_S)}s",
        "__interval": "1s",
        "__range": f"{window_s}s",
    }
    for name, value in {**builtins, **variables}.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, f"unresolved variable in {expr}"
    return expr


def resolve_variables(stack: Stack, path: Path, all_values: bool) -> dict[str, str]:
    """Each query variable's value: "All" (its allValue, `.*`) or every value it lists,
    formatted as Grafana formats a multi-value regex, `(a|b)`; earlier values feed later queries."""
    resolved: dict[str, str] = {}
    for name, selector, label in query_variables(path):
        values = stack.api(
            f"label/{label}/values", **{"match[]": substitute(selector, resolved, 60)}
        )
        if not values:
            raise ValueError(f"{path.name}: variable ${name} ({selector}, {label}) lists no value")
        resolved[name] = ".*" if all_values else "(" + "|".join(map(_regex_escape, values)) + ")"
    return resolved


def _regex_escape(value: str) -> str:
    """Grafana's escaping of a value put in a Prometheus regex matcher: a regex escape, itself
    escaped for the PromQL string (so `a.b` becomes `a\\\\.b` in the query text)."""
    return re.sub(r"([\\$^*{}\[\]'+?.()|])", r"\\\\\1", value)


def has_data(result: dict) -> bool:
    """True when a query result holds at least one finite sample (what a panel would draw)."""
    kind, series = result["resultType"], result["result"]
    if kind in ("scalar", "string"):
        return math.isfinite(float(series[1]))
    for s in series:
        points = s.get("values") or ([s["value"]] if "value" in s else [])
        if any(math.isfinite(float(v)) for _, v in points):
            return True
    return False


def run(stack: Stack, expr: str, instant: bool) -> dict:
    now = time.time()
    if instant:
        return stack.api("query", query=expr, time=f"{now:.3f}")
    return stack.api(
        "query_range", query=expr, start=f"{stack.t0:.3f}", end=f"{now:.3f}", step="1s"
    )


def converge(stack: Stack, checks: dict[str, callable]) -> None:
    """Run every check until each has passed once, within CONVERGE_S; then fail naming the rest."""
    pending = dict(checks)
    errors: dict[str, str] = {}
    deadline = time.monotonic() + CONVERGE_S
    while pending and time.monotonic() < deadline:
        for key, check in list(pending.items()):
            try:
                if check():
                    del pending[key]
                    errors.pop(key, None)
                else:
                    errors[key] = "no data"
            except ValueError as exc:
                errors[key] = str(exc)
        if pending:
            time.sleep(1)
    if pending:
        lines = "\n".join(f"  - {k}\n      {errors.get(k, '')}" for k in pending)
        pytest.fail(
            f"{len(pending)} of {len(checks)} returned no data after {CONVERGE_S}s:\n{lines}\n{stack.logs()}"
        )


# -- tests -----------------------------------------------------------------------------------
def test_dashboards_have_panels_with_queries():
    """The generated JSON exists and every non-row panel has at least one PromQL target."""
    assert DASHBOARDS, "no grafana/dashboards/*.json: run python grafana/generate.py"
    for path in DASHBOARDS:
        for p in json.loads(path.read_text())["panels"]:
            if p["type"] != "row":
                assert any(t.get("expr") for t in p.get("targets", [])), (
                    f"{path.name}: {p['title']} has no query"
                )


def test_every_dashboard_expression_returns_data(stack: Stack):
    """Each panel query, with the variables on "All" and on the values they list, has data."""
    checks = {}
    for path in DASHBOARDS:
        # The variables first (a panel query is only as good as the values it is given).
        for all_values in (True, False):
            variables = wait_for(
                f"{path.name}'s variables to list values",
                lambda path=path, a=all_values: resolve_variables(stack, path, a),
                CONVERGE_S,
                every_s=1,
            )
            mode = "All" if all_values else "listed values"
            for board, title, t in dashboard_targets():
                if board != path.name:
                    continue

                def check(t=t, variables=variables) -> bool:
                    window = max(int(time.time() - stack.t0), 2)
                    expr = substitute(t["expr"], variables, window)
                    got = run(stack, expr, bool(t.get("instant")))  # (a bad query raises)
                    # this stack runs no memra-obs tail: its series' queries need only evaluate
                    return "memra_obs_tail_" in expr or has_data(got)

                checks[f"{board} / {title} / {t['refId']} ({mode}): {t['expr']}"] = check
    assert len(checks) >= 2 * 30, "fewer panel queries than the dashboard is meant to have"
    converge(stack, checks)


def test_share_panels_are_shares(stack: Stack):
    """A panel with a percent unit shows a share (Grafana's legend and tooltip print the
    value, not the stacked axis): the phase shares of round wall add up to 1, with every
    variable on "All" (several processes, two families)."""
    path = ROOT / "grafana" / "dashboards" / "memra-spec.json"
    variables = wait_for("the variables to list values", lambda: resolve_variables(stack, path, True),
                      CONVERGE_S, every_s=1)  # fmt: skip
    (t,) = (t for b, title, t in dashboard_targets() if title == "Phase share of round wall")

    def adds_up() -> bool:
        expr = substitute(t["expr"], variables, max(int(time.time() - stack.t0), 2))
        got = run(stack, expr, True)["result"]
        return len(got) == 5 and abs(sum(float(s["value"][1]) for s in got) - 1.0) < 1e-6

    converge(stack, {"the five phase shares add up to 1": adds_up})


def test_every_rule_is_healthy_and_returns_data(stack: Stack):
    """Prometheus loaded every rule, evaluates it without error, and each recording rule's
    series has data; an alert's expression runs and every series it reads has data (the
    alert itself firing is the promtool tests' business, deploy/prometheus/tests)."""
    rules = [
        r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
    ]
    recorded = {r["record"] for r in rules if "record" in r}
    checks = {}

    def healthy() -> bool:
        loaded = [r for g in stack.api("rules")["groups"] for r in g["rules"]]
        bad = [
            f"{r['name']}: {r['health']} {r.get('lastError', '')}"
            for r in loaded
            if r["health"] != "ok"
        ]
        if len(loaded) != len(rules) or bad:
            raise ValueError(f"{len(loaded)}/{len(rules)} rules loaded; not ok: {bad}")
        return True

    checks["all rules loaded and healthy"] = healthy
    for r in rules:
        if "record" in r:
            name = r["record"]
            checks[f"record {name}"] = lambda name=name: has_data(run(stack, name, False))
            checks[f"record {name} expr"] = lambda e=r["expr"]: has_data(run(stack, e, False))
            continue
        checks[f"alert {r['alert']} expr runs"] = lambda e=r["expr"]: (
            run(stack, e, True) is not None
        )
        for sel in selectors(r["expr"], recorded):
            if "memra_obs_tail_" in sel:  # this stack runs no memra-obs tail: the expr runs
                continue
            checks[f"alert {r['alert']} reads {sel}"] = lambda s=sel: has_data(run(stack, s, False))
    converge(stack, checks)


def selectors(expr: str, recorded: set[str]) -> list[str]:
    """The series selectors an expression reads: memra_* metrics and recorded series, with the
    label matchers written after them (range and offset parts dropped)."""
    out = []
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?", expr):
        name = m.group(1)
        if name.startswith("memra_") or name in recorded:
            out.append(name + (m.group(2) or ""))
    assert out, f"no series selector found in {expr}"
    return sorted(set(out))


def test_round_histogram_exemplars_carry_trace_ids(stack: Stack):
    """Prometheus stored exemplars on the round-wall buckets, each with a 32-hex trace_id
    (what Grafana's exemplarTraceIdDestinations turns into a Jaeger link)."""

    def exemplars():
        data = stack.api(
            "query_exemplars",
            query="memra_spec_round_seconds_bucket",
            start=f"{stack.t0 - 60:.3f}",
            end=f"{time.time():.3f}",
        )
        return [e for s in data for e in s["exemplars"]]

    found = wait_for(
        "exemplars on memra_spec_round_seconds_bucket", exemplars, CONVERGE_S, every_s=1
    )
    for e in found:
        assert re.fullmatch(r"[0-9a-f]{32}", e["labels"].get("trace_id", "")), e


def test_agent_mode_labels_every_worker(stack: Stack):
    """In agent mode one /metrics carries each worker's series under its own `worker` label
    (what the "by worker" panels split on)."""
    if stack.mode != "agent":
        pytest.skip("in-process mode has no worker label")

    def workers() -> bool:
        res = stack.api("query", query="sum by (worker) (memra_spec_rounds_total)")["result"]
        return {r["metric"].get("worker") for r in res} == {"0", "1"}

    converge(stack, {"memra_spec_rounds_total for workers 0 and 1": workers})


def test_exposition_passes_promtool_check_metrics(stack: Stack):
    """DESIGN §5: `promtool check metrics` reports nothing on the demo's /metrics."""
    if PROMTOOL is None:
        pytest.skip("promtool not found")
    body = stack._get(f"{stack.metrics_url}/metrics")
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (
        r.stdout + r.stderr
    ).decode()


def test_exemplar_traces_are_in_the_replayable_span_file(stack: Stack):
    """After the demo stops, its span file is what exporters/replay.yaml's otlp_json_file
    receiver reads (one OTLP-JSON ExportTraceServiceRequest per line, under its 64 MiB line
    limit) and it holds the traces the exemplars point to."""
    stack.stop_demo()
    data = stack.api(
        "query_exemplars",
        query="memra_spec_round_seconds_bucket",
        start=f"{stack.t0 - 60:.3f}",
        end=f"{time.time():.3f}",
    )
    wanted = {e["labels"]["trace_id"] for s in data for e in s["exemplars"]}
    assert wanted, "no exemplars to follow"

    trace_ids, names = set(), set()
    lines = stack.spans_file.read_bytes().splitlines()
    assert lines, f"{stack.spans_file} is empty"
    for raw in lines:
        assert len(raw) < 64 << 20, "a line over replay.yaml's max_log_size"
        req = json.loads(raw)
        for rs in req["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    assert re.fullmatch(r"[0-9a-f]{32}", sp["traceId"]), sp["traceId"]
                    assert re.fullmatch(r"[0-9a-f]{16}", sp["spanId"]), sp["spanId"]
                    assert int(sp["startTimeUnixNano"]) <= int(sp["endTimeUnixNano"])
                    trace_ids.add(sp["traceId"])
                    names.add(sp["name"])
    assert {"spec.session", "spec.burst", "spec.round"} <= names, names
    missing = wanted - trace_ids
    assert not missing, (
        f"{len(missing)}/{len(wanted)} exemplar trace ids have no span in the file: {sorted(missing)[:5]}"
    )
