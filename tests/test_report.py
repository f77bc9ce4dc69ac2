"""memra-obs report: the page's numbers are the package's own (parser, Rebuilder, seed rule),
a span file gives the records a log gives, A/B flags what changed and only that."""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from test_tail_follow import cri_parts, docker_parts

from memra_obs.analysis import advise
from memra_obs.legacy import AdviceLine, FirstTokenLine, RoundsLine, SummaryLine, parse_line
from memra_obs.report.inputs import FT, A, read
from memra_obs.report.main import Progress
from memra_obs.report.stats import View, ab_table, bootstrap, median, slow_rounds

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_report  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    return {**env, **extra}


def demo(tmp: Path, name: str, *args: str, **env: str) -> tuple[Path, Path]:
    """A demo run's stderr log and span file (no /metrics served)."""
    log, spans = tmp / f"{name}.log", tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "memra_obs.cli", "demo", *args]
    e = _env(MEMRA_OBS_METRICS_ADDR="", MEMRA_OBS_SPANS_FILE=str(spans), **env)
    with open(log, "wb") as f:
        p = subprocess.run(cmd, stderr=f, stdout=subprocess.DEVNULL, env=e, cwd=tmp, timeout=120)
    assert p.returncode == 0, log.read_text()[-2000:]
    return log, spans


def report(*inputs: Path | str, out: Path, stdin: bytes | None = None) -> str:
    cmd = [sys.executable, "-m", "memra_obs.cli", "report", *map(str, inputs), "-o", str(out)]
    p = subprocess.run(cmd, input=stdin, capture_output=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return out.read_text()


def keys(html: str) -> dict[str, list[str]]:
    """The page's ``data-key`` cells: key -> values, one per run column."""
    out: dict[str, list[str]] = {}
    for k, v in re.findall(r'data-key="([\w]+)">([^<]*)<', html):
        out.setdefault(k, []).append(v)
    return out


def legacy(path: Path) -> list:
    recs = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = parse_line(line)
        except ValueError:
            continue
        if r is not None:
            recs.append(r)
    return recs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two demo runs: the default span cap, and a cap of 16 rounds a session."""
    tmp = tmp_path_factory.mktemp("report")
    log, spans = demo(tmp, "demo", "--requests", "8", "--seed", "11", "--speed", "5")
    clog, cspans = demo(tmp, "capped", "--requests", "4", "--seed", "12", "--speed", "5",
                        MEMRA_OBS_ROUND_SPANS="16")  # fmt: skip
    return {"tmp": tmp, "log": log, "spans": spans, "clog": clog, "cspans": cspans}


def test_a_name_with_control_characters_leaves_every_figure_well_formed(runs, tmp_path):
    """An input named with an ESC or a BEL (a glob over a hostile directory): the name went into
    the SVG figures' titles and legends as it was, and every figure was XML no browser draws.
    It is spelled out (``\\x1b``) in the figures, the page and the closing line."""
    import base64
    from xml.dom import minidom

    named = tmp_path / "w\x1b[2J\x07.log"
    named.write_bytes(runs["log"].read_bytes())
    html = report(named, out=tmp_path / "r.html")
    svgs = re.findall(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", html)
    assert svgs and all(minidom.parseString(base64.b64decode(x)) for x in svgs)
    assert "\x1b" not in html and "w\\x1b[2J\\x07.log" in html


def test_a_span_file_gives_the_records_its_log_gives(runs):
    """Same demo run, both inputs: sessions, bursts, rounds, profiles and burst totals agree;
    the round logs rebuilt from the spans summarize to the very lines the worker printed."""
    a, b = read(str(runs["log"])), read(str(runs["spans"]))
    assert (a.kind, b.kind) == ("log", "spans")
    assert len(a.sessions) == len(b.sessions) == 8
    assert len(a.rounds) == len(b.rounds) and len(a.bursts) == len(b.bursts)
    assert [f.prof for f in a.first_tokens] == [f.prof for f in b.first_tokens]
    for x, y in zip(a.bursts, b.bursts, strict=True):  # a log: the line's 0.01 ms precision,
        assert x.phases.rounds == y.phases.rounds and x.k == y.k  # each phase rounded apart
        for f in ("draft", "verify", "accept", "roll", "maint"):  # (their total: up to 25 µs)
            assert abs(getattr(x.phases, f) - getattr(y.phases, f)) <= 5_001, f
    printed = [r.line() for r in legacy(runs["log"]) if isinstance(r, SummaryLine)]
    assert [g.summary.line() for g in a.logs] == printed  # type: ignore[union-attr]
    assert [g.summary.line() for g in b.logs] == printed  # type: ignore[union-attr]
    assert [g.rows for g in a.logs] == [g.rows for g in b.logs]  # every row, rest_ms too
    assert not a.refused and not a.unplaced and not b.refused


def test_slow_rounds_are_counted_as_the_summary_counts_them(runs):
    """Per session, the seed's rule over the rows equals each printed summary's count, for
    the demo and for a long synthetic log (thousands of sessions)."""
    syn = runs["tmp"] / "syn.log"
    syn.write_text("\n".join(bench_report.worker_log(300, seed=5)) + "\n")
    for path in (runs["log"], syn):
        run = read(str(path))
        want = [r.slow_rounds for r in legacy(path) if isinstance(r, SummaryLine)]
        assert slow_rounds(run) == want and sum(want) > 0


def test_the_page_table_matches_the_lines(runs):
    """Totals on the page against counts taken straight from the log's lines."""
    html = report(runs["log"], out=runs["tmp"] / "one.html")
    k = keys(html)
    recs = legacy(runs["log"])
    summaries = [r for r in recs if isinstance(r, SummaryLine)]
    assert k["summaries"] == [str(len(summaries))]
    assert (
        k["slow_rounds"] == k["slow_rounds_printed"] == [str(sum(s.slow_rounds for s in summaries))]
    )
    assert k["rounds_own"] == [str(sum(isinstance(r, RoundsLine) for r in recs))]
    assert k["ttft_n"] == [str(sum(isinstance(r, FirstTokenLine) for r in recs))]
    assert k["drafted"] == [str(sum(r.prof.k for r in recs if isinstance(r, RoundsLine)))]
    assert k["refused"] == ["0"]
    advice = sum(isinstance(r, AdviceLine) for r in recs)
    assert advice and k["lines_advice"] == [str(advice)]  # the worker's own advice is counted


def _sample_sum(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(a) == b for a, b in labels.items()):
                total += s.value
    return total


@pytest.mark.integration
def test_the_page_table_matches_the_tails_metrics(runs):
    """``memra-obs tail -`` fed the same log, its /metrics scraped over HTTP: rounds (and by
    source), tokens, seq_rows, first-token profiles, sessions, lines by kind agree."""
    k = keys(report(runs["log"], out=runs["tmp"] / "tail.html"))
    data = runs["log"].read_bytes()
    err = runs["tmp"] / "tail.err"
    # What the scrape must show: the page's counts. Polled until all of them are there (the
    # last burst settles after its linger); a count that is wrong stays wrong, and the asserts
    # below name it.
    want = {
        ("memra_obs_tail_lines_total", ()): data.count(b"\n"),
        ("memra_spec_rounds_total", ()): int(k["rounds"][0]),
        ("memra_obs_tail_rounds_total", (("source", "row"),)): int(k["rounds_own"][0]),
        ("memra_obs_tail_rounds_total", (("source", "burst_mean"),)): int(k["rounds_means"][0]),
        ("memra_spec_drafted_tokens_total", ()): int(k["drafted"][0]),
        ("memra_spec_accepted_tokens_total", ()): int(k["accepted"][0]),
        ("memra_spec_verify_seq_rows_total", ()): int(k["seq_rows"][0]),
        ("memra_spec_first_token_seconds_count", ()): int(k["ttft_n"][0]),
        ("memra_obs_tail_sessions_total", ()): int(k["sessions"][0]),
        ("memra_obs_tail_orphan_lines_total", ()): int(k["unplaced"][0]),
    }
    for kind in ("phase", "verify", "prof", "prof_rounds", "prof_summary"):
        want["memra_obs_tail_lines_total", (("kind", kind),)] = int(k[f"lines_{kind}"][0])
    # --linger and --session-gap well past a stall of this test's writes into the pipe (one
    # split a burst or a session): the input is one backlog, written at once, whose bursts and
    # sessions each line settles; only the last burst waits out its linger.
    with open(err, "wb") as ferr:
        env = _env(MEMRA_OBS_SINKS="prometheus", MEMRA_OBS_METRICS_ADDR="127.0.0.1:0")
        tail = subprocess.Popen(
            [sys.executable, "-m", "memra_obs.cli", "tail", "-", "--worker", "w", "--linger", "2",
             "--session-gap", "5"], stdin=subprocess.PIPE, stderr=ferr, env=env)  # fmt: skip
        try:
            assert tail.stdin is not None
            tail.stdin.write(data)
            tail.stdin.flush()
            deadline = time.monotonic() + 60
            text = ""
            while time.monotonic() < deadline:
                m = re.search(rb"/metrics on (\S+)", err.read_bytes())
                if m:
                    text = urllib.request.urlopen(m.group(1).decode(), timeout=5).read().decode()
                    got = {key: _sample_sum(text, key[0], **dict(key[1])) for key in want}
                    if got == want:
                        break
                time.sleep(0.3)
        finally:
            tail.stdin.close()  # type: ignore[union-attr]
            tail.wait(30)
    assert _sample_sum(text, "memra_spec_rounds_total") == int(k["rounds"][0])
    assert _sample_sum(text, "memra_obs_tail_rounds_total", source="row") == int(k["rounds_own"][0])
    assert _sample_sum(text, "memra_obs_tail_rounds_total", source="burst_mean") == int(
        k["rounds_means"][0]
    )
    assert _sample_sum(text, "memra_spec_drafted_tokens_total") == int(k["drafted"][0])
    assert _sample_sum(text, "memra_spec_accepted_tokens_total") == int(k["accepted"][0])
    assert _sample_sum(text, "memra_spec_verify_seq_rows_total") == int(k["seq_rows"][0])
    assert _sample_sum(text, "memra_spec_first_token_seconds_count") == int(k["ttft_n"][0])
    assert _sample_sum(text, "memra_obs_tail_sessions_total") == int(k["sessions"][0])
    for kind in ("phase", "verify", "prof", "prof_rounds", "prof_summary"):
        assert _sample_sum(text, "memra_obs_tail_lines_total", kind=kind) == int(
            k[f"lines_{kind}"][0]
        )
    assert _sample_sum(text, "memra_obs_tail_orphan_lines_total") == int(k["unplaced"][0])


def _ab(tmp: Path, a: dict, b: dict) -> dict[str, str]:
    pa, pb = tmp / "a.log", tmp / "b.log"
    pa.write_text("\n".join(bench_report.worker_log(120, **a)) + "\n")
    pb.write_text("\n".join(bench_report.worker_log(120, **b)) + "\n")
    html = report(pa, pb, out=tmp / "ab.html")
    return dict(re.findall(r'data-ab="(\w+)" data-flag="(\d)"', html))


def test_ab_flags_a_planted_verify_regression(tmp_path):
    """B's verify 10% slower (other phases drawn alike): verify and the wall are flagged,
    draft, accept, rollback and maint are not; the page says by how much."""
    flags = _ab(tmp_path, {"seed": 1}, {"seed": 2, "verify_scale": 1.10})
    assert flags == {
        "wall": "1",
        "draft": "0",
        "verify": "1",
        "accept": "0",
        "rollback": "0",
        "maint": "0",
    }
    html = (tmp_path / "ab.html").read_text()
    rel = re.search(r'data-ab="verify".*?B slower by ([\d.]+)%', html)
    assert rel is not None and 8.0 < float(rel.group(1)) < 12.0


def test_ab_two_runs_of_one_configuration_are_not_flagged(tmp_path):
    """Same configuration, different seeds: nothing is flagged."""
    assert set(_ab(tmp_path, {"seed": 1}, {"seed": 3}).values()) == {"0"}


def _ab_rows(tmp: Path, sessions: int, a: dict, b: dict) -> list:
    (pa := tmp / "a.log").write_text("\n".join(bench_report.worker_log(sessions, **a)) + "\n")
    (pb := tmp / "b.log").write_text("\n".join(bench_report.worker_log(sessions, **b)) + "\n")
    return ab_table(View("A", read(str(pa))), View("B", read(str(pb))))


def test_ab_resamples_sessions_so_two_small_runs_of_one_configuration_are_not_flagged(tmp_path):
    """Rounds of one session share its prompt and acceptance: resampled round by round, three of
    these six pairs of 12-session runs of one configuration flagged rollback, maint or the wall
    (13 of 20 such pairs); resampling sessions flags none. A 10% verify slowdown still is."""
    for i in range(6):
        rows = _ab_rows(tmp_path, 12, {"seed": 1000 + i}, {"seed": 2000 + i})
        assert [r.metric for r in rows if r.flagged] == [], i
        assert all(r.sessions == (12, 12) for r in rows)
    rows = _ab_rows(tmp_path, 12, {"seed": 1000}, {"seed": 2000, "verify_scale": 1.1})
    assert [r.metric for r in rows if r.flagged] == ["wall", "verify"]


def test_ab_rows_hold_together_at_95_percent(tmp_path, monkeypatch):
    """Six rows, each its own 95% CI: a reviewer's 200 splits of one run into 12 sessions
    against 12 flagged some row in 18% of them, where the page said 95%. Each row's interval is
    now at 1 - 0.05 / rows (Bonferroni), the resamples raised for those tails, and the page says
    the CIs cover sessions, not runs."""
    from memra_obs.report import stats

    levels: list[float] = []
    real = stats.bootstrap

    def spy(*args, **kw):
        levels.append(args[4] if len(args) > 4 else kw["level"])
        return real(*args, **kw)

    monkeypatch.setattr(stats, "bootstrap", spy)
    rows = _ab_rows(tmp_path, 12, {"seed": 1000}, {"seed": 2000, "verify_scale": 1.1})
    assert len(levels) == len(rows) == 6 and set(levels) == {1 - 0.05 / 6}
    assert [r.metric for r in rows if r.flagged] == ["wall", "verify"]
    assert stats.N_BOOT >= 4000 and "hold together at 95%" in stats.AB_METHOD
    assert "not runs" in stats.AB_METHOD


def test_ab_of_a_handful_of_sessions_says_too_few_and_faster_is_not_red(tmp_path):
    """Three sessions a run (~200 rounds) were flagged "B faster by 3.6%" on no evidence: fewer
    than 6 sessions a run is never flagged and says so. A faster B was as red as a slower one."""
    from memra_obs.report.page import _ab

    rows = _ab_rows(tmp_path, 3, {"seed": 1}, {"seed": 2, "verify_scale": 0.8})
    assert min(r.n_a for r in rows) >= 6 and not any(r.flagged for r in rows)
    assert all(r.verdict == "too few sessions (6 a run needed)" for r in rows)
    rows = _ab_rows(tmp_path, 12, {"seed": 1}, {"seed": 2, "verify_scale": 0.8})
    assert re.search(r'data-ab="verify" data-flag="1" class="flag better">.*B faster', _ab(rows))


def test_ab_says_when_a_and_b_were_not_recorded_alike(tmp_path):
    """One run at trace level 2, the same at level 1: the demo's level-1 run read "accept B faster
    by 7.0%" (the level-2 line's own cost), and the page did not say the levels differed."""
    lines = bench_report.worker_log(12, seed=1)
    (a := tmp_path / "a.log").write_text("\n".join(lines) + "\n")
    (b := tmp_path / "b.log").write_text("\n".join(x for x in lines if "-phase-v]" not in x))
    html = report(a, b, out=tmp_path / "ab.html")
    assert "not recorded alike (level-2 verify split: A yes, B no)" in html
    assert "not recorded alike" not in report(a, a, out=tmp_path / "aa.html")


def test_a_log_against_its_own_span_file_compares_one_population(runs):
    """A log's rounds of their own are each session's first 64 (and its rollback and maint a
    split of one rest_ms); a span file has them all: A/B of one run in both forms compares the
    same rounds, rollback + maint together, and flags nothing."""
    a, b = read(str(runs["log"])), read(str(runs["spans"]))
    assert any(r.index >= 64 and r.k >= 0 for r in b.rounds)  # more than a log has
    rows = ab_table(View("A", a), View("B", b))
    assert [r.metric for r in rows] == ["wall", "draft", "verify", "accept", "rollback+maint"]
    assert all(r.n_a == r.n_b == sum(x.k >= 0 for x in a.rounds) for r in rows)
    assert not any(r.flagged for r in rows) and "the first 64 of each session" in rows[0].population
    import numpy as np

    rest = [x.prof.rest_ms for x in legacy(runs["log"]) if isinstance(x, RoundsLine)]
    assert rows[-1].med_a == pytest.approx(median(np.array(rest)), abs=1e-5)  # the rows' rest
    same = ab_table(View("A", b), View("B", b))  # one kind: every round, each phase
    assert [r.metric for r in same][-2:] == ["rollback", "maint"] and same[0].n_a > rows[0].n_a


def test_ab_against_an_input_without_rounds_exits_2(runs, tmp_path):
    """No A/B comparison can be made: said, exit 2 and no page (not "flagged: nothing")."""
    (empty := tmp_path / "empty.log").write_text("")
    out = tmp_path / "ab.html"
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", str(runs["log"]), str(empty),
                        "-o", str(out)], capture_output=True, text=True, env=_env(), timeout=120)  # fmt: skip
    assert p.returncode == 2 and not out.exists()
    assert p.stderr == "memra-obs report: no A/B comparison: B: empty.log has no rounds\n"


