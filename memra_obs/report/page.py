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

from ..legacy import SummaryLine
from ..version import __version__
from . import acceptance, figures
from .stats import CAP, N_BOOT, REL_THRESHOLD, ABRow, View, median, slow_rounds

__all__ = ["SECTIONS", "render", "totals"]

SECTIONS = ("ab", "totals", "round-wall", "phases", "first-token", "acceptance", "memory",
            "summaries", "refused", "notes")  # fmt: skip
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


def _table(head: Sequence[str], rows: Sequence[str]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f"<div class=scroll><table><tr>{th}</tr>{''.join(rows)}</table></div>"


def _totals_table(views: Sequence[View]) -> str:
    cols = [totals(v) for v in views]
    rows = [f"<tr><td>{escape(label)}</td><td>{escape(covers)}</td>"
            + "".join(_td(col[i][3], key) for col in cols) + "</tr>"
            for i, (key, label, covers, _) in enumerate(cols[0])]  # fmt: skip
    return _table(["quantity", "covers", *(v.label for v in views)], rows)


def _ab_table(rows: Sequence[ABRow]) -> str:
    out = []
    for r in rows:
        verdict = (
            f"B {'slower' if r.diff > 0 else 'faster'} by {abs(r.rel):.1%}"
            if r.flagged
            else "no change shown"
        )
        nums = (r.n_a, r.n_b, f"{r.med_a:.4f}", f"{r.med_b:.4f}", f"{r.diff:+.4f}",
                f"[{r.lo:+.4f}, {r.hi:+.4f}]", f"{r.rel:+.2%}")  # fmt: skip
        out.append(f'<tr data-ab="{r.metric}" data-flag="{int(r.flagged)}"{" class=flag" * r.flagged}>'
                   f"<td>{r.metric}</td><td>{r.population}</td>{''.join(map(_td, nums))}<td>{verdict}</td></tr>")  # fmt: skip
    head = ["per round", "population", "n A", "n B", "median A, ms", "median B, ms", "B - A",
            "95% CI (bootstrap)", "relative", "verdict"]  # fmt: skip
    return _table(head, out) + (
        "<p class=note>Medians are the seed's (sorted[n/2]). The CI resamples A and B "
        f"independently ({N_BOOT} resamples, fixed seed, at most {CAP:,} values a run). Flagged: "
        f"the CI excludes 0 and |B - A| is at least {REL_THRESHOLD:.0%} of median A.</p>"
    )


_SUMMARY = list(SummaryLine._fields)


def _summaries(v: View) -> str:
    rows = []
    for g, slow in list(zip(v.run.logs, slow_rounds(v.run), strict=True))[:LIST_CAP]:
        m = g.summary
        vals = [getattr(m, f) if m is not None else "-" for f in _SUMMARY]
        bad = m is None or m.slow_rounds != slow or m.rounds != len(g.rows)
        line = g.lineno or ("recomputed" if m is not None else "none")
        rule = _td(slow, cls="n bad" if bad else "n")
        rows.append(f"<tr>{_td(line)}{_td(len(g.rows))}{''.join(map(_td, vals[:10]))}{rule}"
                    f"{''.join(map(_td, vals[10:]))}</tr>")  # fmt: skip
    more = len(v.run.logs) - LIST_CAP
    head = ["line", "rows", *_SUMMARY[:10], "slow (the rule, rows)", *_SUMMARY[10:]]
    return f"<h3>{escape(v.label)}</h3>{_table(head, rows)}" + (
        f"<p class=note>{more} more round logs not listed.</p>" if more > 0 else ""
    )


def _refused(v: View) -> str:
    r = v.run
    items = [*r.refused, *((n, f"unplaced: {w}", "") for n, w in r.unplaced)]
    if not items:
        return f"<h3>{escape(v.label)}</h3><p>Nothing refused: every tagged line parsed and was placed.</p>"
    rows = [f"<tr>{_td(n or '-')}<td>{escape(w)}</td><td><code>{escape(t[:120])}</code></td></tr>"
            for n, w, t in items[:LIST_CAP]]  # fmt: skip
    more = len(items) - LIST_CAP
    return (f"<h3>{escape(v.label)}</h3><p>{len(r.refused)} refused, {len(r.unplaced)} unplaced.</p>"
            + _table(["line", "reason", "line starts"], rows)
            + (f"<p class=note>{more} more not listed.</p>" if more > 0 else ""))  # fmt: skip


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

    def fig(fn: Callable[[Sequence[View]], str | None]) -> str:
        step(fn.__name__.replace("_", " "))
        return fn(views) or ""

    def sec(sid: str, title: str, *body: str) -> str:
        return f'<section id="{sid}"><h2>{title}</h2>{"".join(body)}</section>'

    f = figures
    names = " vs ".join(escape(v.label) for v in views)
    nav = "".join(f'<a href="#{s}">{s}</a>' for s in SECTIONS if s != "ab" or ab)
    split = fig(f.verify_split) or "<p>No level-2 ([tag-v]) lines: trace level 1.</p>"
    cols = "".join(
        f"<div><h3>{escape(v.label)}</h3>{acceptance.section(v.run.rounds)}</div>" for v in views
    )
    notes = "".join(
        f"<p class=note>{escape(v.label)}: {escape(n)}</p>" for v in views for n in v.run.notes
    )
    parts = [
        f"<header><h1>memra-obs report</h1><p class=meta>{names}<br>generated "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} by memra_obs {__version__}</p></header><nav>{nav}</nav>",
        sec("ab", "A/B: B against A", _ab_table(ab)) if ab else "",
        sec("totals", "Totals and what they cover", _totals_table(views)),
        sec("round-wall", "Round wall", fig(f.wall_distribution), fig(f.wall_by_index)),
        sec("phases", "Phase shares", fig(f.shares_by_round), fig(f.shares_by_burst),
            "<h3>Level-2 verify split</h3>", split),
        sec("first-token", "First token", fig(f.waterfall), fig(f.ttft)),
        sec("acceptance", "Acceptance (estimates)", f"<div class=cols>{cols}</div>"),
        sec("memory", "Free device memory", fig(f.free_memory)),
        sec("summaries", "[spec-prof-summary] lines", *map(_summaries, views)),
        sec("refused", "What the parser refused", *map(_refused, views)),
        sec("notes", "What each number covers", NOTES, notes),
    ]  # fmt: skip
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
        'content="width=device-width,initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>memra-obs report: {names}</title><style>{CSS}</style></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )
