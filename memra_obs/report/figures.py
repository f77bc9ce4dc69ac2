"""The page's figures: matplotlib's object API (no pyplot state), inlined as data URIs; one panel
a run on shared axes (A/B compares on one scale), saying why when it has nothing to draw. SVG
for bars and lines (text stays text), PNG for dense scatters; the style is set per figure."""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..analysis import MIN_ROUNDS, Interval
from ..records import FIRST_TOKEN_FIELDS
from ..timeline import PHASES
from .stats import View, median, threshold

COLORS = dict(zip(PHASES, ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2"), strict=True))
RC = {"font.size": 8.5, "svg.fonttype": "none", "svg.hashsalt": "memra-obs", "axes.grid": True,
      "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False}  # fmt: skip
#: Draws run ``v`` (one of ``views``) on ``ax``; returns why it has nothing to draw, or None.
Draw = Callable[[Axes, View, Sequence[View]], "str | None"]
Figures = Callable[[Sequence[View]], str]


def inline(fig: Figure, alt: str, caption: str, fmt: str = "svg") -> str:
    """A figure as the page's ``<figure>``: the image inline (a data URI), then its caption."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100, metadata={"Date": None} if fmt == "svg" else {})
    data = base64.b64encode(buf.getvalue()).decode()
    mime = "svg+xml" if fmt == "svg" else fmt
    return (f'<figure><img alt="{escape(alt)}" src="data:image/{mime};base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>")  # fmt: skip


def panels(ylabel: str, *, fmt: str | Figures = "svg", h: float = 2.8, sharey: bool = True,
           legend: str = "upper right") -> Callable[[Draw], Figures]:  # fmt: skip
    """One panel per run drawn by the decorated function, whose name is the figure's alt text
    and whose docstring its caption. ``fmt``: "svg", "png", or a function of the runs choosing;
    ``legend``: where in each panel, or "right" of them all / "below" them all for one."""

    def figure(draw: Draw, views: Sequence[View]) -> str:
        with matplotlib.rc_context(RC):  # type: ignore[arg-type]
            fig = Figure(figsize=(9.6 if len(views) == 1 else 5.2 * len(views), h),
                         layout="constrained")  # fmt: skip
            axes = fig.subplots(1, len(views), sharex=True, sharey=sharey, squeeze=False)[0]
            one, hs = legend in ("right", "below"), dict[str, Any]()
            for ax, v in zip(axes, views, strict=True):
                ax.set_title(v.label, loc="left", fontsize=9)
                if why := draw(ax, v, views):
                    ax.text(0.5, 0.5, why, ha="center", va="center", color="#666",
                            transform=ax.transAxes)  # fmt: skip
                elif not one:
                    ax.legend(loc=legend, markerscale=3)
                hs |= dict(zip(*ax.get_legend_handles_labels()[::-1], strict=True))
            axes[0].set_ylabel(ylabel)
            if one and hs:
                right = legend == "right"
                fig.legend(list(hs.values()), list(hs), fontsize=7, ncols=1 if right else 7,
                           loc="outside right upper" if right else "outside lower center")  # fmt: skip
            cap = " ".join((draw.__doc__ or "").split())
            kind = fmt if isinstance(fmt, str) else fmt(views)
            return inline(fig, draw.__name__.replace("_", " "), cap, kind)

    return lambda draw: functools.wraps(draw)(functools.partial(figure, draw))


@panels("rounds")
def round_wall_distribution(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Per-round wall of every round with its own measurement (a log's rows: the first 64 rounds
    of each session; a span file's round spans); median and mark pooled over the run."""
    w, every = v.metric("wall"), np.concatenate([x.metric("wall") for x in views])
    if not len(w):
        return "no round with its own wall"
    edges = np.linspace(every.min(), np.quantile(every, 0.995), 81)
    ax.hist(np.clip(w, None, edges[-1]), bins=edges, color=COLORS["verify"], alpha=0.8)  # type: ignore[arg-type]
    med, thr, above = threshold(w)
    ax.axvline(med, color="k", lw=1, label=f"median {med:.3f} ms")
    ax.axvline(thr, c="#e15759", ls="--", lw=1, label=f"1.5x median {thr:.3f} ms: {above} above")
    ax.set_xlabel("round wall, ms (last bin: all past the 99.5th percentile)")
    return None


@panels("round wall, ms", fmt="png")
def round_wall_over_round_index(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Round wall over the round's index in its session (y cut at 1.3 x the 99.5th percentile)."""
    if not len(v.wall_ms):
        return "no rounds"
    for sel, color, label in ((~v.own, "#bbb", "burst mean"), (v.own, COLORS["draft"], "own wall")):
        ax.scatter(v.index[sel], v.wall_ms[sel], s=2.5, c=color, lw=0, label=label, rasterized=True)
    if v.own.any():
        idx = np.unique(v.index[v.own])[:512]
        med = [median(v.wall_ms[v.own & (v.index == i)]) for i in idx]
        ax.plot(idx, med, color="k", lw=0.8, label="median per index")
    ax.set(ylim=(0, np.quantile(v.wall_ms, 0.995) * 1.3), xlabel="round index in its session")
    return None


@panels("share", legend="right")
def phase_shares_per_round(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Phase shares per round, by index in the session (rounds with their own times)."""
    if not v.own.any():
        return "no round with its own phase times"
    idx = v.index[v.own]
    n = min(int(idx.max()) + 1, 256)
    sums = np.stack([np.bincount(idx, v.phase_ms[v.own, p], n)[:n] for p in range(5)])
    share = sums / np.maximum(sums.sum(axis=0), 1e-12)
    ax.stackplot(np.arange(n), share, colors=[COLORS[p] for p in PHASES], labels=PHASES)
    ax.set(xlabel="round index in its session", ylim=(0, 1))
    return None


@panels("share", legend="right")
def phase_shares_per_burst(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Phase shares per burst (the [glm5-phase] lines' totals; span files: burst attributes)."""
    if not len(v.burst_ms):
        return "no bursts"
    groups = np.array_split(v.burst_ms, min(len(v.burst_ms), 120))  # bins of consecutive bursts
    share = np.stack([g.sum(axis=0) for g in groups]).T
    share, bottom = share / np.maximum(share.sum(axis=0), 1e-12), np.zeros(share.shape[1])
    for p, row in zip(PHASES, share, strict=True):  # one filled step path a phase
        edges = np.arange(len(row) + 1)
        ax.stairs(bottom + row, edges, baseline=bottom, fill=True, color=COLORS[p], label=p)
        bottom = bottom + row
    per = -(-len(v.burst_ms) // len(groups))
    ax.set(xlabel=f"burst, in order ({per} a bar)" if per > 1 else "burst, in order", ylim=(0, 1))
    return None


#: The level-2 split's parts, nested as printed: scan inside vkda, vffn inside vrest.
SPLIT = {"vkda - scan": "#4e79a7", "scan (in vkda)": "#a0cbe8", "vmla": "#f28e2b",
         "vrest - vffn": "#59a14f", "vffn (in vrest)": "#8cd17d"}  # fmt: skip


@panels("", h=1.5, legend="right")
def verify_split(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Level-2 verify sub-split over the bursts that printed it, per-round mean ms (vrest =
    verify - vkda - vmla)."""
    b = [x for x in v.run.bursts if x.split_ns is not None]
    if not (n := sum(x.phases.rounds for x in b) * 1e6):  # rounds, in ns a ms
        return "no level-2 ([tag-v]) lines"
    kda, scan, mla, ffn = np.array([x.split_ns for x in b]).sum(axis=0) / n
    rest = max(sum(x.phases.verify for x in b) / n - kda - mla, 0.0)
    parts = (kda - scan, scan, mla, max(rest - ffn, 0.0), min(ffn, rest))
    for (name, col), x, left in zip(SPLIT.items(), parts, np.cumsum((0, *parts[:-1])), strict=True):
        ax.barh(0, x, left=left, color=col, label=name)
    ax.set(yticks=[], xlabel="verify, per-round mean ms")
    return None


#: First-token fields that are shares inside a bucket (not additive to it), by bucket.
SHARES = {"prime": ("prime_tap_dtoh",), "first_burst": ("first_burst_hook",),
          "draft_prime": ("draft_prime_h2d", "draft_prime_feat", "draft_prime_kv")}  # fmt: skip
BUCKETS = [f[:-3] for f in FIRST_TOKEN_FIELDS if f.endswith("_ms")]  # a colour each, every panel


def _tab(name: str) -> Any:
    return matplotlib.colormaps["tab20"](BUCKETS.index(name) if name in BUCKETS else 19)


@panels("", h=3.4, sharey=False, legend="below")
def first_token_waterfall_per_session(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """First-token waterfall of up to 10 sessions spread over the TTFT range: buckets in the order
    they ran; round-1 buckets sit inside first_burst; hatched bars are shares of the bucket above
    them (tap DtoH in prime, the drafter-prime split, the commit hook)."""
    fts = sorted(v.run.first_tokens, key=lambda f: f.prof.total_ms())
    if not fts:
        return "no first-token profile ([spec-prof]) in this input"
    pick = sorted({round(q) for q in np.linspace(0, len(fts) - 1, min(10, len(fts)))})
    for y, ft in enumerate(fts[i] for i in pick):
        t0 = min(a for _, a, _ in ft.intervals)
        fb = next((x for x in ft.intervals if x[0] == "first_burst"), ("", 0, 0))
        for name, a, b in ft.intervals:
            inner = name != "first_burst" and fb[1] <= a and b <= fb[2]  # round 1's buckets
            ax.barh(y, (b - a) / 1e6, left=(a - t0) / 1e6, height=0.4 if inner else 0.8,
                    zorder=3 if inner else 2, color=_tab(name), label=name)  # fmt: skip
            shares = [(s, getattr(ft.prof, s + "_ms")) for s in SHARES.get(name, ())]
            shares = [(s, w) for s, w in shares if w > 0]
            x = (a - t0) / 1e6  # from the bucket's start; the hook at the burst's end
            x = (b - t0) / 1e6 - sum(w for _, w in shares) if name == "first_burst" else x
            for share, w in shares:
                ax.barh(y - 0.3, w, left=x, height=0.2, color=_tab(share), hatch="//", label=share)
                x += w
    ax.set_yticks(range(len(pick)), [f"TTFT {fts[i].prof.total_ms():.1f} ms" for i in pick])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the session's first bucket")
    return None


@panels("sessions")
def ttft_distribution(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """TTFT per session: the creation buckets + the first burst (the profile's total_ms)."""
    if not len(x := v.ttft_ms):
        return "no first-token profile ([spec-prof]) in this input"
    ax.hist(x, bins=min(60, max(5, len(x) // 3)), color=COLORS["accept"])
    ax.axvline(median(x), color="k", lw=1, label=f"median {median(x):.2f} ms (n={len(x)})")
    ax.set_xlabel("time to first token (profile total), ms")
    return None


def _band(ax: Axes, x: Any, ivs: Sequence[Interval], color: str, label: str, f: str = "-o") -> None:
    """Estimates with their intervals: the values, a band between the bounds."""
    val, lo, hi = np.array(ivs, dtype=float).reshape(-1, 3).T
    ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
    ax.plot(x, val, f, color=color, ms=3, lw=1, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


@panels("probability", legend="best")
def acceptance_by_position(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Estimates: acceptance by draft position, α_i = P(accepted | drafted and every earlier
    draft accepted), with its 95% Wilson interval, and S(i+1) = P(drafts 0..i all accepted),
    product-limit, with its interval."""
    if not (ps := v.acceptance.positions):
        return "no round with known k and j"
    _band(ax, [p.position for p in ps], [p.alpha for p in ps], COLORS["draft"], "α_i", "o")
    _band(ax, [p.position for p in ps], [p.survival for p in ps], COLORS["verify"], "S(i+1)")
    ax.set(xlabel="draft position i (0-based)", ylim=(0, 1.02))
    return None


@panels("tokens per round", legend="best")
def expected_tokens_per_round(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Estimates: tokens a round drafting k commits, E(k) = 1 + Σ S(i), with its interval; past
    the deepest position seen (dotted), acceptance is the flat tail's."""
    if not (acc := v.acceptance).positions:
        return "no round with known k and j"
    ks = range(1, 17)
    _band(ax, ks, [acc.expected_tokens(k) for k in ks], COLORS["accept"], "E(k)")
    ax.axvline(len(acc.positions) + 0.5, color="#999", ls=":", lw=1, label="data | flat tail")
    ax.set_xlabel("draft length k")
    return None


@panels("tokens per second", legend="best")
def throughput_vs_k(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Estimates: throughput E(k) / t_round(k), the cost model fitted to the rounds' own phases,
    with the recommended k (the best within 2 past the longest draft seen, dotted) and the
    throughput the rounds measured."""
    if (a := v.advice) is None:
        return f"no advice: fewer than {MIN_ROUNDS} rounds with known k >= 1"
    _band(ax, range(1, 17), [p.tokens_per_s for p in a.curve], COLORS["rollback"], "model")
    ax.axvline(a.recommended_k, color="k", lw=1, label=f"recommended k = {a.recommended_k}")
    ax.axvline(a.observed_k + 0.5, color="#999", ls=":", lw=1)
    ax.axhline(a.measured_tokens_per_s, color="#999", ls="--", lw=1, label="measured")
    ax.set_xlabel("draft length k")
    return None


@panels("free MB", fmt=lambda vs: "png" if max(len(v.ttft_ms) for v in vs) > 2000 else "svg")
def free_device_memory(ax: Axes, v: View, views: Sequence[View]) -> str | None:
    """Free device memory per CUDA ordinal, before the trunk cache alloc and after the drafter
    KV (PNG past 2000 sessions a run: the lines turn dense)."""
    fts = v.run.first_tokens
    devs = sorted({d for f in fts for d, _ in f.prof.free_mb_before + f.prof.free_mb_after})
    for d in devs:
        for point, ls in (("before", "-"), ("after", "--")):
            y = [dict(getattr(f.prof, "free_mb_" + point)).get(d, np.nan) for f in fts]
            ax.plot(np.arange(len(y)), y, ls, lw=0.9, label=f"device {d} {point}")
    ax.set_xlabel("session, in order")
    return None if devs else "no free-memory snapshot in this input"