def test_three_inputs_or_two_from_standard_input_exit_2(tmp_path, capsys):
    """A report is of one input, or two (A/B): more, or standard input twice, is said, exit 2."""
    from memra_obs.cli import main

    out = tmp_path / "r.html"
    for inputs in (["a.log", "b.log", "c.log"], ["-", "-"]):
        assert main(["report", *inputs, "-o", str(out)]) == 2 and not out.exists()
        assert capsys.readouterr().err == (
            "memra-obs report: one input, or two for A/B (at most one of them -)\n"
        )


def test_gzipped_inputs_are_read(runs, tmp_path):
    """Logs and span files banked compressed read as they are; one cut short is refused."""
    import gzip

    for name in ("log", "spans"):
        gz = tmp_path / f"{name}.gz"
        gz.write_bytes(gzip.compress(runs[name].read_bytes()))
        plain, packed = read(str(runs[name])), read(str(gz))
        assert (packed.kind, len(packed.rounds), packed.lines) == (
            plain.kind,
            len(plain.rounds),
            plain.lines,
        )
    cut = tmp_path / "cut.gz"
    cut.write_bytes((tmp_path / "log.gz").read_bytes()[:-100])
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", str(cut), "-o",
                        str(tmp_path / "c.html")], capture_output=True, text=True, env=_env())  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith(f"memra-obs report: {cut}: ")
    damaged = tmp_path / "damaged.gz"  # a bad deflate stream: zlib.error, a traceback
    body = bytearray((tmp_path / "log.gz").read_bytes())
    body[2000:2100] = bytes(b ^ 0x5A for b in body[2000:2100])
    damaged.write_bytes(body)
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", str(damaged), "-o",
                        str(tmp_path / "d.html")], capture_output=True, text=True, env=_env())  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith(f"memra-obs report: {damaged}: ")
    assert "Traceback" not in p.stderr


def test_a_file_name_that_is_not_utf8_and_a_line_too_deep_for_json_are_reported(runs, tmp_path):
    """A file named with a byte that is not UTF-8 (its label a surrogate) and a span line of
    5,000 nested brackets each stopped the report with a traceback: the label is shown with
    U+FFFD and the line is refused with its number. 100,000 here: json's C scanner stops at
    the C recursion limit, 10,000 deep from Python 3.13 (5,000 open brackets there are a
    plain JSONDecodeError at the line's end, and the RecursionError path went untested)."""
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/spans-\xff.jsonl"))
    odd.write_bytes(runs["spans"].read_bytes() + b'{"resourceSpans":' + b"[" * 100_000 + b"\n")
    html = report(odd, out=tmp_path / "odd.html")
    assert "spans-\ufffd.jsonl" in html
    run = read(str(odd))
    assert run.refused[-1][0] == run.lines and "RecursionError" in run.refused[-1][1]


def test_rounds_past_the_span_cap_are_rebuilt_and_said(runs):
    """With 16 round spans a session, the rounds past it come from the burst totals: the
    round count and every burst's phase sums still equal the log's; the page says so."""
    a, b = read(str(runs["clog"])), read(str(runs["cspans"]))
    assert b.unsampled > 0 and len(b.rounds) == len(a.rounds)
    assert sum(r.k < 0 for r in b.rounds) == b.unsampled
    for x, y in zip(a.bursts, b.bursts, strict=True):  # the burst spans' totals, not the rounds'
        assert abs(x.phases.verify - y.phases.verify) <= 5_001
    for x in b.bursts:
        mine = [r for r in b.rounds if r.session == x.session and r.burst == x.index]
        assert len(mine) == x.phases.rounds
        assert abs(sum(r.phase_ns()[1] for r in mine) - x.phases.verify) < len(mine)
        own = [r.t_ns_mono[5] for r in mine if r.k >= 0]  # the rest follow the burst's own
        assert all(r.t_ns_mono[0] >= max(own, default=x.start_ns_mono) for r in mine if r.k < 0)
    html = report(runs["cspans"], out=runs["tmp"] / "capped.html")
    assert f"{b.unsampled} of {len(b.rounds)} rounds were past the span cap" in html
    assert any("their [spec-prof-summary] cannot be recomputed" in n for n in b.notes)
    assert keys(html)["round_logs"] == ["0"]  # 16 < 64: the summaries' rows are not in the file
    ft = _first("spec.first_token", lambda s: _set(s, FT + "prime_ms", {"doubleValue": -1.0}))
    run = read(str(spans_edited(runs["cspans"], runs["tmp"] / "capft.jsonl", ft)))
    assert len(run.refused) == 1  # a refused session takes its rounds past the cap with it
    assert run.unsampled == sum(r.k < 0 for r in run.rounds) < b.unsampled


