"""The page's figures: matplotlib (the object API, no pyplot state), inlined as data URIs.

Every figure draws one panel per run with shared axes, so an A/B page shows both runs side by
side on one scale; a run with nothing to draw gets a panel that says so, never a missing
figure. Bars and lines go out as SVG (text stays text: small, printable), dense scatters as
PNG. The report's style is applied per figure (``rc_context``): the process's own matplotlib
settings are left alone.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from html import escape

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..timeline import PHASES
from .stats import View, burst_ms, median, threshold

__all__ = ["free_memory", "inline", "per_run", "shares_by_burst", "shares_by_round", "ttft"]
__all__ += ["verify_split", "wall_by_index", "wall_distribution", "waterfall"]

COLORS = dict(zip(PHASES, ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2"), strict=True))
_RC = {"font.size": 8.5, "svg.fonttype": "none", "svg.hashsalt": "memra-obs", "axes.grid": True,
       "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False}  # fmt: skip
#: A panel's drawing: returns why it has nothing to draw, or None.
Draw = Callable[[Axes, View], "str | None"]


def inline(fig: Figure, alt: str, caption: str, fmt: str = "svg") -> str:
    """A figure as the page's ``<figure>``: the image inline (a data URI), then its caption.
    Any section (the acceptance one too) hands its own matplotlib Figure here."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100, metadata={"Date": None} if fmt == "svg" else {})
    data = base64.b64encode(buf.getvalue()).decode()
    mime = "image/svg+xml" if fmt == "svg" else "image/png"
    return (f'<figure><img alt="{escape(alt)}" src="data:{mime};base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>")  # fmt: skip


def per_run(views: Sequence[View], draw: Draw, alt: str, cap: str, ylabel: str, *, fmt: str = "svg",
            h: float = 2.8, sharey: bool = True, legend: str = "") -> str:  # fmt: skip
    """One panel per run, ``draw`` on each; ``legend``: "" one in each panel, else one for
    all, ``"right"`` of them or ``"below"``."""
    with matplotlib.rc_context(_RC):  # type: ignore[arg-type]
        fig = Figure(
            figsize=(9.6 if len(views) == 1 else 5.2 * len(views), h), layout="constrained"
        )
        axes = fig.subplots(1, len(views), sharex=True, sharey=sharey, squeeze=False)[0]
        for ax, v in zip(axes, views, strict=True):
            ax.set_title(v.label, loc="left", fontsize=9)
            why = draw(ax, v)
            if why:
                ax.text(
                    0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#666"
                )
            elif not legend:
                ax.legend(loc="upper right", markerscale=3)
        axes[0].set_ylabel(ylabel)
        hs = {lb: h for ax in axes for h, lb in zip(*ax.get_legend_handles_labels(), strict=True)}
        if legend and hs:  # one legend for the panels: right of them, or below
            right = legend == "right"
            where = "outside right upper" if right else "outside lower center"
            fig.legend(list(hs.values()), list(hs.keys()), loc=where, ncols=1 if right else 7,  # type: ignore[call-overload]
                       fontsize=7)  # fmt: skip
        return inline(fig, alt, cap, fmt)


def _wall_hist(ax: Axes, v: View, edges: np.ndarray) -> str | None:
    w = v.cols.metric("wall")
    if not len(w):
        return "no round with its own wall"
    ax.hist(np.clip(w, None, edges[-1]), bins=edges, color=COLORS["verify"], alpha=0.8)  # type: ignore[arg-type]
    med, thr, above = threshold(w)
    ax.axvline(med, color="k", lw=1, label=f"median {med:.3f} ms")
    ax.axvline(
        thr, color="#e15759", ls="--", lw=1, label=f"1.5x median {thr:.3f} ms: {above} above"
    )
    ax.set_xlabel("round wall, ms (last bin: all past the 99.5th percentile)")
    return None


def wall_distribution(views: Sequence[View]) -> str:
    w = np.concatenate([v.cols.metric("wall") for v in views])
    edges = np.linspace(w.min(), np.quantile(w, 0.995), 81) if len(w) else np.arange(2.0)
    cap = ("Per-round wall of every round with its own measurement (a log's rows: the first 64 "
           "rounds of each session; a span file's round spans); median and mark pooled over the run.")  # fmt: skip
    return per_run(
        views, lambda ax, v: _wall_hist(ax, v, edges), "round wall distribution", cap, "rounds"
    )


def _wall_index(ax: Axes, v: View) -> str | None:
    c = v.cols
    if not len(c.wall_ms):
        return "no rounds"
    for sel, color, label in ((~c.own, "#bbb", "burst mean"), (c.own, COLORS["draft"], "own wall")):
        ax.scatter(c.index[sel], c.wall_ms[sel], s=2.5, c=color, lw=0, label=label, rasterized=True)
    if c.own.any():
        idx = np.unique(c.index[c.own])[:512]
        med = [median(c.wall_ms[c.own & (c.index == i)]) for i in idx]
        ax.plot(idx, med, color="k", lw=0.8, label="median per index")
    ax.set_ylim(0, float(np.quantile(c.wall_ms, 0.995)) * 1.3)
    ax.set_xlabel("round index in its session")
    return None


def _round_shares(ax: Axes, v: View) -> str | None:
    c = v.cols
    if not c.own.any():
        return "no round with its own phase times"
    idx = c.index[c.own]
    n = min(int(idx.max()) + 1, 256)
    sums = np.stack([np.bincount(idx, c.phase_ms[c.own, p], n)[:n] for p in range(5)])
    share = sums / np.maximum(sums.sum(axis=0), 1e-12)
    ax.stackplot(np.arange(n), share, colors=[COLORS[p] for p in PHASES], labels=PHASES)
    ax.set(xlabel="round index in its session", ylim=(0, 1))
    return None


def _burst_shares(ax: Axes, v: View) -> str | None:
    b = v.run.bursts
    if not b:
        return "no bursts"
    groups = np.array_split(burst_ms(b), min(len(b), 120))
    share = np.stack([g.sum(axis=0) for g in groups]).T
    share = share / np.maximum(share.sum(axis=0), 1e-12)
    bottom, edges = np.zeros(share.shape[1]), np.arange(share.shape[1] + 1)
    for p, row in zip(PHASES, share, strict=True):  # one filled step path a phase
        ax.stairs(bottom + row, edges, baseline=bottom, fill=True, color=COLORS[p], label=p)
        bottom = bottom + row
    per = -(-len(b) // len(groups))
    ax.set(xlabel=f"burst, in order ({per} a bar)" if per > 1 else "burst, in order", ylim=(0, 1))
    return None


def _ttft(ax: Axes, v: View) -> str | None:
    x = np.array([f.prof.total_ms() for f in v.run.first_tokens])
    if not len(x):
        return "no first-token profile ([spec-prof]) in this input"
    ax.hist(x, bins=min(60, max(5, len(x) // 3)), color=COLORS["accept"])
    ax.axvline(median(x), color="k", lw=1, label=f"median {median(x):.2f} ms (n={len(x)})")
    ax.set_xlabel("time to first token (profile total), ms")
    return None


def _memory(ax: Axes, v: View) -> str | None:
    fts = v.run.first_tokens
    devs = sorted({d for f in fts for d, _ in f.prof.free_mb_before + f.prof.free_mb_after})
    for d in devs:
        for point, ls in (("before", "-"), ("after", "--")):
            y = [dict(getattr(f.prof, "free_mb_" + point)).get(d, np.nan) for f in fts]
            ax.plot(np.arange(len(y)), y, ls, lw=0.9, label=f"device {d} {point}")
    ax.set_xlabel("session, in order")
    return None if devs else "no free-memory snapshot in this input"


SPLIT = (("vkda - scan", "#4e79a7"), ("scan (in vkda)", "#a0cbe8"), ("vmla", "#f28e2b"),
         ("vrest - vffn", "#59a14f"), ("vffn (in vrest)", "#8cd17d"))  # fmt: skip


def verify_split(views: Sequence[View]) -> str | None:
    """The level-2 split as per-round mean ms, one bar a run (None: no run printed it)."""
    rows = []
    for v in views:
        b = [x for x in v.run.bursts if x.split_ns is not None]
        n = sum(x.phases.rounds for x in b)
        if n:
            kda, scan, mla, ffn = (sum(x.split_ns[i] for x in b) / n / 1e6 for i in range(4))  # type: ignore[index,misc]
            rest = max(sum(x.phases.verify for x in b) / n / 1e6 - kda - mla, 0.0)
            rows.append((v.label, (kda - scan, scan, mla, max(rest - ffn, 0.0), min(ffn, rest))))
    if not rows:
        return None
    with matplotlib.rc_context(_RC):  # type: ignore[arg-type]
        fig = Figure(figsize=(9.6, 0.9 + 0.45 * len(rows)), layout="constrained")
        ax = fig.subplots()
        for y, (_, parts) in enumerate(rows):
            lefts = np.concatenate([[0.0], np.cumsum(parts)[:-1]])
            for (name, col), x, left in zip(SPLIT, parts, lefts, strict=True):
                ax.barh(y, x, left=left, color=col, label=name if y == 0 else None)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel("verify, per-round mean ms")
        ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize=7.5)
        cap = "Level-2 verify sub-split over the bursts that printed it (vrest = verify - vkda - vmla)."
        return inline(fig, "verify split", cap)


#: First-token fields that are shares inside a bucket (not additive to it), by bucket.
_SHARES = {"prime": ("prime_tap_dtoh",), "first_burst": ("first_burst_hook",),
           "draft_prime": ("draft_prime_h2d", "draft_prime_feat", "draft_prime_kv")}  # fmt: skip


def _waterfall(ax: Axes, v: View, colors: dict[str, object]) -> str | None:
    """Up to 10 sessions spread over the TTFT range, each bucket where it ran."""
    fts = sorted(v.run.first_tokens, key=lambda f: f.prof.total_ms())
    if not fts:
        return "no first-token profile ([spec-prof]) in this input"
    cmap = matplotlib.colormaps["tab20"]
    pick = sorted({round(q) for q in np.linspace(0, len(fts) - 1, min(10, len(fts)))})
    for y, ft in enumerate(fts[i] for i in pick):
        t0 = min(a for _, a, _ in ft.intervals)
        fb = next((x for x in ft.intervals if x[0] == "first_burst"), ("", 0, 0))
        for name, a, b in ft.intervals:
            inner = name != "first_burst" and fb[1] <= a and b <= fb[2]  # round 1's buckets
            col = colors.setdefault(name, cmap(len(colors) % 20))
            ax.barh(y, (b - a) / 1e6, left=(a - t0) / 1e6, height=0.4 if inner else 0.8,
                    zorder=3 if inner else 2, color=col, label=name)  # fmt: skip
            shares = [
                (s, w) for s in _SHARES.get(name, ()) if (w := getattr(ft.prof, s + "_ms")) > 0
            ]
            x = (
                (a - t0) / 1e6
                if name != "first_burst"
                else (b - t0) / 1e6 - sum(w for _, w in shares)
            )
            for share, w in shares:  # from the bucket's start; the hook at the burst's end
                col = colors.setdefault(share, cmap(len(colors) % 20))
                ax.barh(
                    y - 0.3, w, left=x, height=0.2, color=col, hatch="//", label=share, zorder=3
                )
                x += w
    ax.set_yticks(range(len(pick)), [f"TTFT {fts[i].prof.total_ms():.1f} ms" for i in pick])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the session's first bucket")
    return None


def waterfall(views: Sequence[View]) -> str:
    colors: dict[str, object] = {}  # one colour a bucket across both panels
    cap = ("First-token waterfall of up to 10 sessions spread over the TTFT range: buckets in the "
           "order they ran; round-1 buckets sit inside first_burst; hatched bars are shares of the "
           "bucket above them (tap DtoH in prime, the drafter-prime split, the commit hook).")  # fmt: skip
    return per_run(views, lambda ax, v: _waterfall(ax, v, colors), "first-token waterfall per session",
                   cap, "", h=3.4, sharey=False, legend="below")  # fmt: skip


def wall_by_index(views: Sequence[View]) -> str:
    cap = "Round wall over the round's index in its session (y cut at 1.3 x the 99.5th percentile)."
    return per_run(
        views, _wall_index, "round wall over round index", cap, "round wall, ms", fmt="png"
    )


def shares_by_round(views: Sequence[View]) -> str:
    cap = "Phase shares per round, by index in the session (rounds with their own times)."
    return per_run(views, _round_shares, "phase shares per round", cap, "share", legend="right")


def shares_by_burst(views: Sequence[View]) -> str:
    cap = "Phase shares per burst (the [glm5-phase] lines' totals; span files: burst attributes)."
    return per_run(views, _burst_shares, "phase shares per burst", cap, "share", legend="right")


def ttft(views: Sequence[View]) -> str:
    cap = "TTFT per session: the creation buckets + the first burst (the profile's total_ms)."
    return per_run(views, _ttft, "TTFT distribution", cap, "sessions")


def free_memory(views: Sequence[View]) -> str:
    cap = "Free device memory per CUDA ordinal, before the trunk cache alloc and after the drafter KV."
    dense = max(len(v.run.first_tokens) for v in views) > 2000
    return per_run(
        views, _memory, "free device memory", cap, "free MB", fmt="png" if dense else "svg"
    )
