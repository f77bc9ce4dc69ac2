"""The report page: one self-contained HTML file (figures inline, no script, no request). Every
number in a table carries ``data-key`` (A/B rows ``data-ab`` and ``data-flag``) for tests and
scripts, and says which rounds it covers: a log's rows, burst means and sampled spans differ."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from html import escape
from typing import Any

from ..analysis import Advice, Interval
from ..legacy import SummaryLine
from ..version import __version__
from . import figures as f
from .stats import CAP, CLOCK, N_BOOT, REL_THRESHOLD, ABRow, View, median, slow_rounds

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
.flag,.bad{background:#fde2e1}.flag{font-weight:600}.scroll{overflow-x:auto}
@media print{nav{display:none}section,figure,table{break-inside:avoid}body{max-width:none}}
"""
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
Row = tuple[str, Sequence[str], Any]  # data-key, the leading cells, the value


def totals(v: View) -> list[Row]:
    """One run's column of the totals table: what it covers, then the value."""
    r, own, kj, lines = v.run, v.own, "rounds with k, j known", "the input's lines"
    printed = [g.summary for g in r.logs if g.summary is not None]
    return [
        ("input", ("input", ""), f"{r.name} ({r.kind})"),
        ("bytes", ("bytes", ""), r.size),
        ("lines", ("lines", ""), r.lines),
        *((f"lines_{k}", (f"{k} lines", lines), r.kinds[k])
          for k in ("phase", "verify", "prof", "prof_rounds", "prof_summary", "spans")),
        ("refused", ("lines the parser refused", lines), len(r.refused)),
        ("unplaced", ("valid lines the rebuild could not place", "the log's lines"), len(r.unplaced)),
        ("sessions", ("sessions", "all"), len(r.sessions)),
        ("bursts", ("bursts", "all"), len(r.bursts)),
        ("rounds", ("rounds", "all"), len(r.rounds)),
        ("rounds_own", ("rounds with their own measurement", "rows / round spans"), int(own.sum())),
        ("rounds_means", ("rounds with only their burst's means", "the others"), int((~own).sum())),
        ("drafted", ("drafted tokens (sum of k)", kj), int(v.k[own].sum())),
        ("accepted", ("accepted tokens (sum of j)", kj), int(v.j[own].sum())),
        ("seq_rows", ("per-row-arm verify rows", kj), sum(x.seq_rows for x in r.rounds if x.k >= 0)),
        ("wall_median_ms", ("median round wall, ms", "own"), f"{median(v.metric('wall')):.3f}"),
        ("ttft_n", ("first-token profiles", "sessions with [spec-prof]"), len(v.ttft_ms)),
        ("ttft_median_ms", ("median TTFT, ms", "sessions with [spec-prof]"), f"{median(v.ttft_ms):.3f}"),
        ("round_logs", ("sessions with a round log", "their first 64 rounds"), len(r.logs)),
        ("slow_rounds", ("slow rounds (the summary's rule)", "per session"), sum(slow_rounds(r))),
        ("summaries", ("[spec-prof-summary] lines", "printed / recomputed"), len(printed)),
        ("slow_rounds_printed", ("slow rounds they print", ""), sum(x.slow_rounds or 0 for x in printed)),
    ]  # fmt: skip


def _iv(x: Interval, f: str = ".3f") -> str:
    return f"{x.value:{f}} [{x.lo:{f}}, {x.hi:{f}}]"


def advice(v: View) -> list[Row]:
    """One run's column of the acceptance section's table (estimates; ``-``: no advice)."""
    e, said = v.acceptance, "legacy lines" if v.run.kind == "log" else "spans"

    def adv(key: str, label: str, value: Callable[[Advice], str]) -> Row:
        return key, (label,), "-" if v.advice is None else value(v.advice)

    return [
        ("acc_rounds", ("rounds with known k, j (used); without",), f"{e.rounds}; {e.skipped}"),
        ("pooled_alpha", ("pooled acceptance (i.i.d.)",), _iv(e.pooled) if e.positions else "-"),
        adv("recommended_k", "recommended k", lambda a: str(a.recommended_k)),
        adv("expected_tokens", "E(k*): expected tokens per round", lambda a: _iv(a.expected_tokens)),
        adv("tokens_per_s", "throughput at k*, tokens/s", lambda a: _iv(a.tokens_per_s, ".0f")),
        adv("speedup", "estimated speedup over plain decoding", lambda a: _iv(a.estimated_speedup)),
        adv("plain_step", "plain decoding step, ms (source)",
            lambda a: f"{a.plain_step_ns / 1e6:.3f} ({a.plain_step_source})"),
        adv("current_k", "mean k of the rounds; tokens/s there: model; measured",
            lambda a: f"{a.current_k:.2f}; {a.current_tokens_per_s.value:.0f}; {a.measured_tokens_per_s:.0f}"),
        adv("cost_model", "cost model", lambda a: a.costs.assumption or "fitted (k varied)"),
        ("clock", ("clock that timed the phases",), f"unknown ({said} do not say)"),
    ]  # fmt: skip