def test_a_refused_round_span_in_a_burst_past_the_cap_keeps_its_burst_whole(runs, tmp_path):
    """A round span without its verify span, in a burst whose later rounds are past the span
    cap: every round keeps its index and the burst's phases still sum to its totals."""
    spans = [s for line in runs["cspans"].read_text().splitlines()
             for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]  # fmt: skip
    u = {"key": A + "rounds_unsampled", "value": {"intValue": "0"}}
    capped = {s["spanId"] for s in spans if s["name"] == "spec.burst" and u not in s["attributes"]}
    hit = next(
        s["spanId"] for s in spans if s["name"] == "spec.round" and s["parentSpanId"] in capped
    )
    edit = tmp_path / "v.jsonl"
    run = read(
        str(
            spans_edited(
                runs["cspans"],
                edit,
                lambda s: s.get("parentSpanId") != hit or s["name"] != "spec.verify",
            )
        )
    )
    good = read(str(runs["cspans"]))
    assert len(run.refused) == 1 and "lacks a phase span" in run.refused[0][1]
    where = [sorted((r.session, r.burst, r.index) for r in x.rounds) for x in (good, run)]
    assert where[0] == where[1]
    for x in run.bursts:
        mine = [r for r in run.rounds if r.session == x.session and r.burst == x.index]
        assert abs(sum(r.phase_ns()[1] for r in mine) - x.phases.verify) < len(mine)


def test_rounds_a_burst_span_counts_without_their_spans_are_kept_and_said(runs, tmp_path):
    """Round records a worker dropped (a full queue) leave their burst span counting rounds that
    have no spec.round span: they keep their burst's means, so the round count and every burst's
    sums are the log's, and the page says how many (6,597 of a demo's 47,925 were left out unsaid)."""
    cut: set[str] = set()

    def keep(s: dict) -> bool:  # round 2 of each session, with its phase spans
        at = {a["key"]: a["value"] for a in s.get("attributes", ())}
        if s["name"] == "spec.round" and at.get("memra.spec.round") == {"intValue": "2"}:
            cut.add(s["spanId"])
        return s["spanId"] not in cut and s.get("parentSpanId") not in cut

    spans_edited(runs["spans"], tmp_path / "twice.jsonl", keep)  # phase spans precede their round
    spans = spans_edited(tmp_path / "twice.jsonl", tmp_path / "dropped.jsonl", keep)
    a, b = read(str(runs["log"])), read(str(spans))
    assert len(cut) == len(b.sessions) == 8 and len(b.rounds) == len(a.rounds)
    assert sum(r.k < 0 for r in b.rounds) == 8 and b.unsampled == 0
    for x in b.bursts:
        mine = [r for r in b.rounds if r.session == x.session and r.burst == x.index]
        assert len(mine) == x.phases.rounds
        assert abs(sum(r.phase_ns()[1] for r in mine) - x.phases.verify) < len(mine)
    html = report(spans, out=tmp_path / "dropped.html")
    assert "8 rounds their spec.burst spans count have no spec.round span" in html
    assert keys(html)["rounds"] == [str(len(a.rounds))]


def test_refused_lines_are_listed_by_number(tmp_path):
    """Truncated and non-UTF-8 tagged lines: refused with their line number and reason, the
    rest of the log still reported."""
    good = [x.encode() for x in bench_report.worker_log(3, seed=9)]
    bad = [*good[:5], good[0][:50], b"[spec-prof-rounds] row=0 wall_ms=\xe9\xe9", *good[5:]]
    path = tmp_path / "bad.log"
    path.write_bytes(b"\n".join(bad) + b"\n")
    run = read(str(path))
    assert [n for n, _, _ in run.refused] == [6, 7]
    assert "phase line truncated" in run.refused[0][1]
    html = report(path, out=tmp_path / "bad.html")
    assert keys(html)["refused"] == ["2"] and "phase line truncated or malformed" in html


def test_a_line_with_trailing_blanks_is_refused_as_the_parser_refuses_it(tmp_path):
    """Only the newline is cut: a phase line ending in a blank is refused by number, as the
    tail refuses it, not read as a burst."""
    phase = (ROOT / "tests" / "data" / "legacy_lines.txt").read_text().split("\n")[0]
    (log := tmp_path / "blank.log").write_text(f"{phase}\n{phase} \n")
    run = read(str(log))
    assert [n for n, _, _ in run.refused] == [2] and len(run.bursts) == 1
    assert sum(run.kinds.values()) == 1  # the refused line is not counted nor fed


def test_a_row_0_or_a_row_after_a_summary_opens_a_round_log(tmp_path):
    """Round logs as the worker kept them: a row 0 opens one even if the last has no summary
    (a worker stopped mid-log), and so does any row after a summary."""
    lines = (ROOT / "tests" / "data" / "legacy_lines.txt").read_text().split("\n")
    row0, row13, empty = lines[4], lines[5], lines[7]
    (log := tmp_path / "logs.log").write_text("\n".join([row0, row13, row0, empty, row13]) + "\n")
    got = [(len(g.rows), g.summary is not None) for g in read(str(log)).logs]
    assert got == [(2, False), (1, True), (1, False)]


def test_a_dropped_burst_is_unplaced_once_at_the_line_that_closed_it_or_at_the_end(tmp_path):
    """A burst past any plausible clock is dropped by the Rebuilder: listed once, with the
    line that closed it (0: the end of the input closed it)."""
    phase = (ROOT / "tests" / "data" / "legacy_lines.txt").read_text().split("\n")[0]
    bad = phase.replace("draft=9.73", "draft=9000000000.00").replace(
        "draft=1.621", "draft=1500000000.000"
    )
    (log := tmp_path / "huge.log").write_text("\n".join([bad, phase, phase, bad]) + "\n")
    run = read(str(log))
    assert [n for n, _ in run.unplaced] == [2, 0] and len(run.bursts) == 2
    assert all("burst dropped" in why for _, why in run.unplaced)


def test_a_line_over_one_mib_is_refused_as_the_tail_refuses_it_never_held_whole(tmp_path):
    """A log with a 200 MB line of binary junk (no newline) took 2.5 GB: the report read each
    line whole, where the tail reads past a line over 1 MiB. Now such a line (first, inside,
    last without its newline) is refused by number, read past in chunks, and every round of the
    good lines is kept."""
    import tracemalloc

    good = [x.encode() for x in bench_report.worker_log(3, seed=9)]
    junk = b"\x00\xff[glm5-phase] rounds=" + b"j" * (24 << 20)
    path, clean = tmp_path / "junk.log", tmp_path / "clean.log"
    clean.write_bytes(b"\n".join(good) + b"\n")
    path.write_bytes(b"\n".join([junk[: 3 << 20], *good[:5], junk, *good[5:], junk]))
    tracemalloc.start()
    try:
        run = read(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # it held the 24 MiB line and its text: > 48 MiB
    n = len(good) + 3
    refused = [(i, "a line over 1048576 bytes" in why) for i, why, _ in run.refused]
    assert refused == [(1, True), (7, True), (n, True)]
    assert run.lines == n and run.size == path.stat().st_size
    assert len(run.rounds) == len(read(str(clean)).rounds) > 0
    m = 1 << 20  # the bound itself: a line of 1 MiB is a line, newline or not (the tail's)
    path.write_bytes(b"x" * m + b"\n" + b"z" * (m + 1) + b"\n" + b"y" * m)
    assert [i for i, _, _ in read(str(path)).refused] == [2]
    path.write_bytes(b"j" * (m + 1) + good[0] + b"\n")  # its last chunk looks like a line
    assert parse_line(good[0].decode()) is not None and not read(str(path)).kinds


def spans_edited(src: Path, dst: Path, keep: Callable[[dict], bool]) -> Path:
    """``src``'s spans that ``keep`` keeps (it may change them), written to ``dst``."""
    lines = []
    for line in src.read_text().splitlines():
        req = json.loads(line)
        for ss in (ss for rs in req["resourceSpans"] for ss in rs["scopeSpans"]):
            ss["spans"] = [s for s in ss["spans"] if keep(s)]
        lines.append(json.dumps(req))
    dst.write_text("\n".join(lines) + "\n")
    return dst


def _first(name: str, change: Callable[[dict], bool]) -> Callable[[dict], bool]:
    """A ``keep`` that hands the first span called ``name`` to ``change`` (False: drop it)."""
    done: list[dict] = []

    def keep(s: dict) -> bool:
        if s["name"] != name or done:
            return True
        done.append(s)
        return change(s)

    return keep


def _set(s: dict, key: str, value: dict) -> bool:
    (a,) = (a for a in s["attributes"] if a["key"] == key)
    a["value"] = value
    return True


def test_a_collectors_blank_lines_and_empty_parent_ids_read_as_the_workers_file(runs, tmp_path):
    """A collector's file exporter writes a root span's parentSpanId as "" and may leave blank
    lines, first ones too (a span file read as an empty log): read as the worker's own file.
    An attribute value that is no AnyValue object refuses its line (AttributeError), never a
    traceback."""

    def rooted(s: dict) -> bool:
        s.setdefault("parentSpanId", "")
        return True

    got = spans_edited(runs["spans"], tmp_path / "c.jsonl", rooted)
    got.write_text("\n \r\n" + got.read_text().replace("\n", "\n\n"))
    a, b = read(str(runs["spans"])), read(str(got))
    assert not b.refused and (len(b.sessions), len(b.rounds)) == (len(a.sessions), len(a.rounds))
    assert b.kind == "spans" and b.lines == 2 * a.lines + 2
    bad = _first("spec.round", lambda s: _set(s, "memra.spec.k", "4"))  # type: ignore[arg-type]
    run = read(str(spans_edited(runs["spans"], tmp_path / "bad.jsonl", bad)))
    assert len(run.refused) == 1 and "AttributeError" in run.refused[0][1]


def test_a_span_line_refused_partway_adds_none_of_its_spans(runs, tmp_path):
    """A request line whose last span lacks its end is refused whole: the spans read before it
    were counted (and a session span among them reported)."""
    lines = runs["spans"].read_text().splitlines()
    reqs = [json.loads(line) for line in lines]
    each = [[s for rs in r["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
            for r in reqs]  # fmt: skip
    i = next(i for i, sp in enumerate(each) if sum(s["name"][:5] == "spec." for s in sp[:-1]) > 1)
    spans = each[i]
    del spans[-1]["endTimeUnixNano"]
    lines[i] = json.dumps(reqs[i])
    (cut := tmp_path / "cut.jsonl").write_text("\n".join(lines) + "\n")
    good, run = read(str(runs["spans"])), read(str(cut))
    assert [n for n, _, _ in run.refused] == [i + 1]
    in_line = sum(s["name"].startswith("spec.") for s in spans)
    assert run.kinds["spans"] == good.kinds["spans"] - in_line


def test_a_round_with_j_past_k_is_refused_and_the_page_still_written(runs, tmp_path):
    """A [spec-prof-rounds] row with k=4 j=9 is refused like a malformed line (its number, its
    reason); a spec.round span saying so is refused and its round carries its burst's means:
    no crash, the estimates come from the other rounds."""
    lines = bench_report.worker_log(3, seed=9)
    assert lines[4].startswith("[spec-prof-rounds] row=1 ") and " k=4 j=3 " in lines[4]
    lines[4] = lines[4].replace(" k=4 j=3 ", " k=4 j=9 ")
    (log := tmp_path / "kj.log").write_text("\n".join(lines) + "\n")
    run = read(str(log))
    assert [(n, why) for n, why, _ in run.refused] == [(5, "row with k=4, j=9: j must be in 0..k")]
    k = keys(report(log, out=tmp_path / "kj.html"))
    assert k["refused"] == ["1"] and k["sessions"] == ["3"]
    to9 = _first("spec.round", lambda s: _set(s, "memra.spec.j", {"intValue": "9"}))
    spans = spans_edited(runs["spans"], tmp_path / "kj.jsonl", to9)
    good, run = read(str(runs["spans"])), read(str(spans))
    assert len(run.refused) == 1 and "j=9: j must be in 0..k" in run.refused[0][1]
    assert len(run.rounds) == len(good.rounds) and not any(r.j > r.k for r in run.rounds)
    assert sum(r.k < 0 for r in run.rounds) == sum(r.k < 0 for r in good.rounds) + 1
    html = report(spans, out=tmp_path / "kj_spans.html")
    assert keys(html)["refused"] == ["1"] and "j=9: j must be in 0..k" in html


def test_a_refused_round_span_keeps_its_burst_whole_a_refused_session_adds_nothing(runs, tmp_path):
    """A round span without its verify span: its burst still has its rounds (that one with the
    burst's means, at its own index) and their phases still sum to the burst's. A session whose
    first-token profile is refused adds nothing: no session, burst or round of it is kept."""
    spans = spans_edited(
        runs["spans"], tmp_path / "nov.jsonl", _first("spec.verify", lambda s: False)
    )
    good, run = read(str(runs["spans"])), read(str(spans))
    assert len(run.refused) == 1 and "lacks a phase span" in run.refused[0][1]
    where = [sorted((r.session, r.burst, r.index) for r in x.rounds) for x in (good, run)]
    assert where[0] == where[1] and sum(r.k < 0 for r in run.rounds) == 1
    for x in run.bursts:
        mine = [r for r in run.rounds if r.session == x.session and r.burst == x.index]
        assert len(mine) == x.phases.rounds
        assert abs(sum(r.phase_ns()[1] for r in mine) - x.phases.verify) <= len(mine)
    ft = "memra.spec.first_token.prime_ms"
    seen: list[dict] = []
    bad = _first("spec.first_token", lambda s: seen.append(s) or _set(s, ft, {"doubleValue": -1.0}))
    spans = spans_edited(runs["spans"], tmp_path / "ft.jsonl", bad)
    parent = int(seen[0]["parentSpanId"], 16)
    (gone,) = (s.session for s in good.sessions if s.span_id == parent)
    run = read(str(spans))
    assert len(run.refused) == 1 and "prime_ms=-1.0" in run.refused[0][1]
    assert len(run.sessions) == 7 and parent not in {s.span_id for s in run.sessions}
    assert len(run.rounds) == sum(r.session != gone for r in good.rounds)
    assert len(run.bursts) == sum(b.session != gone for b in good.bursts)
    assert len(run.first_tokens) == 7 and len(run.logs) == len(good.logs) - 1


def test_a_session_span_whose_family_is_no_string_is_refused_not_a_crash(runs, tmp_path):
    """A span file (any OTLP-JSON producer's) whose session says ``memra.spec.family`` = 7
    beside sessions of ``glm5``: that session is refused with its reason and the page is
    written (sorting the families raised a TypeError: a traceback, no page)."""
    seven = _first("spec.session", lambda s: _set(s, "memra.spec.family", {"intValue": "7"}))
    spans = spans_edited(runs["spans"], tmp_path / "fam.jsonl", seven)
    run = read(str(spans))
    assert len(run.refused) == 1 and "memra.spec.family 7 is not a string" in run.refused[0][1]
    off = _first("spec.session", lambda s: _set(s, "memra.spec.prof", {"boolValue": False}))
    good, run = (
        read(str(runs["spans"])),
        read(str(spans_edited(runs["spans"], tmp_path / "p", off))),
    )
    assert len(run.logs) == len(good.logs) - 1  # an unprofiled session printed no summary
    assert keys(report(spans, out=tmp_path / "fam.html"))["sessions"] == ["7"]


def test_a_round_whose_phase_spans_run_backwards_is_refused(runs, tmp_path):
    """A damaged span file (a draft span ending at 0, a rollback ending a second late): that
    round is refused and carries its burst's means; no crash, no negative phase time."""

    def damage(s: dict) -> bool:
        s["endTimeUnixNano"] = "0"
        return True

    spans = spans_edited(runs["spans"], tmp_path / "back.jsonl", _first("spec.draft", damage))
    good, run = read(str(runs["spans"])), read(str(spans))
    assert len(run.refused) == 1 and "end before they start" in run.refused[0][1]
    assert len(run.rounds) == len(good.rounds) and sum(r.k < 0 for r in run.rounds) == 1 + sum(
        r.k < 0 for r in good.rounds
    )
    assert min(min(r.phase_ns()) for r in run.rounds) >= 0
    assert keys(report(spans, out=tmp_path / "back.html"))["refused"] == ["1"]


def test_a_first_token_span_without_buckets_is_left_out_of_the_waterfall(runs, tmp_path):
    """spec.first_token spans without their bucket spans (a truncated file): the page is written,
    the TTFTs still counted, the waterfall says it has nothing to draw."""
    bucket = "spec.first_token."
    spans = spans_edited(runs["spans"], tmp_path / "noft.jsonl", lambda s: bucket not in s["name"])
    html = report(spans, out=tmp_path / "noft.html")
    assert keys(html)["ttft_n"] == ["8"]
    img = re.search(
        r'alt="first token waterfall per session" src="data:image/svg\+xml;base64,([^"]+)"', html
    )
    assert img is not None and b"with its buckets in this input" in base64.b64decode(img.group(1))


def test_a_failed_render_or_write_leaves_no_temp_file(runs, tmp_path, monkeypatch):
    """Rendering fails: nothing is written. Writing fails (the output is a directory): exit 2
    with the output's name, no temporary file left."""
    from memra_obs.report import main, page

    def fail(*_: object) -> str:
        raise RuntimeError("render failed")

    monkeypatch.setattr(page, "render", fail)
    args = argparse.Namespace(
        inputs=[str(runs["log"])], output=str(tmp_path / "r.html"), quiet=True, progress=False
    )
    with pytest.raises(RuntimeError):
        main.main(args)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (out := tmp_path / "dir").mkdir()
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", str(runs["log"]), "-o", str(out)],
                       capture_output=True, text=True, env=_env())  # fmt: skip
    assert p.returncode == 2 and str(out) in p.stderr
    assert [x.name for x in tmp_path.iterdir()] == ["dir"]
    log = tmp_path / "copy.log"  # -o naming an input: refused, the log left as it was
    log.write_bytes(runs["log"].read_bytes())
    for link in ("copy.log", "./copy.log"):
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", "copy.log", "-o", link],
                           capture_output=True, text=True, env=_env(), cwd=tmp_path)  # fmt: skip
        assert (
            p.returncode == 2 and p.stderr == f"memra-obs report: -o {link} is the input copy.log\n"
        )
    assert log.read_bytes() == runs["log"].read_bytes()
    for blank in ("", " "):  # "": ": Is a directory"; " ": a file named " ", status 0
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", "copy.log", "-o", blank],
                           capture_output=True, text=True, env=_env(), cwd=tmp_path)  # fmt: skip
        assert (
            p.returncode == 2
            and p.stderr == f"memra-obs report: -o {blank!r}: name a file (or /dev/stdout)\n"
        )
    assert sorted(x.name for x in tmp_path.iterdir()) == ["copy.log", "dir"]


def test_counts_no_worker_writes_refuse_their_session_and_the_page_is_written(runs, tmp_path):
    """A round index of -5 or 2**63, or 10**8 unsampled rounds in a burst of fewer: the session
    is refused (they crashed the page, or expanded into gigabytes of rounds)."""
    good = read(str(runs["spans"]))
    for name, key, value in (
        ("spec.round", "memra.spec.round", {"intValue": "-5"}),
        ("spec.round", "memra.spec.round", {"intValue": str(2**63)}),
        ("spec.round", "memra.spec.round", {"doubleValue": 1e308}),
        ("spec.burst", "memra.spec.rounds_unsampled", {"intValue": str(10**8)}),
        ("spec.burst", "memra.spec.rounds", {"intValue": str(2**24 + 1)}),
    ):
        edit = _first(name, lambda s, k=key, v=value: _set(s, k, v))
        spans = spans_edited(runs["spans"], tmp_path / "bad.jsonl", edit)
        run = read(str(spans))
        assert len(run.sessions) == len(good.sessions) - 1, value
        assert len(run.refused) == 1 and "not a count" in run.refused[0][1]
        assert keys(report(spans, out=tmp_path / "bad.html"))["refused"] == ["1"]


def test_a_round_span_at_the_counts_bounds_is_kept_and_one_without_k_hides_its_log(runs, tmp_path):
    """ctx = 2**32 - 1 is a count a worker writes: the round is kept. A round span without k
    (a tail's spans) keeps its round, but its session's summary is not recomputed."""
    good = read(str(runs["spans"]))
    top = _first("spec.round", lambda s: _set(s, A + "ctx", {"intValue": str(2**32 - 1)}))
    run = read(str(spans_edited(runs["spans"], tmp_path / "top.jsonl", top)))
    assert not run.refused and len(run.rounds) == len(good.rounds)
    for name, edit in (
        (
            "spec.round",
            lambda s: _set(s, A + "k", {"intValue": "0"}) and _set(s, A + "j", {"intValue": "1"}),
        ),
        ("spec.draft", lambda s: s.update(endTimeUnixNano=s["startTimeUnixNano"]) or True),
    ):
        run = read(str(spans_edited(runs["spans"], tmp_path / "e.jsonl", _first(name, edit))))
        assert len(run.refused) == (name == "spec.round")  # k=0 j=1 refused; a 0 ns draft kept

    def nok(s: dict) -> bool:
        s["attributes"] = [a for a in s["attributes"] if a["key"] != A + "k"]
        return True

    run = read(str(spans_edited(runs["spans"], tmp_path / "nok.jsonl", _first("spec.round", nok))))
    assert not run.refused and len(run.logs) == len(good.logs) - 1
    assert run.kinds["sessions_without_log"] == 1


def test_a_span_file_read_in_any_order_gives_the_same_records(runs, tmp_path):
    """A collector may write a batch's spans in any order: rounds and bursts are placed by their
    start, so the records and recomputed summaries are the worker's order's."""
    lines = []
    for line in runs["spans"].read_text().splitlines():
        req = json.loads(line)
        for ss in (ss for rs in req["resourceSpans"] for ss in rs["scopeSpans"]):
            ss["spans"].reverse()
        lines.append(json.dumps(req))
    (back := tmp_path / "back.jsonl").write_text("\n".join(lines) + "\n")
    a, b = read(str(runs["spans"])), read(str(back))
    assert sorted(g.summary.line() for g in a.logs) == sorted(g.summary.line() for g in b.logs)  # type: ignore[union-attr]
    assert sorted(r.t_ns_mono for r in a.rounds) == sorted(r.t_ns_mono for r in b.rounds)
    assert sorted(map(repr, (x.phases for x in a.bursts))) == sorted(
        map(repr, (x.phases for x in b.bursts))
    )


