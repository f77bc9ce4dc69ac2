"""The report page: one HTML file, self-contained (figures inline, no script, no request).

Sections in order, each an ``<section id=...>``: ``ab`` (two inputs only), ``totals``,
``round-wall``, ``phases``, ``first-token``, ``acceptance``, ``memory``, ``summaries``,
``refused``, ``notes``. Every number in the tables carries ``data-key`` so tests (and
anyone scripting over reports) read them without scraping prose; each says which rounds it
covers, because a log's rows, its burst means and a span file's sampled rounds differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

import numpy as np

from .. import __version__
from . import acceptance, figures
from .stats import REL_THRESHOLD, ABRow, View, median, slow_rounds

__all__ = ["SECTIONS", "render", "totals"]

SECTIONS = (
    "ab",
    "totals",
    "round-wall",
    "phases",
    "first-token",
    "acceptance",
    "memory",
    "summaries",
    "refused",
    "notes",
)
LIST_CAP = 200  # rows of the summary and refusal tables shown per run (the rest counted)

CSS = """
body{font:14px/1.45 system-ui,sans-serif;color:#222;max-width:1200px;margin:0 auto;padding:0 16px 40px}
h1{font-size:22px;margin:18px 0 4px}h2{font-size:17px;border-bottom:1px solid #ccc;margin-top:28px}
h3{font-size:14px;margin:14px 0 4px}nav a{margin-right:10px}figure{margin:10px 0}
figure img{width:100%;height:auto}figcaption,.note,.meta{color:#555;font-size:12.5px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}td,th{border:1px solid #ddd;padding:2px 7px}
th{background:#f4f4f4;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cols{display:grid;grid-template-columns:repeat(auto-fit,minmax(320px,1fr));gap:18px}
.flag{background:#fde2e1;font-weight:600}.bad{background:#fde2e1}.pending{background:#fff6dd;padding:6px}
.scroll{overflow-x:auto}
@media print{nav{display:none}section,figure,table{break-inside:avoid}body{max-width:none}}
"""


def totals(v: View) -> list[tuple[str, str, str, Any]]:
    """(key, quantity, which lines or rounds it covers, value) for one run's table column."""
    r, c = v.run, v.cols
    own, kj = c.own, "rounds with k, j known"
    ttft = np.array([f.prof.total_ms() for f in r.first_tokens])
    printed = [g.summary for g in r.logs if g.summary is not None]
    rows: list[tuple[str, str, str, Any]] = [
        ("input", "input", "", f"{r.name} ({r.kind})"),
        ("bytes", "bytes", "", r.size),
        ("lines", "lines", "", r.lines),
    ]
    for kind in ("phase", "verify", "prof", "prof_rounds", "prof_summary", "spans"):
        rows.append((f"lines_{kind}", f"{kind} lines", "the input's lines", r.kinds[kind]))
    rows += [
        ("refused", "lines the parser refused", "the input's lines", len(r.refused)),
        ("unplaced", "valid lines the rebuild could not place", "the log's lines", len(r.unplaced)),
        ("sessions", "sessions", "all", len(r.sessions)),
        ("bursts", "bursts", "all", len(r.bursts)),
        ("rounds", "rounds", "all", len(r.rounds)),
        ("rounds_own", "rounds with their own measurement", "rows / round spans", int(own.sum())),
        ("rounds_means", "rounds with only their burst's means", "the others", int((~own).sum())),
        ("drafted", "drafted tokens (sum of k)", kj, int(c.k[own].sum())),
        ("accepted", "accepted tokens (sum of j)", kj, int(c.j[own].sum())),
        ("seq_rows", "per-row-arm verify rows", kj, sum(x.seq_rows for x in r.rounds if x.k >= 0)),
        ("wall_median_ms", "median round wall, ms", "own", f"{median(c.metric('wall')):.3f}"),
        ("ttft_n", "first-token profiles", "sessions with [spec-prof]", len(ttft)),
        ("ttft_median_ms", "median TTFT, ms", "sessions with [spec-prof]", f"{median(ttft):.3f}"),
        ("round_logs", "sessions with a round log", "their first 64 rounds", len(r.logs)),
        ("slow_rounds", "slow rounds (the summary's rule)", "per session", sum(slow_rounds(r))),
        ("summaries", "[spec-prof-summary] lines", "printed / recomputed", len(printed)),
        (
            "slow_rounds_printed",
            "slow rounds they print",
            "",
            sum(x.slow_rounds or 0 for x in printed),
        ),
    ]
    return rows


def _td(x: Any, key: str = "", cls: str = "n") -> str:
    k = f' data-key="{key}"' if key else ""
    return f'<td class="{cls}"{k}>{escape(str(x))}</td>'


def _totals_table(views: Sequence[View]) -> str:
    head = "".join(f"<th>{escape(v.label)}</th>" for v in views)
    cols = [totals(v) for v in views]
    body = "".join(
        f"<tr><td>{escape(label)}</td><td>{escape(covers)}</td>"
        + "".join(_td(col[i][3], key) for col in cols)
        + "</tr>"
        for i, (key, label, covers, _) in enumerate(cols[0])
    )
    return f"<table><tr><th>quantity</th><th>covers</th>{head}</tr>{body}</table>"


def _ab_table(rows: Sequence[ABRow]) -> str:
    out = []
    for r in rows:
        verdict = (
            f"B {'slower' if r.diff > 0 else 'faster'} by {abs(r.rel):.1%}"
            if r.flagged
            else "no change shown"
        )
        out.append(
            f'<tr data-ab="{r.metric}" data-flag="{int(r.flagged)}"{" class=flag" if r.flagged else ""}>'
            f"<td>{r.metric}</td><td>{r.population}</td>{_td(r.n_a)}{_td(r.n_b)}"
            f"{_td(f'{r.med_a:.4f}')}{_td(f'{r.med_b:.4f}')}{_td(f'{r.diff:+.4f}')}"
            f"{_td(f'[{r.lo:+.4f}, {r.hi:+.4f}]')}{_td(f'{r.rel:+.2%}')}<td>{verdict}</td></tr>"
        )
    return (
        "<table><tr><th>per round</th><th>population</th><th>n A</th><th>n B</th><th>median A, ms</th>"
        "<th>median B, ms</th><th>B - A</th><th>95% CI (bootstrap)</th><th>relative</th>"
        f"<th>verdict</th></tr>{''.join(out)}</table><p class=note>Medians are the seed's "
        "(sorted[n/2]). The CI resamples A and B independently (1000 resamples, fixed seed, at "
        f"most 20,000 values a run). Flagged: the CI excludes 0 and |B - A| is at least "
        f"{REL_THRESHOLD:.0%} of median A.</p>"
    )


def _summaries(v: View) -> str:
    slow = slow_rounds(v.run)
    rows = []
    for g, s in list(zip(v.run.logs, slow, strict=True))[:LIST_CAP]:
        m = g.summary
        vals = (
            ["-"] * 14
            if m is None
            else [
                m.rounds,
                m.k_mean,
                m.j_mean,
                m.accept,
                m.tok_per_round,
                m.wall_mean_ms,
                m.wall_min_ms,
                m.wall_med_ms,
                m.wall_max_ms,
                m.slow_rounds,
                m.draft_mean_ms,
                m.verify_mean_ms,
                m.seq_rows_total,
                f"{m.ctx_first}..{m.ctx_last}",
            ]
        )
        bad = m is None or m.slow_rounds != s or m.rounds != len(g.rows)
        line = g.lineno or ("recomputed" if m is not None else "none")
        cells = "".join(_td(x) for x in vals[:10]) + _td(s, cls="n bad" if bad else "n")
        rows.append(
            f"<tr>{_td(line)}{_td(len(g.rows))}{cells}{''.join(_td(x) for x in vals[10:])}</tr>"
        )
    more = len(v.run.logs) - LIST_CAP
    return (
        f"<h3>{escape(v.label)}</h3><div class=scroll><table><tr><th>line</th><th>rows</th><th>rounds</th>"
        "<th>k_mean</th><th>j_mean</th><th>accept</th><th>tok/round</th><th>wall mean</th><th>min</th>"
        "<th>med</th><th>max</th><th>slow (printed)</th><th>slow (rule, rows)</th><th>draft_mean</th>"
        f"<th>verify_mean</th><th>seq_rows</th><th>ctx</th></tr>{''.join(rows)}</table></div>"
        + (f"<p class=note>{more} more round logs not listed.</p>" if more > 0 else "")
    )


def _refused(v: View) -> str:
    r = v.run
    items = [(n, why, text) for n, why, text in r.refused] + [
        (n, f"unplaced: {w}", "") for n, w in r.unplaced
    ]
    if not items:
        return f"<h3>{escape(v.label)}</h3><p>Nothing refused: every tagged line parsed and was placed.</p>"
    rows = "".join(
        f"<tr>{_td(n or '-')}<td>{escape(w)}</td><td><code>{escape(t[:120])}</code></td></tr>"
        for n, w, t in items[:LIST_CAP]
    )
    more = (
        f"<p class=note>{len(items) - LIST_CAP} more not listed.</p>"
        if len(items) > LIST_CAP
        else ""
    )
    return (
        f"<h3>{escape(v.label)}</h3><p>{len(r.refused)} refused, {len(r.unplaced)} unplaced.</p>"
        f"<table><tr><th>line</th><th>reason</th><th>line starts</th></tr>{rows}</table>{more}"
    )


NOTES = """<ul>
<li><b>Own measurement</b>: a log's rounds with a <code>[spec-prof-rounds]</code> row (the first
64 rounds of each session; exact to the worker's f32, rollback and maint split from rest_ms in
the burst's ratio) and a span file's <code>spec.round</code> spans. Other rounds carry their
burst's per-round means (the <code>[glm5-phase]</code> line) and unknown k, j: they count in
rounds and in the per-burst shares, never in tokens, acceptance or the wall distribution.</li>
<li><b>Slow rounds</b>: the seed's rule, per session over its logged rows: wall &gt; f32(1.5 x
that session's median), median = sorted[n/2]; the summary table checks it against each printed
line. The red line in the wall figure is the same rule over the pooled rounds.</li>
<li><b>Sessions</b> of a log are rebuilt as <code>memra-obs tail</code> rebuilds them (no ids in
the lines; concurrent loop threads interleave and are attributed by adjacency).</li>
<li>Phase times under <code>MEMRA_SPEC_TRACE</code> are drained shares, not untraced walls.</li>
</ul>"""


def render(views: Sequence[View], ab: Sequence[ABRow] | None, step: Callable[[str], None]) -> str:
    """The whole page; ``step(name)`` is called before each figure (for a progress line)."""

    def fig(name: str, fn: Callable[[Sequence[View]], str | None]) -> str:
        step(name)
        return fn(views) or ""

    def sec(sid: str, title: str, body: str) -> str:
        return f'<section id="{sid}"><h2>{title}</h2>{body}</section>'

    names = " vs ".join(escape(v.label) for v in views)
    parts = [
        f"<header><h1>memra-obs report</h1><p class=meta>{names}<br>generated "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} by memra_obs {__version__}</p></header><nav>"
        + "".join(f'<a href="#{s}">{s}</a>' for s in SECTIONS if s != "ab" or ab)
        + "</nav>"
    ]
    if ab:
        parts.append(sec("ab", "A/B: B against A", _ab_table(ab)))
    parts.append(sec("totals", "Totals and what they cover", _totals_table(views)))
    parts.append(
        sec(
            "round-wall",
            "Round wall",
            fig("wall", figures.wall_distribution) + fig("wall/index", figures.wall_by_index),
        )
    )
    split = (
        fig("verify split", figures.verify_split)
        or "<p>No level-2 ([tag-v]) lines: trace level 1.</p>"
    )
    parts.append(
        sec(
            "phases",
            "Phase shares",
            fig("rounds", figures.shares_by_round)
            + fig("bursts", figures.shares_by_burst)
            + "<h3>Level-2 verify split</h3>"
            + split,
        )
    )
    parts.append(
        sec(
            "first-token",
            "First token",
            fig("waterfall", figures.waterfall) + fig("ttft", figures.ttft),
        )
    )
    step("acceptance")
    cols = "".join(
        f"<div><h3>{escape(v.label)}</h3>{acceptance.section(v.run.rounds)}</div>" for v in views
    )
    parts.append(sec("acceptance", "Acceptance (estimates)", f"<div class=cols>{cols}</div>"))
    parts.append(sec("memory", "Free device memory", fig("memory", figures.free_memory)))
    parts.append(sec("summaries", "[spec-prof-summary] lines", "".join(map(_summaries, views))))
    parts.append(sec("refused", "What the parser refused", "".join(map(_refused, views))))
    notes = "".join(
        f"<p class=note>{escape(v.label)}: {escape(n)}</p>" for v in views for n in v.run.notes
    )
    parts.append(sec("notes", "What each number covers", NOTES + notes))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
        'content="width=device-width,initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>memra-obs report: {names}</title><style>{CSS}</style></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )
