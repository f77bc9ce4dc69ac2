"""The page's figures: matplotlib (the object API, no pyplot state), inlined as data URIs.

Every figure takes the page's views (one run, or A and B) and draws one panel per run with
shared axes, so an A/B page shows both side by side on the same scale. Bars and lines go
out as SVG (text stays text: small, printable); dense scatters as PNG. A view with nothing
to draw gets a panel that says so, never a missing figure.
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Callable, Sequence
from html import escape

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..events import PHASES
from .stats import View, median, phase_totals, threshold

__all__ = ["free_memory", "shares_by_burst", "shares_by_round", "ttft", "verify_split"]
__all__ += ["wall_by_index", "wall_distribution", "waterfall"]

COLORS = dict(zip(PHASES, ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2"), strict=True))
_RC = {
    "font.size": 8.5,
    "svg.fonttype": "none",
    "svg.hashsalt": "memra-obs",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def _styled(fn: Callable[..., str | None]) -> Callable[..., str | None]:
    """Draw under the report's style (rcParams are read as artists are made), leaving the
    process's own matplotlib settings alone."""

    @functools.wraps(fn)
    def wrapper(views: Sequence[View]) -> str | None:
        with matplotlib.rc_context(_RC):  # type: ignore[arg-type]
            return fn(views)

    return wrapper


def _panels(
    views: Sequence[View], h: float = 2.8, sharey: bool = True
) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(9.6 if len(views) == 1 else 5.2 * len(views), h), layout="constrained")
    axes = list(fig.subplots(1, len(views), sharex=True, sharey=sharey, squeeze=False)[0])
    for ax, v in zip(axes, views, strict=True):
        ax.set_title(v.label, loc="left", fontsize=9)
    return fig, axes


def _img(fig: Figure, alt: str, fmt: str = "svg") -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100, metadata={"Date": None} if fmt == "svg" else {})
    mime = "image/svg+xml" if fmt == "svg" else "image/png"
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img alt="{escape(alt)}" src="data:{mime};base64,{data}">'


def _empty(ax: Axes, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#666")


def _figure(fig: Figure, alt: str, caption: str, fmt: str = "svg") -> str:
    return f"<figure>{_img(fig, alt, fmt)}<figcaption>{caption}</figcaption></figure>"


@_styled
def wall_distribution(views: Sequence[View]) -> str:
    """Histogram of the rounds' own walls, with the median and the f32(1.5 x median) mark."""
    fig, axes = _panels(views)
    walls = [v.cols.metric("wall") for v in views]
    allw = np.concatenate(walls)
    edges = np.linspace(allw.min(), np.quantile(allw, 0.995), 81) if len(allw) else None
    for ax, w in zip(axes, walls, strict=True):
        if not len(w):
            _empty(ax, "no round with its own wall")
            continue
        ax.hist(np.clip(w, None, edges[-1]), bins=edges, color=COLORS["verify"], alpha=0.8)  # type: ignore[index,arg-type]
        med, thr, above = threshold(w)
        ax.axvline(med, color="k", lw=1, label=f"median {med:.3f} ms")
        ax.axvline(
            thr, color="#e15759", ls="--", lw=1, label=f"1.5x median {thr:.3f} ms: {above} above"
        )
        ax.legend(loc="upper right")
        ax.set_xlabel("round wall, ms (last bin: all past the 99.5th percentile)")
    axes[0].set_ylabel("rounds")
    cap = (
        "Per-round wall of every round with its own measurement (a log's rows, the first 64 "
        "rounds of each session; a span file's round spans); medians pooled over the run."
    )
    return _figure(fig, "round wall distribution", cap)


@_styled
def wall_by_index(views: Sequence[View]) -> str:
    """Wall over the round's index in its session: own rounds as dots, burst means grey."""
    fig, axes = _panels(views)
    for ax, v in zip(axes, views, strict=True):
        c = v.cols
        if not len(c.wall_ms):
            _empty(ax, "no rounds")
            continue
        ax.scatter(
            c.index[~c.own],
            c.wall_ms[~c.own],
            s=2,
            c="#bbb",
            lw=0,
            label="burst mean",
            rasterized=True,
        )
        ax.scatter(
            c.index[c.own],
            c.wall_ms[c.own],
            s=3,
            c=COLORS["draft"],
            lw=0,
            label="own wall",
            rasterized=True,
        )
        if c.own.any():
            idx = np.unique(c.index[c.own])
            med = [median(c.wall_ms[c.own & (c.index == i)]) for i in idx[:512]]
            ax.plot(idx[:512], med, color="k", lw=0.8, label="median per index")
        ax.set_xlabel("round index in its session")
        ax.set_ylim(0, float(np.quantile(c.wall_ms, 0.995)) * 1.3)
        ax.legend(loc="upper right", markerscale=3)
    axes[0].set_ylabel("round wall, ms")
    return _figure(
        fig,
        "round wall over round index",
        "Round wall over the round's index in its session (y cut at 1.3 x the 99.5th percentile).",
        "png",
    )


@_styled
def shares_by_round(views: Sequence[View]) -> str:
    """Stacked phase shares by round index (mean over sessions of the rounds' own times)."""
    fig, axes = _panels(views)
    for ax, v in zip(axes, views, strict=True):
        c = v.cols
        if not c.own.any():
            _empty(ax, "no round with its own phase times")
            continue
        idx = c.index[c.own]
        n = min(int(idx.max()) + 1, 256)
        sums = np.stack([np.bincount(idx, c.phase_ms[c.own, p], n) for p in range(5)])[:, :n]
        share = sums / np.maximum(sums.sum(axis=0), 1e-12)
        ax.stackplot(np.arange(n), share, colors=[COLORS[p] for p in PHASES], labels=PHASES)
        ax.set_xlabel("round index in its session")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("share of the round")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize=7.5)
    cap = "Phase shares per round, by index in the session (rounds with their own times)."
    return _figure(fig, "phase shares per round", cap)