def td(x: Any, key: str = "", cls: str = "n") -> str:
    return f'<td class="{cls}"' + (f' data-key="{key}"' if key else "") + f">{escape(str(x))}</td>"


def table(head: Iterable[str], rows: Iterable[str]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f"<div class=scroll><table><tr>{th}</tr>{''.join(rows)}</table></div>"


def by_run(views: Sequence[View], head: Sequence[str], rows: Callable[[View], list[Row]]) -> str:
    """A table of one row a quantity and one column a run."""
    cols = [rows(v) for v in views]
    body = (f"<tr>{''.join(f'<td>{escape(c)}</td>' for c in cells)}"
            + "".join(td(col[i][2], key) for col in cols) + "</tr>"
            for i, (key, cells, _) in enumerate(cols[0]))  # fmt: skip
    return table([*head, *(v.label for v in views)], body)


def _ab(rows: Sequence[ABRow]) -> str:
    out = []
    for r in rows:
        change = f"B {'slower' if r.diff > 0 else 'faster'} by {abs(r.rel):.1%}"
        verdict = change if r.flagged else "no change shown"
        nums = (r.n_a, r.n_b, f"{r.med_a:.4f}", f"{r.med_b:.4f}", f"{r.diff:+.4f}",
                f"[{r.lo:+.4f}, {r.hi:+.4f}]", f"{r.rel:+.2%}")  # fmt: skip
        out.append(f'<tr data-ab="{r.metric}" data-flag="{int(r.flagged)}"{" class=flag" * r.flagged}>'
                   f"<td>{r.metric}</td><td>{r.population}</td>{''.join(map(td, nums))}<td>{verdict}</td></tr>")  # fmt: skip
    head = ("per round", "population", "n A", "n B", "median A, ms", "median B, ms", "B - A",
            "95% CI (bootstrap)", "relative", "verdict")  # fmt: skip
    return table(head, out) + (
        "<p class=note>Medians are the seed's (sorted[n/2]). The CI resamples A and B "
        f"independently ({N_BOOT} resamples, fixed seed, at most {CAP:,} values a run). Flagged: "
        f"the CI excludes 0 and |B - A| is at least {REL_THRESHOLD:.0%} of median A.</p>"
    )


def acceptance(views: Sequence[View]) -> str:
    """The acceptance section (issue 16): the estimator's output, labelled as estimates."""
    out = ["<p class=note><b>Estimates</b> from <code>memra_obs.analysis</code> over the rounds whose"
           " k and j are known, with 95% intervals. Which clock timed the phases is unknown (neither"
           f" the legacy lines nor the spans say): the costs are fitted as <code>clock={CLOCK!r}</code>"
           ". Positions no round reached are extrapolated (a flat tail).</p>"]  # fmt: skip
    out += [f"<p>{escape(v.label)}: no round with known k and j (a trace-only log: its lines carry"
            " no per-round counts), so no acceptance estimate.</p>"
            for v in views if not v.acceptance.positions]  # fmt: skip
    figs = (f.acceptance_by_position, f.expected_tokens_per_round, f.throughput_vs_k)
    out += [fig(views) for fig in figs]
    out.append(by_run(views, ["estimate, 95% interval"], advice) + "<div class=cols>")
    for v in (v for v in views if v.acceptance.positions):
        rows = (f'<tr>{td(p.position)}{td(p.at_risk)}{td(p.accepted)}{td(_iv(p.alpha), f"alpha_{p.position}")}'
                f'{td(_iv(p.survival), f"survival_{p.position}")}</tr>' for p in v.acceptance.positions)  # fmt: skip
        head = ("position", "at risk", "accepted", "α_i", "S(i+1)")
        out.append(f"<div><h3>{escape(v.label)}</h3>{table(head, rows)}</div>")
    return "".join(out) + "</div>"


def _listed(v: View, prose: str, head: Sequence[str], items: list[Any], row: Callable) -> str:
    """The first LIST_CAP items as rows; the rest counted."""
    more = f"<p class=note>{len(items) - LIST_CAP} more not listed.</p>" * (len(items) > LIST_CAP)
    return f"<h3>{escape(v.label)}</h3>{prose}{table(head, map(row, items[:LIST_CAP]))}{more}"


def _summaries(v: View) -> str:
    fs = list(SummaryLine._fields)

    def row(item: tuple[Any, int]) -> str:
        (g, slow), m = item, item[0].summary
        vals = [getattr(m, x) if m is not None else "-" for x in fs]
        bad = m is None or m.slow_rounds != slow or m.rounds != len(g.rows)
        line = g.lineno or ("recomputed" if m is not None else "none")
        return (f"<tr>{td(line)}{td(len(g.rows))}{''.join(map(td, vals[:10]))}"
                f"{td(slow, cls='n bad' if bad else 'n')}{''.join(map(td, vals[10:]))}</tr>")  # fmt: skip

    items = list(zip(v.run.logs, slow_rounds(v.run), strict=True))
    return _listed(v, "", ["line", "rows", *fs[:10], "slow (the rule, rows)", *fs[10:]], items, row)


def _refused(v: View) -> str:
    r = v.run
    if not (items := [*r.refused, *((n, f"unplaced: {w}", "") for n, w in r.unplaced)]):
        return f"<h3>{escape(v.label)}</h3><p>Nothing refused: every tagged line parsed and was placed.</p>"
    row = "<tr>{}<td>{}</td><td><code>{}</code></td></tr>".format
    prose = f"<p>{len(r.refused)} refused, {len(r.unplaced)} unplaced.</p>"
    return _listed(v, prose, ("line", "reason", "line starts"), items,
                   lambda i: row(td(i[0] or "-"), escape(i[1]), escape(i[2][:120])))  # fmt: skip


def _split(views: Sequence[View]) -> str:
    if not any(b.split_ns for v in views for b in v.run.bursts):
        return "<h3>Level-2 verify split</h3><p>No level-2 ([tag-v]) lines: trace level 1.</p>"
    return "<h3>Level-2 verify split</h3>" + f.verify_split(views)


def render(views: Sequence[View], ab: Sequence[ABRow] | None, step: Callable[[str], None]) -> str:
    """The whole page; ``step(name)`` is called before each section (for a progress line)."""

    def sec(sid: str, title: str, *body: Callable[[Sequence[View]], str]) -> str:
        step(sid)
        return f'<section id="{sid}"><h2>{title}</h2>{"".join(b(views) for b in body)}</section>'

    names = " vs ".join(escape(v.label) for v in views)
    nav = "".join(f'<a href="#{s}">{s}</a>' for s in SECTIONS if s != "ab" or ab)
    notes = [
        f"<p class=note>{escape(v.label)}: {escape(n)}</p>" for v in views for n in v.run.notes
    ]
    parts = [
        f"<header><h1>memra-obs report</h1><p class=meta>{names}<br>generated "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} by memra_obs {__version__}</p></header><nav>{nav}</nav>",
        sec("ab", "A/B: B against A", lambda _: _ab(ab)) if ab else "",
        sec("totals", "Totals and what they cover", lambda vs: by_run(vs, ["quantity", "covers"], totals)),
        sec("round-wall", "Round wall", f.round_wall_distribution, f.round_wall_over_round_index),
        sec("phases", "Phase shares", f.phase_shares_per_round, f.phase_shares_per_burst, _split),
        sec("first-token", "First token", f.first_token_waterfall_per_session, f.ttft_distribution),
        sec("acceptance", "Acceptance (estimates)", acceptance),
        sec("memory", "Free device memory", f.free_device_memory),
        sec("summaries", "[spec-prof-summary] lines", lambda vs: "".join(map(_summaries, vs))),
        sec("refused", "What the parser refused", lambda vs: "".join(map(_refused, vs))),
        sec("notes", "What each number covers", lambda _: NOTES + "".join(notes)),
    ]  # fmt: skip
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            'content="width=device-width,initial-scale=1"><link rel="icon" href="data:,">'
            f"<title>memra-obs report: {names}</title><style>{CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")  # fmt: skip