def test_spans_under_no_session_are_said_and_names_are_text(runs, tmp_path):
    """A span file rotated apart from its sessions' spans says how many it left out (they
    vanished silently); an input named like math text (``w$_$.log``) renders as its name."""
    spans = spans_edited(
        runs["spans"], tmp_path / "rot.jsonl", lambda s: s["name"] != "spec.session"
    )
    run = read(str(spans))
    assert not run.sessions and f"{run.kinds['spans']} spec.* spans are under no" in run.notes[0]

    def own(s: dict) -> bool:  # a session span that is its own parent: said "-8 spans" left out
        s["parentSpanId"] = s["spanId"] if s["name"] == "spec.session" else s.get("parentSpanId")
        return True

    a, b = read(str(runs["spans"])), read(str(spans_edited(runs["spans"], tmp_path / "o.j", own)))
    assert not [n for n in a.notes + b.notes if "under no" in n]
    assert (len(b.sessions), len(b.rounds)) == (len(a.sessions), len(a.rounds))
    shutil.copy(runs["log"], odd := tmp_path / "w$_$.log")
    assert keys(report(odd, out=tmp_path / "odd.html"))["sessions"] == ["8"]


def test_sessions_that_ended_in_an_error_are_said_by_type(tmp_path):
    """A span file's sessions cut by an exception (an OOM, a client's cancel) are counted by
    ``error.type`` in a note: the page said nothing, and an A/B whose B ran out of memory more
    often compared shorter sessions unawares. A session that ended well adds nothing."""
    from memra_obs.wiring import build_observer

    path = tmp_path / "err.jsonl"
    obs = build_observer(env={"MEMRA_OBS_SINKS": "otel"}, spans_file=str(path))
    for exc in (None, MemoryError, TimeoutError, MemoryError, None):
        with contextlib.suppress(MemoryError, TimeoutError), obs.session("glm5") as s:
            b = s.burst(4)
            for _ in range(3):
                b.begin_round()
                for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
                    end()
                b.end_round(k=4, j=2)
            b.end()
            if exc is not None:
                raise exc("out of device memory")
    obs.shutdown()
    run = read(str(path))
    assert len(run.sessions) == 5 and len(run.rounds) == 15
    said = [n for n in run.notes if "ended in an error" in n]
    assert said == [
        "3 of 5 sessions ended in an error (MemoryError x2, TimeoutError x1): "
        "their rounds up to it are counted."
    ]
    html = report(path, out=tmp_path / "err.html")
    assert "3 of 5 sessions ended in an error (MemoryError x2, TimeoutError x1)" in html
    fine = read(str(spans_edited(path, tmp_path / "fine.jsonl", lambda s: _drop_error(s))))
    assert len(fine.sessions) == 5 and not [n for n in fine.notes if "in an error" in n]


def _drop_error(s: dict) -> bool:
    s["attributes"] = [a for a in s.get("attributes", ()) if a["key"] != "error.type"]
    return True


def test_an_output_link_is_written_through_never_replaced(runs, tmp_path):
    """``-o`` naming a link to a file writes the file (the link stays); a link to this process's
    stdout (as /dev/stdout is) gets the page on stdout (it was replaced by a regular file)."""
    (target := tmp_path / "real.html").write_text("")
    (link := tmp_path / "page.html").symlink_to(target)
    report(runs["log"], out=link)
    assert link.is_symlink() and target.read_text().startswith("<!DOCTYPE html>")
    (out := tmp_path / "out.lnk").symlink_to("/proc/self/fd/1")
    cmd = [sys.executable, "-m", "memra_obs.cli", "report", "-q", str(runs["log"]), "-o", str(out)]
    p = subprocess.run(cmd, capture_output=True, env=_env(), timeout=300)
    assert p.returncode == 0 and out.is_symlink() and p.stdout.startswith(b"<!DOCTYPE html>")


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's link needs root (lchown)")
def test_a_link_another_user_planted_in_a_sticky_directory_is_not_followed(tmp_path):
    """``-o /tmp/r.html`` where another user made ``r.html`` (or a directory on the way) a link
    to the victim's file: refused, the file intact, as the kernel's fs.protected_symlinks
    refuses ``> /tmp/r.html`` (realpath + rename went around it: the page replaced the victim's
    file). The user's own link there is still written through."""
    from memra_obs.report.main import _write

    (tmp := tmp_path / "tmp").mkdir()
    tmp.chmod(0o1777)
    (victim := tmp_path / "victim").write_text("theirs")
    (link := tmp / "r.html").symlink_to(victim)
    (up := tmp / "d").symlink_to(tmp_path)
    for x in (link, up):
        os.lchown(x, 65534, 65534)
    for out in (link, up / "victim", tmp_path / "via" / ".." / "tmp" / "r.html"):
        with pytest.raises(PermissionError, match="another user's link in a sticky directory"):
            _write(str(out), "page")
    assert victim.read_text() == "theirs"
    os.lchown(link, os.geteuid(), -1)
    _write(str(link), "page")
    assert victim.read_text() == "page" and link.is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's file needs root (chown)")
def test_a_link_planted_after_the_checks_takes_no_page_and_no_mode_is_another_users(
    tmp_path, monkeypatch
):
    """A link another user plants at a new output name between the checks and the write (a
    race a loop wins in a few tries): the page went through ``realpath`` into the victim's file
    (status 0, ``wrote``), the kernel's ``fs.protected_symlinks`` never asked. Now the page is
    renamed onto the name as given, never a resolved one: a link planted up to the rename is
    replaced, the victim intact (planted before the name is read, a link is written through and
    the kernel decides). ``sub/..`` after a linked ``sub`` is where the kernel goes, not
    ``abspath``'s ``.`` (where an input could be). A file another user left there at 0666 no
    longer gives the page its mode (they could append a script)."""
    import tempfile

    from memra_obs.report import main as report_main

    (tmp := tmp_path / "tmp").mkdir()
    tmp.chmod(0o1777)
    (victim := tmp_path / "victim").write_text("theirs")
    out, real = tmp / "r.html", tempfile.mkstemp

    def plant_then_make(**kw):  # the attacker's move, after every check
        out.symlink_to(victim)
        os.lchown(out, 65534, 65534)
        return real(**kw)

    monkeypatch.setattr(report_main.tempfile, "mkstemp", plant_then_make)
    report_main._write(str(out), "page")
    assert victim.read_text() == "theirs" and not out.is_symlink() and out.read_text() == "page"
    monkeypatch.undo()
    (deep := tmp_path / "x" / "y").mkdir(parents=True)
    (sub := tmp_path / "sub").symlink_to(deep)  # "sub/.." is x, as the kernel reads it
    report_main._write(str(tmp_path / "sub" / ".." / "p.html"), "page")
    assert (tmp_path / "x" / "p.html").read_text() == "page" and sub.is_symlink()
    assert not (tmp_path / "p.html").exists()  # abspath's reading: an input could be there
    out.unlink()
    out.write_text("theirs")
    os.chown(out, 65534, 65534)
    out.chmod(0o666)
    report_main._write(str(out), "page")
    assert out.read_text() == "page" and out.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_the_page_goes_through_no_planted_temp_link_and_keeps_the_outputs_mode(tmp_path):
    """The page goes to a fresh temporary (O_EXCL, a random name): a link planted at the old
    guessable ``<out>.tmp<pid>`` took the page into its target (and became the output). A
    report replaced keeps its mode (0600 stays private); a new one gets a new file's."""
    from memra_obs.report.main import _write

    out, victim = tmp_path / "r.html", tmp_path / "victim"
    victim.write_text("theirs")
    (planted := tmp_path / f"r.html.tmp{os.getpid()}").symlink_to(victim)
    _write(str(out), "page 1")
    mask = os.umask(0o022)
    os.umask(mask)
    assert (out.read_text(), victim.read_text(), out.is_symlink()) == ("page 1", "theirs", False)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask
    out.chmod(0o600)
    _write(str(out), "page 2")
    assert out.read_text() == "page 2" and out.stat().st_mode & 0o777 == 0o600
    assert {x.name for x in tmp_path.iterdir()} == {out.name, victim.name, planted.name}


def test_dev_stdout_redirected_to_a_file_is_written_through(runs, tmp_path):
    """``-o /dev/stdout >> FILE`` (or a link to this process's stdout): the page is appended
    to what the file held (the file was replaced: its content and the shell's later writes
    were lost)."""
    (out := tmp_path / "out.lnk").symlink_to("/proc/self/fd/1")
    cmd = [sys.executable, "-m", "memra_obs.cli", "report", "-q", str(runs["log"]), "-o"]
    for target in ("/dev/stdout", str(out), "/dev/fd/1"):
        (f := tmp_path / "app.txt").write_text("preexisting\n")
        with open(f, "a") as fh:  # >> app.txt
            p = subprocess.run([*cmd, target], stdout=fh, env=_env(), timeout=300)
        assert p.returncode == 0
        assert f.read_text().startswith("preexisting\n<!DOCTYPE html>"), target
    with open(f, "w") as fh:  # { echo before; report -o /dev/stdout; echo after; } > app.txt
        fh.write("before\n")
        fh.flush()
        subprocess.run([*cmd, "/dev/stdout"], stdout=fh, env=_env(), timeout=300, check=True)
        fh.write("after\n")
    text = f.read_text()
    assert text.startswith("before\n<!DOCTYPE html>") and text.endswith("</html>\nafter\n")


def test_standard_input_is_read(runs):
    """``-`` reads the log from standard input."""
    html = report("-", out=runs["tmp"] / "stdin.html", stdin=runs["log"].read_bytes())
    assert keys(html)["sessions"] == ["8"] and "stdin" in html


