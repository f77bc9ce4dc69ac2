"""The report page: one self-contained HTML file (no script, no request). Figures are drawn with
matplotlib's object API (no pyplot state) and inlined as data URIs: SVG for bars and lines (text
stays text), PNG for dense scatters; one panel a run on shared axes (A/B compares on one scale),
saying why when it has nothing to draw. Every number in a table carries ``data-key`` (A/B rows
``data-ab`` and ``data-flag``) for tests and scripts, and says which rounds it covers: a log's
rows, burst means and sampled spans differ."""

from __future__ import annotations

import base64
import functools
import io
import time
from collections.abc import Callable, Iterable, Sequence
from html import escape
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..analysis import MIN_ROUNDS, Advice, Interval
from ..legacy import KIND, SummaryLine
from ..records import FIRST_TOKEN_FIELDS, f32
from ..timeline import PHASES
from ..version import __version__
from .stats import AB_METHOD, CLOCK, ABRow, View, by_family, median, slow_rounds, started

COLORS = dict(zip(PHASES, ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2"), strict=True))
# Names are text: an input called "w$_$.log" is no formula (text.parse_math).
RC = {"font.size": 8.5, "svg.fonttype": "none", "svg.hashsalt": "memra-obs", "axes.grid": True,
      "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
      "text.parse_math": False}  # fmt: skip
#: Draws run ``v`` (one of ``views``) on ``ax``; raises Empty when it has nothing to draw.
Draw = Callable[[Axes, View, Sequence[View]], None]
Figures = Callable[[Sequence[View]], str]


class Empty(Exception): ...  # a panel with nothing to draw: the message is drawn instead


def need(ok: object, why: str) -> None:
    if not ok:
        raise Empty(why)


def panels(ylabel: str, *, fmt: str | Figures = "svg", h: float = 2.8, sharey: bool = True,
           legend: str = "upper right") -> Callable[[Draw], Figures]:  # fmt: skip
    """The page's ``<figure>``: one panel a run drawn by the decorated function (its name the alt
    text, its docstring the caption). ``fmt``: "svg", "png" or a function of the runs choosing;
    ``legend``: a place in each panel, or one legend "right" of / "below" them all."""

    def figure(draw: Draw, views: Sequence[View]) -> str:
        with matplotlib.rc_context(RC):  # type: ignore[arg-type, unused-ignore]
            fig = Figure(figsize=(9.6 if len(views) == 1 else 5.2 * len(views), h),
                         layout="constrained")  # fmt: skip
            axes = fig.subplots(1, len(views), sharex=True, sharey=sharey, squeeze=False)[0]
            one, hs = legend in ("right", "below"), dict[str, Any]()
            for ax, v in zip(axes, views, strict=True):
                ax.set_title(v.label, loc="left", fontsize=9)
                try:
                    draw(ax, v, views)
                    if not one:
                        ax.legend(loc=legend, markerscale=3)
                except Empty as why:
                    ax.text(0.5, 0.5, str(why), ha="center", va="center", color="#666",
                            transform=ax.transAxes)  # fmt: skip
                hs |= dict(zip(*ax.get_legend_handles_labels()[::-1], strict=True))
            axes[0].set_ylabel(ylabel)
            if one and hs:
                right = legend == "right"
                fig.legend(list(hs.values()), list(hs), fontsize=7, ncols=1 if right else 7,
                           loc="outside right upper" if right else "outside lower center")  # fmt: skip
            buf, kind = io.BytesIO(), fmt if isinstance(fmt, str) else fmt(views)
            fig.savefig(buf, format=kind, dpi=100, metadata={"Date": None} if kind == "svg" else {})
        data, mime = base64.b64encode(buf.getvalue()).decode(), "svg+xml" if kind == "svg" else kind
        alt, cap = draw.__name__.replace("_", " "), " ".join((draw.__doc__ or "").split())
        return (f'<figure><img alt="{alt}" src="data:image/{mime};base64,{data}">'
                f"<figcaption>{cap}</figcaption></figure>")  # fmt: skip

    return lambda draw: functools.wraps(draw)(functools.partial(figure, draw))


@panels("rounds")
def round_wall_distribution(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Per-round wall of every round with its own measurement (a log's rows: the first 64 rounds
    of each session; a span file's round spans); median and mark pooled over the run."""
    need(len(w := v.metric("wall")), "no round with its own wall")
    every = np.concatenate([x.metric("wall") for x in views])
    edges = np.linspace(every.min(), np.quantile(every, 0.995), 81)
    ax.hist(np.clip(w, None, edges[-1]), bins=edges.tolist(), color=COLORS["verify"], alpha=0.8)
    med = median(w32 := w.astype(np.float32))  # the seed's rule: f32 walls past f32(1.5 x median)
    above = int((w32 > np.float32(thr := f32(1.5 * med))).sum())
    ax.axvline(med, color="k", lw=1, label=f"median {med:.3f} ms")
    ax.axvline(thr, c="#e15759", ls="--", lw=1, label=f"1.5x median {thr:.3f} ms: {above} above")
    ax.set_xlabel("round wall, ms (last bin: all past the 99.5th percentile)")


@panels("round wall, ms", fmt="png")
def round_wall_over_round_index(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Round wall over the round's index in its session (y cut at 1.3 x the 99.5th percentile)."""
    need(len(v.wall_ms), "no rounds")
    m, x = ~v.own, v.index[~v.own]  # burst means: a dash over the rounds (a run is one record)
    ax.hlines(v.wall_ms[m], x - 0.5, x + v.n[m] - 0.5, color="#bbb", label="burst mean")
    ax.scatter(v.index[v.own], v.wall_ms[v.own], s=2.5, c=COLORS["draft"], lw=0, label="own wall")
    if v.own.any():
        idx = np.unique(v.index[v.own])[:512]
        med = [median(v.wall_ms[v.own & (v.index == i)]) for i in idx]
        ax.plot(idx, med, color="k", lw=0.8, label="median per index")
    ax.set(ylim=(0, v.wall_quantile(0.995) * 1.3), xlabel="round index in its session")


@panels("share", legend="right")
def phase_shares_per_round(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Phase shares per round, by index in the session (rounds with their own times)."""
    need(v.own.any(), "no round with its own phase times")
    n = min(int(np.max(idx := v.index[v.own])) + 1, 256)
    sums = np.stack([np.bincount(idx, v.phase_ms[v.own, p], n)[:n] for p in range(5)])
    share = sums / np.maximum(sums.sum(axis=0), 1e-12)
    ax.stackplot(np.arange(n), share, colors=[COLORS[p] for p in PHASES], labels=PHASES)
    ax.set(xlabel="round index in its session", ylim=(0, 1))


@panels("share", legend="right")
def phase_shares_per_burst(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Phase shares per burst (the [glm5-phase] lines' totals; span files: burst attributes)."""
    need(len(v.burst_ms), "no bursts")
    groups = np.array_split(v.burst_ms, min(len(v.burst_ms), 120))  # bins of consecutive bursts
    share = np.stack([g.sum(axis=0) for g in groups]).T
    top = np.cumsum(share / np.maximum(share.sum(axis=0), 1e-12), axis=0)
    for p, hi, lo in zip(PHASES, top, [np.zeros(top.shape[1]), *top[:-1]], strict=True):
        ax.stairs(hi, baseline=lo, fill=True, color=COLORS[p], label=p)  # a filled path, edges 0..n
    per = -(-len(v.burst_ms) // len(groups))
    ax.set(xlabel=f"burst, in order ({per} a bar)" if per > 1 else "burst, in order", ylim=(0, 1))


#: The level-2 split's parts, nested as printed: scan inside vkda, vffn inside vrest.
SPLIT = {"vkda - scan": "#4e79a7", "scan (in vkda)": "#a0cbe8", "vmla": "#f28e2b",
         "vrest - vffn": "#59a14f", "vffn (in vrest)": "#8cd17d"}  # fmt: skip


@panels("", h=1.5, legend="right")
def verify_split(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Level-2 verify sub-split over the bursts that printed it, per-round mean ms (vrest =
    verify - vkda - vmla)."""
    b = [x for x in v.run.bursts if x.split_ns is not None]
    need(n := sum(x.phases.rounds for x in b) * 1e6, "no level-2 ([tag-v]) lines")  # ns a ms
    kda, scan, mla, ffn = np.array([x.split_ns for x in b]).sum(axis=0) / n
    rest = max(sum(x.phases.verify for x in b) / n - kda - mla, 0.0)
    parts = (kda - scan, scan, mla, max(rest - ffn, 0.0), min(ffn, rest))
    for (name, col), x, left in zip(SPLIT.items(), parts, np.cumsum((0, *parts[:-1])), strict=True):
        ax.barh(0, x, left=left, color=col, label=name)
    ax.set(yticks=[], xlabel="verify, per-round mean ms")


#: First-token fields that are shares inside a bucket (not additive to it), by bucket.
SHARES = {"prime": ("prime_tap_dtoh",), "first_burst": ("first_burst_hook",),
          "draft_prime": ("draft_prime_h2d", "draft_prime_feat", "draft_prime_kv")}  # fmt: skip
BUCKETS = [f[:-3] for f in FIRST_TOKEN_FIELDS if f.endswith("_ms")]  # a colour each, every panel


def _tab(name: str) -> Any:
    return matplotlib.colormaps["tab20"](BUCKETS.index(name) if name in BUCKETS else 19)


@panels("", h=3.4, sharey=False, legend="below")
def first_token_waterfall_per_session(ax: Axes, v: View, views: Sequence[View]) -> None:
    """First-token waterfall of up to 10 sessions spread over the TTFT range: buckets in the order
    they ran; round-1 buckets sit inside first_burst; hatched bars are shares of the bucket above
    them (tap DtoH in prime, the drafter-prime split, the commit hook)."""
    fts = sorted((f for f in v.run.first_tokens if f.intervals), key=lambda f: f.prof.total_ms())
    need(fts, "no first-token profile ([spec-prof]) with its buckets in this input")
    pick = sorted({round(q) for q in np.linspace(0, len(fts) - 1, min(10, len(fts)))})
    for y, ft in enumerate(fts[i] for i in pick):
        t0 = min(a for _, a, _ in ft.intervals)
        fb = next((x for x in ft.intervals if x[0] == "first_burst"), ("", 0, 0))
        for name, a, b in ft.intervals:
            inner = name != "first_burst" and fb[1] <= a and b <= fb[2]  # round 1's buckets
            ax.barh(y, (b - a) / 1e6, left=(a - t0) / 1e6, height=0.4 if inner else 0.8,
                    zorder=3 if inner else 2, color=_tab(name), label=name)  # fmt: skip
            shares = {s: w for s in SHARES.get(name, ()) if (w := getattr(ft.prof, s + "_ms")) > 0}
            # From the bucket's start; the hook at the burst's end.
            x = (b - t0) / 1e6 - sum(shares.values()) if name == "first_burst" else (a - t0) / 1e6
            for share, w in shares.items():
                ax.barh(y - 0.3, w, left=x, height=0.2, color=_tab(share), hatch="//", label=share)
                x += w
    ax.set_yticks(range(len(pick)), [f"TTFT {fts[i].prof.total_ms():.1f} ms" for i in pick])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the session's first bucket")


@panels("sessions")
def ttft_distribution(ax: Axes, v: View, views: Sequence[View]) -> None:
    """TTFT per session: the creation buckets + the first burst (the profile's total_ms)."""
    need(len(x := v.ttft_ms), "no first-token profile ([spec-prof]) in this input")
    ax.hist(x, bins=min(60, max(5, len(x) // 3)), color=COLORS["accept"])
    ax.axvline(median(x), color="k", lw=1, label=f"median {median(x):.2f} ms (n={len(x)})")
    ax.set_xlabel("time to first token (profile total), ms")


def _band(ax: Axes, x: Any, ivs: Sequence[Interval], color: str, label: str, f: str = "-o") -> None:
    """Estimates with their intervals: the values, a band between the bounds."""
    val, lo, hi = np.array(ivs, dtype=float).reshape(-1, 3).T
    ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
    ax.plot(x, val, f, color=color, ms=3, lw=1, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _no_estimate(v: View) -> str:  # as the section's text says it
    return "no round drafted (k = 0)" if v.acceptance.rounds else "no round with known k and j"


@panels("probability", legend="best")
def acceptance_by_position(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Estimates: acceptance by draft position, α_i = P(accepted | drafted and every earlier
    draft accepted), with its 95% Wilson interval, and S(i+1) = P(drafts 0..i all accepted),
    product-limit, with its interval."""
    need(ps := v.acceptance.positions[:LIST_CAP], _no_estimate(v))  # k=65535: a 27 MB figure
    _band(ax, [p.position for p in ps], [p.alpha for p in ps], COLORS["draft"], "α_i", "o")
    _band(ax, [p.position for p in ps], [p.survival for p in ps], COLORS["verify"], "S(i+1)")
    ax.set(xlabel="draft position i (0-based)", ylim=(0, 1.02))


@panels("tokens per round", legend="best")
def expected_tokens_per_round(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Estimates: tokens a round drafting k commits, E(k) = 1 + Σ S(i), with its interval; past
    the deepest position seen (dotted), acceptance is the flat tail's."""
    need((acc := v.acceptance).positions, _no_estimate(v))
    ks = range(1, 17)
    _band(ax, ks, [acc.expected_tokens(k) for k in ks], COLORS["accept"], "E(k)")
    ax.axvline(len(acc.positions) + 0.5, color="#999", ls=":", lw=1, label="data | flat tail")
    ax.set_xlabel("draft length k")


@panels("tokens per second", legend="best")
def throughput_vs_k(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Estimates: throughput E(k) / t_round(k), the cost model fitted to the rounds' own phases,
    with the recommended k (the best within 2 past the longest draft seen, dotted) and the
    throughput the rounds measured."""
    if (a := v.advice) is None:
        raise Empty(f"no advice: fewer than {MIN_ROUNDS} rounds with known k >= 1, or no time")
    _band(ax, range(1, 17), [p.tokens_per_s for p in a.curve], COLORS["rollback"], "model")
    ax.axvline(a.recommended_k, color="k", lw=1, label=f"recommended k = {a.recommended_k}")
    ax.axvline(a.observed_k + 0.5, color="#999", ls=":", lw=1)
    ax.axhline(a.measured_tokens_per_s, color="#999", ls="--", lw=1, label="measured")
    ax.set_xlabel("draft length k")


@panels("free MB", fmt=lambda vs: "png" if max(len(v.ttft_ms) for v in vs) > 2000 else "svg",
        legend="right")  # fmt: skip
def free_device_memory(ax: Axes, v: View, views: Sequence[View]) -> None:
    """Free device memory per CUDA ordinal (a colour each), before the trunk cache alloc (solid)
    and after the drafter KV (dashed) (PNG past 2000 sessions a run: the lines turn dense)."""
    ax.set_xlabel("session, in order")
    fts = v.run.first_tokens
    devs = sorted({d for f in fts for d, _ in f.prof.free_mb_before + f.prof.free_mb_after})
    need(devs, "no free-memory snapshot in this input")
    # one colour an ordinal, in every panel
    every = sorted({d for w in views for f in w.run.first_tokens
                    for d, _ in f.prof.free_mb_before + f.prof.free_mb_after})  # fmt: skip
    colors = matplotlib.colormaps["tab20" if len(every) > 10 else "tab10"].colors  # type: ignore[attr-defined]
    for d in devs:
        for point, ls in (("before", "-"), ("after", "--")):
            y = [dict(getattr(f.prof, "free_mb_" + point)).get(d, np.nan) for f in fts]
            ax.plot(np.arange(len(y)), y, ls, marker="o" if len(y) < 50 else "", ms=2.5, lw=0.9,
                    color=colors[every.index(d) % len(colors)], label=f"device {d} {point}")  # fmt: skip


SECTIONS = ("ab", "totals", "round-wall", "phases", "first-token", "acceptance", "memory",
            "summaries", "refused", "notes")  # fmt: skip
LIST_CAP = 200  # rows (and positions drawn) of a run's summary, refusal, position tables
CSS = """body{font:14px/1.45 system-ui,sans-serif;color:#222;max-width:1200px;margin:0 auto;padding:0 16px 40px}
h1{font-size:22px;margin:18px 0 4px}h2{font-size:17px;border-bottom:1px solid #ccc;margin-top:28px}
h3{font-size:14px;margin:14px 0 4px}nav a{margin-right:10px}figure{margin:10px 0}
figure img{width:100%;height:auto}figcaption,.note,.meta{color:#555;font-size:12.5px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}td,th{border:1px solid #ddd;padding:2px 7px}
th{background:#f4f4f4;text-align:left}th[scope]{background:none;font-weight:normal}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cols{display:grid;grid-template-columns:repeat(auto-fit,minmax(320px,1fr));gap:18px}
.flag,.bad{background:#fde2e1}.flag{font-weight:600}.flag.better{background:#dff3df}.scroll{overflow-x:auto}
@media print{nav{display:none}section,figure,table{break-inside:avoid}body{max-width:none}
*{print-color-adjust:exact;-webkit-print-color-adjust:exact}.scroll{overflow:visible}table{font-size:9.5px}td,th{padding:1px 3px;overflow-wrap:anywhere}td.n{white-space:nowrap}}"""
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
        ("recorded", ("sessions started, UTC", "span start times"), started(v)),
        ("lines", ("lines", ""), r.lines),
        *((f"lines_{k}", (f"{k} lines" if k != "spans" else "spans", lines), r.kinds[k])
          for k in (*KIND.values(), "spans")),
        ("refused", ("lines the parser refused", lines), len(r.refused)),
        ("unplaced", ("valid lines the rebuild could not place", "the log's lines"), len(r.unplaced)),
        ("sessions", ("sessions", "all"), len(r.sessions)),
        ("bursts", ("bursts", "all"), len(r.bursts)),
        ("rounds", ("rounds", "all"), int(v.n.sum())),
        ("rounds_own", ("rounds with their own measurement", "rows / round spans"), int(own.sum())),
        ("rounds_means", ("rounds with only their burst's means", "the others"), v.without),
        ("drafted", ("drafted tokens (sum of k)", kj), int(v.k[own].sum())),
        ("accepted", ("accepted tokens (sum of j)", kj), int(v.j[own].sum())),
        ("seq_rows", ("per-row-arm verify rows", kj), sum(x.seq_rows for x in v.known())),
        ("wall_median_ms", ("median round wall, ms", "own"), _med(v.metric("wall"))),
        ("ttft_n", ("first-token profiles", "sessions with [spec-prof]"), len(v.ttft_ms)),
        ("ttft_median_ms", ("median TTFT, ms", "sessions with [spec-prof]"), _med(v.ttft_ms)),
        ("round_logs", ("sessions with a round log", "their first 64 rounds"), len(r.logs)),
        ("slow_rounds", ("slow rounds (the summary's rule)", "per session"), sum(slow_rounds(r))),
        ("summaries", ("[spec-prof-summary] lines", "printed / recomputed"), len(printed)),
        ("slow_rounds_printed", ("slow rounds they print", ""), sum(x.slow_rounds or 0 for x in printed)),
    ]  # fmt: skip


def _med(x: Any) -> str:  # "-": no median (a trace-only log has no round of its own)
    return "-" if (m := median(x)) != m else f"{m:.3f}"


def _iv(x: Interval, f: str = ".3f") -> str:
    return f"{x.value:{f}} [{x.lo:{f}}, {x.hi:{f}}]"


def advice(v: View) -> list[Row]:
    """One run's column of the acceptance section's table (estimates; ``-``: no advice)."""
    e, said = v.acceptance, "legacy lines" if v.run.kind == "log" else "spans"

    def adv(key: str, label: str, value: Callable[[Advice], str]) -> Row:
        return key, (label,), "-" if v.advice is None else value(v.advice)

    return [
        ("acc_rounds", ("rounds with known k, j (used); without",), f"{e.rounds}; {v.without}"),
        ("draft_acceptance", ("accepted / drafted (vLLM's draft acceptance rate)",), f"{int((v.j * v.n)[v.own].sum()) / d:.3f}" if (d := int((v.k * v.n)[v.own].sum())) else "-"),
        ("pooled_alpha", ("acceptance α per position, pooled (i.i.d.)",), _iv(e.pooled) if e.positions else "-"),
        adv("recommended_k", "recommended k", lambda a: str(a.recommended_k)),
        adv("expected_tokens", "E(k*): expected tokens per round", lambda a: _iv(a.expected_tokens)),
        adv("tokens_per_s", "throughput at k*, tokens/s", lambda a: _iv(a.tokens_per_s, ".0f")),
        adv("speedup", "estimated speedup over plain decoding", lambda a: _iv(a.estimated_speedup)),
        adv("plain_step", "plain decoding step, ms (source)",
            lambda a: f"{a.plain_step_ns / 1e6:.3f} ({a.plain_step_source})"),
        adv("current_k", "mean k of the rounds; tokens/s there: model; measured",
            lambda a: f"{a.current_k:.2f}; {a.current_tokens_per_s.value:.0f}; {a.measured_tokens_per_s:.0f}"),
        adv("cost_model", "cost model", lambda a: a.costs.assumption or "fitted (k varied)"),
        ("clock", ("clock that timed the phases",), v.clock_said or f"unknown ({said} do not say)"),
    ]  # fmt: skip


def td(x: Any, key: str = "", cls: str = "n") -> str:
    return f'<td class="{cls}"' + (f' data-key="{key}"' if key else "") + f">{escape(str(x))}</td>"


def table(head: Iterable[str], rows: Iterable[str]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f"<div class=scroll><table><tr>{th}</tr>{''.join(rows)}</table></div>"


def by_run(views: Sequence[View], head: Sequence[str], rows: Callable[[View], list[Row]]) -> str:
    """A table of one row a quantity and one column a run."""
    cols = [rows(v) for v in views]
    body = (f"<tr><th scope=row>{escape(cells[0])}</th>{''.join(f'<td>{escape(c)}</td>' for c in cells[1:])}"
            # a figure is "n" (right, unbroken); prose wraps (one line ran past the paper)
            + "".join(td(x, key, "n" if len(str(x)) <= 40 else "t") for x in (c[i][2] for c in cols))
            + "</tr>"
            for i, (key, cells, _) in enumerate(cols[0]))  # fmt: skip
    return table([*head, *(v.label for v in views)], body)


def _ab(rows: Sequence[ABRow], unlike: str = "") -> str:
    said = unlike and (f"<p class=flag>A and B were not recorded alike ({escape(unlike)}): each run "
                       "is compared as it is, so this difference is in the numbers too.</p>")  # fmt: skip
    out = []
    for r in rows:
        cls = f' class="flag{" better" * (r.diff < 0)}"' * r.flagged  # faster: green, not red
        nums = (r.n_a, r.n_b, f"{r.med_a:.4f}", f"{r.med_b:.4f}", f"{r.diff:+.4f}",
                f"[{r.lo:+.4f}, {r.hi:+.4f}]", f"{r.rel:+.2%}" if r.med_a else "-")  # fmt: skip
        out.append(f'<tr data-ab="{r.metric}" data-flag="{int(r.flagged)}"{cls}>'
                   f"<th scope=row>{r.metric}</th><td>{r.population}</td>{''.join(map(td, nums))}<td>{r.verdict}</td></tr>")  # fmt: skip
    head = ("per round", "population", "n A", "n B", "median A, ms", "median B, ms", "B - A, ms",
            "95% CI (bootstrap), ms", "relative", "verdict")  # fmt: skip
    return f"{said}{table(head, out)}<p class=note>{AB_METHOD}; red slower, green faster.</p>"


def acceptance(views: Sequence[View]) -> str:
    """The acceptance section (issue 16): the estimator's output, labelled as estimates, one
    family at a time."""
    out = ["<p class=note><b>Estimates</b> from <code>memra_obs.analysis</code> over the rounds whose"
           " k and j are known, with 95% intervals, each family on its own. The costs are fitted"
           " with the clock the input's <code>[spec-advice]</code> lines or session spans name (the"
           f" profile's), else as <code>clock={CLOCK!r}</code>. Positions no round reached are"
           " extrapolated (a flat tail).</p>"]  # fmt: skip
    for name, vs in by_family(list(views)):
        out.append(f"<h3>family {escape(name)}</h3>" * bool(name) + _acceptance(vs))
    return "".join(out)


def _no_counts(v: View) -> str:
    """Why a run has no acceptance estimate."""
    if v.acceptance.rounds:
        return "no round drafted (k = 0 throughout)"
    why = "its round spans carry no k, j"
    if v.run.kind == "log":
        why = "a trace-only log: its lines carry no per-round counts"
    return f"no round with known k and j ({why if v.run.rounds else 'no round at all'})"


def _acceptance(views: Sequence[View]) -> str:
    out = [f"<p>{escape(v.label)}: {_no_counts(v)}, so no acceptance estimate.</p>"
           for v in views if not v.acceptance.positions]  # fmt: skip
    out += [f(views) for f in (acceptance_by_position, expected_tokens_per_round, throughput_vs_k)]
    out.append(by_run(views, ["estimate, 95% interval"], advice) + "<div class=cols>")
    head, row = ("position", "at risk", "accepted", "α_i", "S(i+1)"), lambda p: (
        f'<tr>{td(p.position)}{td(p.at_risk)}{td(p.accepted)}{td(_iv(p.alpha), f"alpha_{p.position}")}'
        f'{td(_iv(p.survival), f"survival_{p.position}")}</tr>')  # fmt: skip
    for v in (v for v in views if v.acceptance.positions):
        out.append(f"<div>{_listed(v, '', head, list(v.acceptance.positions), row)}</div>")
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
        line = g.lineno or (f"{g.trace_id:032x}" if m is not None else "none")
        return (f"<tr>{td(line, cls='')}{td(len(g.rows))}{''.join(map(td, vals[:10]))}"
                f"{td(slow, cls='n bad' if bad else 'n')}{''.join(map(td, vals[10:]))}</tr>")  # fmt: skip

    items = list(zip(v.run.logs, slow_rounds(v.run), strict=True))
    said = "<p class=note>Recomputed from the round spans, a row a session by its trace id.</p>"
    head = ["line / trace id", "rows", *fs[:10], "slow (the rule, rows)", *fs[10:]]
    return _listed(v, said * (v.run.kind == "spans"), head, items, row)


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
    return "<h3>Level-2 verify split</h3>" + verify_split(views)


def render(views: Sequence[View], ab: Sequence[ABRow] | None, step: Callable[[str], None]) -> str:
    """The whole page; ``step(name)`` is called before each section (for a progress line)."""

    def sec(sid: str, title: str, *body: Callable[[Sequence[View]], str]) -> str:
        step(sid)
        return f'<section id="{sid}"><h2>{title}</h2>{"".join(b(views) for b in body)}</section>'

    names = " vs ".join(escape(v.label) for v in views)
    nav = "".join(f'<a href="#{s}">{s}</a>' for s in SECTIONS if s != "ab" or ab)
    said = [f"<p class=note>{escape(v.label)}: {escape(n)}</p>" for v in views for n in v.run.notes]
    parts = [
        f"<header><h1>memra-obs report</h1><p class=meta>{names}<br>generated "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %z')} by memra_obs {__version__}</p></header><nav>{nav}</nav>",
        sec("ab", "A/B: B against A", lambda vs: _ab(ab, vs[0].unlike(vs[1]))) if ab else "",
        sec("totals", "Totals and what they cover", lambda vs: by_run(vs, ["quantity", "covers"], totals)),
        sec("round-wall", "Round wall", round_wall_distribution, round_wall_over_round_index),
        sec("phases", "Phase shares", phase_shares_per_round, phase_shares_per_burst, _split),
        sec("first-token", "First token", first_token_waterfall_per_session, ttft_distribution),
        sec("acceptance", "Acceptance (estimates)", acceptance),
        sec("memory", "Free device memory", free_device_memory),
        sec("summaries", "[spec-prof-summary] lines", lambda vs: "".join(map(_summaries, vs))),
        sec("refused", "What the parser refused", lambda vs: "".join(map(_refused, vs))),
        sec("notes", "What each number covers", lambda _: NOTES + "".join(said)),
    ]  # fmt: skip
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            'content="width=device-width,initial-scale=1"><link rel="icon" href="data:,">'
            f"<title>{names} - memra-obs report</title><style>{CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")  # fmt: skip