@_styled
def shares_by_burst(views: Sequence[View]) -> str:
    """Stacked phase shares per burst, in log order (bins of consecutive bursts when many)."""
    fig, axes = _panels(views)
    for ax, v in zip(axes, views, strict=True):
        b = v.run.bursts
        if not b:
            _empty(ax, "no bursts")
            continue
        tot = np.stack([phase_totals(x) for x in b])
        groups = np.array_split(tot, min(len(b), 120))
        share = np.stack([g.sum(axis=0) for g in groups]).T
        share = share / np.maximum(share.sum(axis=0), 1e-12)
        bottom, edges = np.zeros(share.shape[1]), np.arange(share.shape[1] + 1)
        for p, row in zip(PHASES, share, strict=True):  # one filled step path a phase
            ax.stairs(bottom + row, edges, baseline=bottom, fill=True, color=COLORS[p], label=p)
            bottom = bottom + row
        per = -(-len(b) // len(groups))
        ax.set_xlabel(f"burst, in order ({per} a bar)" if per > 1 else "burst, in order")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("share of the burst")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize=7.5)
    cap = "Phase shares per burst (the [glm5-phase] lines' totals; span files: burst attributes)."
    return _figure(fig, "phase shares per burst", cap)


SPLIT = (
    ("vkda - scan", "#4e79a7"),
    ("scan (in vkda)", "#a0cbe8"),
    ("vmla", "#f28e2b"),
    ("vrest - vffn", "#59a14f"),
    ("vffn (in vrest)", "#8cd17d"),
)


@_styled
def verify_split(views: Sequence[View]) -> str | None:
    """The level-2 verify split, per-round mean ms (shares inside their bucket shown inside)."""
    rows = []
    for v in views:
        b = [x for x in v.run.bursts if x.split_ns is not None]
        n = sum(x.phases.rounds for x in b)
        if not n:
            continue
        kda, scan, mla, ffn = (sum(x.split_ns[i] for x in b) / n / 1e6 for i in range(4))  # type: ignore[index,misc]
        rest = max(sum(x.phases.verify for x in b) / n / 1e6 - kda - mla, 0.0)
        rows.append((v.label, (kda - scan, scan, mla, max(rest - ffn, 0.0), min(ffn, rest))))
    if not rows:
        return None
    fig = Figure(figsize=(9.6, 0.9 + 0.45 * len(rows)), layout="constrained")
    ax = fig.subplots()
    for y, (_, parts) in enumerate(rows):
        left = 0.0
        for (name, col), x in zip(SPLIT, parts, strict=True):
            ax.barh(y, x, left=left, color=col, label=name if y == 0 else None)
            left += x
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("verify, per-round mean ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize=7.5)
    cap = "Level-2 verify sub-split over the bursts that printed it (vrest = verify - vkda - vmla)."
    return _figure(fig, "verify split", cap)


#: First-token buckets drawn as shares inside another bucket (not additive to it).
_SHARES = {
    "prime": ("prime_tap_dtoh",),
    "first_burst": ("first_burst_hook",),
    "draft_prime": ("draft_prime_h2d", "draft_prime_feat", "draft_prime_kv"),
}


@_styled
def waterfall(views: Sequence[View]) -> str:
    """Up to 10 sessions (spread over the TTFT range): each bucket where it ran, round-1
    buckets and the shares (tap DtoH, drafter-prime split, hook) drawn inside their bucket."""
    fig, axes = _panels(views, h=3.4, sharey=False)
    cmap = matplotlib.colormaps["tab20"]
    colors: dict[str, object] = {}
    for ax, v in zip(axes, views, strict=True):
        fts = sorted(v.run.first_tokens, key=lambda f: f.prof.total_ms())
        if not fts:
            _empty(ax, "no first-token profile ([spec-prof]) in this input")
            continue
        pick = sorted({round(q) for q in np.linspace(0, len(fts) - 1, min(10, len(fts)))})
        for y, i in enumerate(pick):
            ft = fts[i]
            t0 = min(a for _, a, _ in ft.intervals)
            fb = next((x for x in ft.intervals if x[0] == "first_burst"), ("", 0, 0))
            for name, a, b in ft.intervals:
                inner = name != "first_burst" and fb[1] <= a and b <= fb[2]
                col = colors.setdefault(name, cmap(len(colors) % 20))
                ax.barh(
                    y,
                    (b - a) / 1e6,
                    left=(a - t0) / 1e6,
                    height=0.4 if inner else 0.8,
                    zorder=3 if inner else 2,
                    color=col,
                    label=name,
                )
                shares = [(s, getattr(ft.prof, s + "_ms")) for s in _SHARES.get(name, ())]
                x = (a - t0) / 1e6  # shares from the bucket's start; the hook at its end
                if name == "first_burst":
                    x = (b - t0) / 1e6 - sum(w for _, w in shares)
                for share, w in shares:
                    if w > 0:
                        col = colors.setdefault(share, cmap(len(colors) % 20))
                        ax.barh(
                            y - 0.3,
                            w,
                            left=x,
                            height=0.2,
                            color=col,
                            hatch="//",
                            label=share,
                            zorder=3,
                        )
                        x += w
        ax.set_yticks(range(len(pick)), [f"TTFT {fts[i].prof.total_ms():.1f} ms" for i in pick])
        ax.invert_yaxis()
        ax.set_xlabel("ms from the session's first bucket")
    handles = {
        label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels(), strict=True)
    }
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=7, fontsize=7)
    cap = (
        "First-token waterfall of up to 10 sessions spread over the TTFT range: buckets in the "
        "order they ran; round-1 buckets sit inside first_burst, hatched bars are shares of "
        "the bucket above them (tap DtoH in prime, the drafter-prime split, the commit hook)."
    )
    return _figure(fig, "first-token waterfall per session", cap)


@_styled
def ttft(views: Sequence[View]) -> str:
    """Distribution of the profile's first-token latency (``SpecFirstTokenProf.total_ms``)."""
    fig, axes = _panels(views)
    for ax, v in zip(axes, views, strict=True):
        x = np.array([f.prof.total_ms() for f in v.run.first_tokens])
        if not len(x):
            _empty(ax, "no first-token profile")
            continue
        ax.hist(x, bins=min(60, max(5, len(x) // 3)), color=COLORS["accept"])
        ax.axvline(median(x), color="k", lw=1, label=f"median {median(x):.2f} ms (n={len(x)})")
        ax.legend(loc="upper right")
        ax.set_xlabel("time to first token (profile total), ms")
    axes[0].set_ylabel("sessions")
    return _figure(fig, "TTFT distribution", "TTFT per session: creation buckets + first burst.")


@_styled
def free_memory(views: Sequence[View]) -> str:
    """Free device memory before the cache allocation and after the drafter KV, per device."""
    fig, axes = _panels(views)
    dense = False
    for ax, v in zip(axes, views, strict=True):
        fts = v.run.first_tokens
        devs = sorted({d for f in fts for d, _ in f.prof.free_mb_before + f.prof.free_mb_after})
        if not devs:
            _empty(ax, "no free-memory snapshot in this input")
            continue
        dense |= len(fts) > 2000
        for d in devs:
            for point, ls in (("before", "-"), ("after", "--")):
                y = [dict(getattr(f.prof, "free_mb_" + point)).get(d, np.nan) for f in fts]
                ax.plot(np.arange(len(y)), y, ls, lw=0.9, label=f"device {d} {point}")
        ax.set_xlabel("session, in order")
        ax.legend(loc="lower right")
    axes[0].set_ylabel("free MB")
    cap = (
        "Free device memory per CUDA ordinal, before the trunk cache alloc / after the drafter KV."
    )
    return _figure(fig, "free device memory", cap, "png" if dense else "svg")