def test_standard_input_redirected_from_the_output_is_refused_and_o_dash_is_stdout(runs, tmp_path):
    """``report - -o worker.log < worker.log``: refused as ``-o worker.log`` naming the input is
    (the page replaced the log); ``-o -`` writes the page to standard output (it made a file
    named ``-``)."""
    (log := tmp_path / "w.log").write_bytes(runs["log"].read_bytes())
    cmd = [sys.executable, "-m", "memra_obs.cli", "report", "-q", "-", "-o"]
    with open(log, "rb") as fin:
        p = subprocess.run([*cmd, "w.log"], stdin=fin, capture_output=True, text=True,
                           env=_env(), cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 2 and p.stderr == "memra-obs report: -o w.log is the input -\n"
    assert log.read_bytes() == runs["log"].read_bytes()
    with open(log, "rb") as fin:
        p = subprocess.run([*cmd, "-"], stdin=fin, capture_output=True, text=True,
                           env=_env(), cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("<!DOCTYPE html>"), p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["w.log"]


def test_a_closed_stderr_or_stdout_is_one_status_not_a_traceback(runs, tmp_path):
    """Started with stderr closed (``2>&-``, a cron line): the page is written, status 0 (an
    AttributeError on ``sys.stderr``: status 1, no page); ``-o -`` with stdout closed too is
    status 2, nothing written elsewhere (``sys.stdout.flush()``: a traceback)."""
    cmd = ["sh", "-c", 'exec "$0" -m memra_obs.cli report "$@" 2>&-', sys.executable]
    p = subprocess.run([*cmd, str(runs["log"]), "-o", "p.html"], capture_output=True,
                       text=True, env=_env(), cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 0 and p.stdout == ""
    assert (tmp_path / "p.html").read_text().startswith("<!DOCTYPE html>")
    cmd[2] = cmd[2].replace("2>&-", ">&-")
    p = subprocess.run([*cmd, str(runs["log"]), "-o", "-"], capture_output=True, text=True,
                       env=_env(), cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 2 and p.stderr == "memra-obs report: /dev/stdout: Bad file descriptor\n"
    cmd[2] = cmd[2].replace(">&-", ">&- 2>&-")
    p = subprocess.run([*cmd, str(runs["log"]), "-o", "-"], env=_env(), cwd=tmp_path, timeout=300)
    assert p.returncode == 2 and sorted(x.name for x in tmp_path.iterdir()) == ["p.html"]


def test_matplotlib_with_no_writable_directory_is_one_line_and_status_2(runs, tmp_path):
    """In a read-only container (no HOME, no writable temp directory) matplotlib cannot start:
    its OSError was a traceback, status 1; it is one line naming MPLCONFIGDIR, status 2."""
    (tmp_path / "f").write_text("")
    pre = ("import sys, tempfile\n"
           "def nowhere(): raise FileNotFoundError(2, 'No usable temporary directory found')\n"
           "tempfile.gettempdir = nowhere\n"
           "from memra_obs.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    env = {k: v for k, v in _env(MPLCONFIGDIR=str(tmp_path / "f" / "mpl")).items() if k != "HOME"}
    p = subprocess.run([sys.executable, "-c", pre, "report", str(runs["log"]), "-o", "p.html"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.splitlines()[-1].startswith("memra-obs report: matplotlib cannot start: ")
    assert "MPLCONFIGDIR" in p.stderr.splitlines()[-1]
    assert not (tmp_path / "p.html").exists()


def test_page_is_self_contained_and_small(runs):
    """No script, no URL but data: and in-page anchors, under 5 MB; every section there."""
    html = report(runs["log"], runs["spans"], out=runs["tmp"] / "ab2.html")
    assert "<script" not in html
    assert not [
        u for u in re.findall(r'(?:src|href)="([^"]*)"', html) if not u.startswith(("data:", "#"))
    ]
    assert len(html.encode()) < 5e6
    from memra_obs.report.page import SECTIONS

    for s in SECTIONS:
        assert f'<section id="{s}">' in html


def test_the_generated_time_says_its_utc_offset_not_an_ambiguous_zone_name(tmp_path):
    """A page made in Shanghai said "CST", as one made in Chicago does (-0600): the stamp
    carries the UTC offset (TZ="CST-8": China Standard Time, no tz database needed)."""
    log, out = tmp_path / "w.log", tmp_path / "p.html"
    log.write_text("[glm5-phase] rounds=3 k=4 total=6.00ms | draft=1.50 verify=3.00 accept=0.60 "
                   "roll=0.45 maint=0.45 | per-round ms: draft=0.500 verify=1.000 accept=0.200 "
                   "roll=0.150 maint=0.150 total=2.000\n")  # fmt: skip
    cmd = [sys.executable, "-m", "memra_obs.cli", "report", str(log), "-o", str(out)]
    p = subprocess.run(cmd, capture_output=True, env=_env(TZ="CST-8"), timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    stamp = re.search(r"generated (\S+ \S+ \S+) by memra_obs", out.read_text())
    assert stamp and stamp.group(1).endswith(" +0800"), stamp


def test_without_matplotlib_it_says_what_to_install(tmp_path):
    """matplotlib missing: exit 2, one line naming the extra."""
    code = ("import sys; sys.modules['matplotlib'] = None; from memra_obs.cli import main; "
            f"sys.exit(main(['report', {str(tmp_path / 'x.log')!r}]))")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "memra-obs report needs matplotlib: pip install 'memra_obs[report]'"
    ]


def test_the_core_package_does_not_import_matplotlib():
    """Importing memra_obs, its CLI and the report package leaves matplotlib and numpy out."""
    code = ("import sys, memra_obs, memra_obs.cli, memra_obs.report, memra_obs.report.main; "
            "print('matplotlib' in sys.modules, 'numpy' in sys.modules)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert p.stdout.split() == ["False", "False"], p.stderr


def test_an_unreadable_input_exits_2(tmp_path):
    """A missing file: exit 2 with the file's name, no page written."""
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", str(tmp_path / "nope"),
                        "-o", str(tmp_path / "r.html")], capture_output=True, text=True, env=_env())  # fmt: skip
    assert p.returncode == 2 and "nope" in p.stderr and not (tmp_path / "r.html").exists()


def test_a_requests_file_is_refused_as_one(tmp_path):
    """The requests file given for a span file read as a log with no tagged line, rc 0: an
    empty page."""
    import memra_obs

    obs = memra_obs.configure(requests_file=str(reqs := tmp_path / "r.jsonl"))
    with obs.session("glm5") as s, s.burst(2) as b:
        for _ in range(3):
            b.begin_round(), b.end_draft(), b.end_verify(), b.end_accept(), b.end_rollback()
            b.end_round(k=2, j=1)
    obs.shutdown()
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", str(reqs), "-o",
                        str(tmp_path / "r.html")], capture_output=True, text=True, env=_env())  # fmt: skip
    assert p.returncode == 2 and not (tmp_path / "r.html").exists()
    assert (
        p.stderr == f"memra-obs report: {reqs}: a requests file (MEMRA_OBS_REQUESTS_FILE's "
        "records): the report reads a log or a span file\n"
    )
    # a log whose first line is a record (requests_file=/dev/stderr beside the lines) is a log
    (log := tmp_path / "w.log").write_text(reqs.read_text() + "\n".join(bench_report.worker_log(1)))
    assert read(str(log)).rounds


def test_workers_sharing_one_log_count_each_round_once(tmp_path):
    """Two one-session demo workers (trace level 1 + profile) in one log, each one's first
    line first: 2 workers' rounds, not a third session made of a profile whose phase line
    the other's profile had claimed (it read 3 sessions, 48 rounds for 32)."""
    a0, a1 = (demo(tmp_path, f"a{i}", "--requests", "1", "--seed", str(i), "--speed", "50",
                   MEMRA_SPEC_TRACE="1", MEMRA_SPEC_PROF="1")[0] for i in (0, 1))  # fmt: skip
    l0, l1 = ([x for x in p.read_text().splitlines() if x[:1] == "[" and x[:11] != "[memra-obs]"]
              for p in (a0, a1))  # fmt: skip
    truth = sum(r.rounds for r in legacy(a0) + legacy(a1) if isinstance(r, SummaryLine))
    (tmp_path / "mini.log").write_text("\n".join([l0[0], l1[0], *l0[1:], *l1[1:]]) + "\n")
    run = read(str(tmp_path / "mini.log"))
    assert len(read(str(a0)).rounds) + len(read(str(a1)).rounds) == truth
    assert len(run.rounds) == truth


def test_a_logs_families_past_the_cap_are_not_placed(tmp_path):
    """Each family is a section of the page (2,000 took minutes): past MEMRA_OBS_MAX_FAMILIES
    a new family's lines are unplaced, as in the tail; a bad value exits 2 naming it."""
    phase = (ROOT / "tests" / "data" / "legacy_lines.txt").read_text().split("\n")[0]
    log = tmp_path / "fams.log"
    log.write_text("".join(phase.replace("glm5", f"f{i}") + "\n" for i in range(5)))
    run = read(str(log), max_families=2)
    assert {s.family for s in run.sessions} == {"f0", "f1"} and len(run.unplaced) == 3
    assert "MEMRA_OBS_MAX_FAMILIES=2" in run.unplaced[0][1]
    out = tmp_path / "r.html"
    cmd = [sys.executable, "-m", "memra_obs.cli", "report", str(log), "-o", str(out)]
    p = subprocess.run(cmd, capture_output=True, env=_env(MEMRA_OBS_MAX_FAMILIES="0"), timeout=60)
    assert p.returncode == 2 and b"MEMRA_OBS_MAX_FAMILIES='0'" in p.stderr


def test_median_and_bootstrap():
    """The seed's median (sorted[n/2]); the bootstrap is repeatable and brackets a shift."""
    import numpy as np

    assert median(np.array([3.0, 1.0, 2.0, 4.0])) == 3.0
    rng = np.random.default_rng(1)
    a, b = rng.normal(10, 1, 4000), rng.normal(10.5, 1, 4000)
    d, lo, hi = bootstrap(a, b)
    assert (d, lo, hi) == bootstrap(a, b) and lo < 0.5 < hi and lo > 0
    d, lo, hi = bootstrap(a, rng.normal(10, 1, 4000))
    assert lo < 0 < hi


def test_progress_bar_for_large_inputs():
    """Large or unknown-size inputs get a bar; small ones do not."""
    out = io.StringIO()
    bar = Progress(True, out)
    bar.reading("small.log")(1000, 2000)  # type: ignore[operator]
    assert out.getvalue() == ""
    bar.reading("big.log")(50 << 20, 100 << 20)  # type: ignore[operator]
    assert "big.log |###############" in out.getvalue() and "52/105 MB" in out.getvalue()


def test_a_compressed_input_or_standard_input_has_no_known_total(tmp_path):
    """The bar's total is a plain file's size; a gzip'd one's decompressed size is unknown (its
    file's size would read past 100 %), as standard input's is."""
    import gzip

    (f := tmp_path / "w.log").write_bytes(b"plain\n" * 10)
    (gz := tmp_path / "w.log.gz").write_bytes(gzip.compress(f.read_bytes()))
    seen: list[int] = []
    for path in (f, gz):
        assert read(str(path), progress=lambda done, of: seen.append(of)).size == 60
    assert seen == [60, 0]


def test_bench_report_runs(tmp_path, capsys):
    """bench/bench_report.py end to end on a small log (the figure is not judged here)."""
    assert bench_report.main(["--lines", "20000", "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "memra-obs report:" in out and "load average" in out
    kinds = Counter(
        line.split(" ", 1)[0] for line in (tmp_path / "worker.log").read_text().splitlines()
    )
    assert kinds["[spec-prof-rounds]"] > kinds["[glm5-phase]"] > kinds["[spec-prof]"] > 0


def test_acceptance_section_is_the_advisors_estimate(runs):
    """The page's recommended k, E(k*) and speedup are advise() over the rounds the report read
    with the clock the inputs name (``[spec-advice] ... clock=``, the session span's
    ``memra.spec.advice.clock``: the page said "unknown" beside them), for a log, its span file
    and both as A/B; every figure of the section is there, labelled as estimates."""
    html = report(runs["log"], runs["spans"], out=runs["tmp"] / "acc.html")
    k = keys(html)
    for col, path in enumerate((runs["log"], runs["spans"])):
        run = read(str(path))
        assert run.clocks == {"sync"}  # the demo's loop drains its streams
        a = advise(run.rounds, clock="sync")
        assert a is not None and k["recommended_k"][col] == str(a.recommended_k)
        assert k["speedup"][col].startswith(f"{a.estimated_speedup.value:.3f} [")
        assert k["expected_tokens"][col].startswith(f"{a.expected_tokens.value:.3f} [")
        assert k["clock"][col] == "sync"
        # vLLM's draft acceptance rate beside the per-position alpha (two numbers, both named)
        rate = int(k["accepted"][col]) / int(k["drafted"][col])
        assert k["draft_acceptance"][col] == f"{rate:.3f}"
        assert k["alpha_0"][col].startswith(f"{a.acceptance.positions[0].alpha.value:.3f}")
    acc = html[html.index('<section id="acceptance">') :].split("</section>")[0]
    assert "Estimates" in acc and acc.count("<img") == 3


def test_an_input_naming_two_clocks_says_so(runs, tmp_path):
    """Two logs of loops timed by other clocks, concatenated: the page said the input names no
    clock; it names both, and the costs are fitted as host."""
    text = Path(runs["log"]).read_text()
    both = tmp_path / "both.log"
    both.write_text(text + text.replace("clock=sync", "clock=event"))
    html = report(both, out=tmp_path / "both.html")
    assert keys(html)["clock"] == ["several (event, sync): fitted as host"]


def test_trace_only_logs_compare_burst_means_and_an_empty_input_still_reports(tmp_path):
    """Phase lines only (no profile, no rows): A/B falls back to one per-round mean a burst
    and still flags a 20% verify slowdown; an empty input gives a page of empty sections."""
    a, b, e = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "empty.log"
    for path, kw in ((a, {"seed": 4}), (b, {"seed": 5, "verify_scale": 1.2})):
        lines = bench_report.worker_log(80, **kw)  # type: ignore[arg-type]
        path.write_text("\n".join(x for x in lines if x.startswith("[glm5-phase")) + "\n")
    e.write_text("")
    html = report(a, b, out=tmp_path / "ab.html")
    flags = dict(re.findall(r'data-ab="(\w+)" data-flag="(\d)"', html))
    assert flags["verify"] == "1" and flags["draft"] == "0"
    assert "bursts' per-round means" in html and keys(html)["rounds_own"] == ["0", "0"]
    assert html.count("no round with known k and j (a trace-only log") == 2  # says so, no estimate
    assert keys(html)["recommended_k"] == ["-", "-"]
    assert keys(html)["wall_median_ms"] == ["-", "-"]  # no round of its own: no median (not nan)
    k = keys(report(e, out=tmp_path / "empty.html"))
    assert k["sessions"] == ["0"] and k["lines"] == ["0"] and k["ttft_median_ms"] == ["-"]


def test_trace_only_ab_compares_per_round_means_whatever_the_burst_size(tmp_path):
    """Phase lines only: each burst gives its per-round means (totals over its rounds), so
    bursts of 2 and of 6 rounds at 10 ms a round read as 10 ms, not as 20 and 60."""
    from memra_obs.legacy import phase_lines
    from memra_obs.records import SpecPhaseNs

    def log(path: Path, ms: int) -> Path:
        ps = [SpecPhaseNs(draft=n * 2 * 10**6, verify=n * (ms - 2) * 10**6, rounds=n)
              for n in (2, 6, 2, 6, 3, 4, 5)]  # fmt: skip
        path.write_text("".join(phase_lines(p, "glm5-phase", "glm5-phase-v", 4)[0] + "\n"
                                for p in ps))  # fmt: skip
        return path

    rows = ab_table(View("A", read(str(log(tmp_path / "a.log", 10)))),
                    View("B", read(str(log(tmp_path / "b.log", 12)))))  # fmt: skip
    got = [(r.metric, r.med_a, r.med_b) for r in rows[:3]]
    assert got == [("wall", pytest.approx(10.0, abs=1e-2), pytest.approx(12.0, abs=1e-2)),
                   ("draft", 2.0, 2.0), ("verify", 8.0, 10.0)]  # fmt: skip


def test_long_bursts_of_a_trace_only_log_cost_a_record_each(tmp_path):
    """A phase line's rounds stay one run (as the tail publishes them), not a record a round:
    30 lines of 65,536-round bursts (5 KB) took 1.4 GB and 11 s; the page counts every round."""
    line = ("[glm5-phase] rounds=65536 k=4 total=65536.00ms | draft=13107.20 verify=32768.00 "
            "accept=6553.60 roll=6553.60 maint=6553.60 | per-round ms: draft=0.200 verify=0.500 "
            "accept=0.100 roll=0.100 maint=0.100 total=1.000\n")  # fmt: skip
    (log := tmp_path / "w.log").write_text(line * 8)
    v = View("w.log", read(str(log)))
    assert len(v.run.rounds) == 8 * 65536 and len(v.wall_ms) <= 8 * 6  # a burst: <= 6 runs
    assert sorted({round(w, 6) for w in v.wall_ms}) == [1.0]
    k = keys(report(log, out=tmp_path / "w.html"))
    assert k["rounds"] == k["rounds_means"] == [str(8 * 65536)] and k["rounds_own"] == ["0"]
    assert k["acc_rounds"] == [f"0; {8 * 65536}"]


def test_a_pods_log_as_its_collector_wrote_it_reads_as_the_workers(runs, tmp_path):
    """The log as /var/log/pods holds it (CRI: ``<time> stderr F ``, also with lines in ``P``
    parts) or Docker's json-file (also with lines in 16 KiB parts): the records of the plain log (it was an empty page, exit 0, "a trace-only log"). A log with
    no tagged line at all says so in the closing line."""
    import json

    plain = read(str(runs["log"]))
    lines = runs["log"].read_text().splitlines()
    cri, dock = tmp_path / "cri.log", tmp_path / "docker.log"
    cri.write_text(
        "".join(f"2026-12-04T23:30:04.{i:09d}Z stderr F {x}\n" for i, x in enumerate(lines))
    )
    dock.write_text(
        "".join(json.dumps({"log": x + "\n", "stream": "stderr"}) + "\n" for x in lines)
    )
    (parts := tmp_path / "cri-parts.log").write_bytes(cri_parts(lines))  # lines in P parts
    (dparts := tmp_path / "docker-parts.log").write_bytes(docker_parts(lines))  # 16 KiB parts

    def seen(run):  # rebuilt boundaries are drawn anew each read: the counts and costs
        return len(run.sessions), run.kinds, [(r.k, r.j, r.ctx, r.split_ns) for r in run.rounds]

    for path in (cri, dock, parts, dparts):
        assert seen(read(str(path))) == seen(plain)
    (other := tmp_path / "other.log").write_text("INFO started\nINFO serving\n")
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "report", str(other), "-o", str(tmp_path / "o.html")],
                       capture_output=True, text=True, env=_env(), timeout=120)  # fmt: skip
    assert (
        p.returncode == 0
        and "0 lines refused, 0 not placed (no tagged line among its 2 lines)" in p.stderr
    )


def test_each_family_is_advised_on_its_own(runs, tmp_path):
    """A log of two families: acceptance and the advice per family, each ``advise`` over that
    family's rounds alone (one over both told a family whose drafts were all refused to draft
    6). One family's page is unchanged: no family heading; nor an A/B whose B has rows only
    (its family "unknown": the pair was split under two headings)."""
    from memra_obs.analysis import advise

    log, _ = demo(tmp_path, "fam", "--requests", "8", "--seed", "13", "--speed", "5",
                  "--families", "glm5,qwen")  # fmt: skip
    run = read(str(log))
    fam = {s.session: s.family for s in run.sessions}
    names = sorted(set(fam.values()))
    assert names == ["glm5", "qwen"]
    html = report(log, out=tmp_path / "f.html")
    want = []
    for name in names:
        a = advise([r for r in run.rounds if fam[r.session] == name], clock="host")
        want.append("-" if a is None else str(a.recommended_k))
        assert f"<h3>family {name}</h3>" in html
    assert keys(html)["recommended_k"] == want and want != ["-", "-"]
    rows = tmp_path / "rows.log"  # the profile's lines only: no phase line names the family
    rows.write_text(
        "".join(x for x in runs["log"].read_text().splitlines(True) if "-phase" not in x)
    )
    for html in (report(runs["log"], out=tmp_path / "one.html"),
                 report(runs["log"], rows, out=tmp_path / "ab.html")):  # fmt: skip
        assert "<h3>family" not in html and len(keys(html)["recommended_k"]) in (1, 2)


def test_the_memory_figure_gives_an_ordinal_one_colour_in_every_panel(tmp_path, monkeypatch):
    """A/B where A saw device 0 and B device 1: their lines differ in colour (each panel coloured
    its own devices from the start, so both were the first colour under one shared legend);
    before and after share a device's colour; a few sessions' points are marked."""
    from matplotlib.axes import Axes

    from memra_obs.legacy import prof_line
    from memra_obs.records import SpecFirstTokenProf
    from memra_obs.report import page
    from memra_obs.report.stats import View

    views = []
    for name, dev in (("A", 0), ("B", 1)):
        prof = SpecFirstTokenProf(free_mb_before=[(dev, 100)], free_mb_after=[(dev, 90)])
        (log := tmp_path / f"{name}.log").write_text((prof_line(prof) + "\n") * 2)
        views.append(View(name, read(str(log))))
    drawn: dict[str, tuple[object, object]] = {}
    plot = Axes.plot

    def spy(self, *args, **kw):
        drawn[kw["label"]] = (kw["color"], kw["marker"])
        return plot(self, *args, **kw)

    monkeypatch.setattr(Axes, "plot", spy)
    assert "<figure" in page.free_device_memory(views)
    assert (
        drawn["device 0 before"] == drawn["device 0 after"] and drawn["device 0 before"][1] == "o"
    )
    assert drawn["device 0 before"][0] != drawn["device 1 before"][0]


def _ab_row(a, b, name="wall"):
    import numpy as np

    from memra_obs.report.stats import ABRow

    a, b = np.asarray(a, float), np.asarray(b, float)
    return ABRow(name, float(np.sort(a)[len(a) // 2]), float(np.sort(b)[len(b) // 2]),
                 *bootstrap(a, b), len(a), len(b), "rounds")  # fmt: skip


def test_one_round_against_one_is_not_flagged():
    """One round each (a short session, a few bursts of a trace-only log): the bootstrap's
    "interval" is the point B - A, and every row read "B slower" on no evidence."""
    assert not _ab_row([3.4418], [3.6086]).flagged
    assert not _ab_row([3.4, 3.5, 3.3], [3.9, 4.0, 4.1]).flagged  # under 6: no 95% interval


def test_a_phase_growing_from_zero_is_flagged_and_says_no_nan():
    """A median of 0 in A printed "+nan%" and never flagged a phase that appeared in B."""
    import numpy as np

    from memra_obs.report.page import _ab

    rng = np.random.default_rng(0)
    row = _ab_row(np.zeros(500), 0.158 + rng.normal(0, 0.01, 500), "rollback")
    assert row.lo > 0 and row.flagged
    html = _ab([row])
    assert "nan" not in html.lower() and "B slower (median A is 0)" in html


def test_an_empty_input_is_not_called_trace_only(tmp_path):
    from memra_obs.report.page import acceptance

    (p := tmp_path / "empty.log").write_text("")
    text = acceptance([View("empty.log", run := read(str(p)))])
    assert (run.lines, run.kind) == (0, "log")
    assert "trace-only" not in text and "no round at all" in text


def test_a_run_that_never_drafted_says_so_in_its_figures_too(tmp_path):
    """Rows with k = 0 throughout: the acceptance figures said "no round with known k and j"
    beside a table counting those rounds as known and a text saying none drafted."""
    lines = [re.sub(r" k=\d+ j=\d+ ", " k=0 j=0 ", x) for x in bench_report.worker_log(3, seed=9)]
    (log := tmp_path / "k0.log").write_text("\n".join(lines) + "\n")
    html = report(log, out=tmp_path / "k0.html")
    assert keys(html)["drafted"] == ["0"] and keys(html)["rounds_own"] != ["0"]
    svgs = [base64.b64decode(x).decode() for x in re.findall(r"svg\+xml;base64,([^\"]+)", html)]
    assert not any("no round with known k and j" in s for s in svgs)
    assert sum("no round drafted (k = 0)" in s for s in svgs) == 2


def test_a_round_span_with_counts_no_worker_writes_is_refused(runs, tmp_path):
    """k = 2**70 or NaN on a round past the logged 64 (no row checks it) was a traceback, and
    k = 10**8 minutes of advising over 10**8 positions: the round span is refused instead."""
    good = read(str(runs["spans"]))
    for value in ({"intValue": str(2**70)}, {"doubleValue": "NaN"}, {"intValue": str(10**8)}):
        done: list[dict] = []

        def keep(s: dict, v: dict = value, done: list[dict] = done) -> bool:
            at = {a["key"]: a["value"] for a in s.get("attributes", ())}
            if (
                s["name"] == "spec.round"
                and not done
                and int(at["memra.spec.round"]["intValue"]) >= 64
            ):
                done.append(s)
                _set(s, "memra.spec.k", v)
            return True

        run = read(str(spans_edited(runs["spans"], tmp_path / "k.jsonl", keep)))
        assert done and len(run.sessions) == len(good.sessions), value
        assert len(run.refused) == 1 and "counts no worker writes" in run.refused[0][1]
        assert View("k", run).advice is not None and max(r.k for r in run.rounds) < 2**16
    assert keys(report(tmp_path / "k.jsonl", out=tmp_path / "k.html"))["refused"] == ["1"]


def _section(html: str, sid: str) -> str:
    return html.split(f'<section id="{sid}">')[1].split("</section>")[0]


def test_a_span_files_sessions_and_refusals_name_their_trace_ids(runs, tmp_path):
    """A span file's summary rows and its refused spans name the trace id Jaeger looks up (the
    rows said "recomputed", a refusal a span id: Ctrl-F for a slow trace found nothing)."""
    each = [s for line in runs["spans"].read_text().splitlines()
            for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]
            for s in ss["spans"]]  # fmt: skip
    sessions = {s["traceId"] for s in each if s["name"] == "spec.session"}
    html = report(runs["spans"], out=tmp_path / "s.html")
    rows = re.findall(r'<tr><td class="">([0-9a-f]{32})</td>', _section(html, "summaries"))
    assert len(rows) == len(read(str(runs["spans"])).logs) > 0 and set(rows) <= sessions
    seen: list[dict] = []
    spans = spans_edited(runs["spans"], tmp_path / "nov.jsonl",
                         _first("spec.verify", lambda s: seen.append(s) or False))  # fmt: skip
    refused = _section(report(spans, out=tmp_path / "r.html"), "refused")
    assert f"of trace {seen[0]['traceId']} lacks a phase span" in refused


def test_tabs_tell_reports_apart_and_a_span_file_says_when_it_ran(runs, tmp_path):
    """The tab title starts with the input (every tab read "memra-obs report: ..." cut short);
    a span file's sessions' start times are on the page, in UTC (nothing said when the data was
    recorded: every span file is memra-obs-spans.jsonl); a log's lines carry none: "-"."""
    html = report(runs["spans"], out=tmp_path / "s.html")
    assert re.search(r"<title>demo\.jsonl - memra-obs report</title>", html)
    starts = [int(s["startTimeUnixNano"]) // 10**9 for line in runs["spans"].read_text().splitlines()
              for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]
              for s in ss["spans"] if s["name"] == "spec.session"]  # fmt: skip
    at = [time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x)) for x in (min(starts), max(starts))]
    assert keys(html)["recorded"] == [f"{at[0]} to {at[1]}"]
    html = report(runs["log"], runs["spans"], out=tmp_path / "ab.html")
    assert "<title>A: demo.log vs B: demo.jsonl - memra-obs report</title>" in html
    assert keys(html)["recorded"] == ["-", f"{at[0]} to {at[1]}"]


def test_standard_input_is_left_open_and_only_the_gzip_magic_means_gzip(tmp_path):
    """read("-") reads fd 0 without closing it (it is the caller's); a log whose first byte
    is 0x1f but is no gzip stream is read as a log."""
    r, w = os.pipe()
    os.write(w, b"plain\n")
    os.close(w)
    saved = os.dup(0)
    try:
        os.dup2(r, 0)
        assert (read("-").lines, os.fstat(0).st_ino) == (1, os.fstat(r).st_ino)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(r)
    (f := tmp_path / "us.log").write_bytes(b"\x1f unit separator\nplain\n")
    assert (read(str(f)).kind, read(str(f)).lines) == ("log", 2)
    f.write_bytes(b'debug: sent {"resourceSpans": []}\nplain\n')  # a log, naming spans
    assert read(str(f)).kind == "log"
    f.write_bytes(b' {"resourceSpans": []}\n')  # a span file, indented
    assert read(str(f)).kind == "spans"


def test_a_long_value_in_a_runs_column_wraps_when_printed():
    """The cost model's note ("draft slope fitted negative (-52757 ns): clamped to 0; verify
    slope ...") sat in a cell that never wraps: the printed acceptance table ran 728 px on
    720 px of paper, on the runs whose fit clamped (tests/test_report_browser.py saw it)."""
    from memra_obs.report import page

    note = "draft slope fitted negative (-52757 ns): clamped to 0; verify slope fitted negative"
    html = page.by_run([type("V", (), {"label": "A"})()], ["estimate"],
                       lambda v: [("k", ("recommended k",), "6"), ("cost", ("cost model",), note)])  # fmt: skip
    assert '<td class="n" data-key="k">6</td>' in html
    assert f'<td class="t" data-key="cost">{note}</td>' in html


def test_a_rotated_span_files_newer_half_says_its_sessions_lack_bursts(runs, tmp_path):
    """After the span file rotated, ``FILE`` alone holds session spans whose bursts are in
    ``FILE.1``: the page counted fewer rounds, unsaid but for a note blaming dropped records."""
    good = read(str(runs["spans"]))
    assert not any("sessions lack" in n for n in good.notes), good.notes
    newer = spans_edited(
        runs["spans"], tmp_path / "newer.jsonl", _first("spec.burst", lambda s: False)
    )
    notes = [n for n in read(str(newer)).notes if "sessions lack" in n]
    assert len(notes) == 1 and notes[0].startswith("1 sessions lack 1 of the bursts"), notes
    assert "cat FILE.1 FILE | memra-obs report -" in notes[0]


@pytest.mark.parametrize("cut", ["tail -c", "BOM"])
def test_a_span_file_whose_first_line_is_cut_is_read_as_spans(runs, tmp_path, cut):
    """``tail -c`` (or ``split -b``) leaves a span file's first line partial, and a BOM may lead
    it: the kind was the first line's, so the file read as a log: an empty page, exit 0."""
    data = runs["spans"].read_bytes()
    first = data.index(b"\n")
    data = data[first // 2 :] if cut == "tail -c" else b"\xef\xbb\xbf" + data
    (path := tmp_path / "cut.jsonl").write_bytes(data)
    run, good = read(str(path)), read(str(runs["spans"]))
    assert run.kind == "spans"
    assert [n for n, _, _ in run.refused] == ([1] if cut == "tail -c" else [])
    assert len(run.sessions) >= len(good.sessions) - 1 > 0


def test_a_span_time_past_int64_is_refused_not_a_traceback(runs, tmp_path):
    """OTLP's times are fixed64: one past 2^63 ns crashed the page (OverflowError, exit 1)."""
    damage = _first("spec.maint", lambda s: _set_time(s, "18446744073709551615"))
    run = read(str(spans_edited(runs["spans"], tmp_path / "t.jsonl", damage)))
    assert len(run.refused) == 1 and "past 2^63" in run.refused[0][1]
    View("t", run)  # the page's arrays build


def _set_time(s: dict, ns: str) -> bool:
    s["endTimeUnixNano"] = ns
    return True


def test_one_row_of_a_huge_k_keeps_the_page_small(runs, tmp_path):
    """One ``[spec-prof-rounds]`` row with k = j = 65535 (a u16 -1) drew 65,536 positions: a
    41 MB page in 29 s. The positions table and figure show the first LIST_CAP positions."""
    text = runs["log"].read_text()
    text = re.sub(
        r"(\[spec-prof-rounds\] row=0 .*?) k=\d+ j=\d+", r"\1 k=65535 j=65535", text, count=1
    )
    (log := tmp_path / "bigk.log").write_text(text)
    html = report(log, out=tmp_path / "bigk.html")
    assert len(html) < 3 << 20, len(html)
    assert "more not listed" in html


def test_ab_of_trace_only_logs_resamples_the_sessions_they_were_read_into(tmp_path):
    """Trace-only logs (phase lines, no rows) of one configuration: each burst resampled as its
    own draw, 3 of 8 pairs were flagged (bursts of one session share its prompt and acceptance;
    the demo read "wall B faster by 13%"). By the sessions the bursts were read into, none is,
    and the rows say from how many sessions."""
    for i in range(8):
        for name, seed in (("a", 1000 + i), ("b", 2000 + i)):
            lines = [x for x in bench_report.worker_log(12, seed=seed) if "-phase" in x]
            (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")
        rows = ab_table(View("A", read(str(tmp_path / "a.log"))),
                        View("B", read(str(tmp_path / "b.log"))))  # fmt: skip
        assert not [r.metric for r in rows if r.flagged], i
        assert rows[0].sessions is not None and min(rows[0].sessions) >= 1


def test_ab_says_when_a_and_b_drafted_other_ks(tmp_path):
    """A at k = 4, B at k = 6: per round, B's draft and verify are bound to be longer, and the
    page compared them as alike ("draft B slower by 7.2%"), unsaid."""
    lines = bench_report.worker_log(12, seed=1)
    (a := tmp_path / "a.log").write_text("\n".join(lines) + "\n")
    b_lines = [x.replace(" k=4 ", " k=6 ") if "-phase" in x else x for x in lines]
    (b := tmp_path / "b.log").write_text("\n".join(b_lines) + "\n")
    html = report(a, b, out=tmp_path / "ab.html")
    assert re.search(r"not recorded alike \([^)]*k drafted: A [0-9-]+, B [0-9-]+", html)
