"""Building blocks shared by the memra dashboards: selectors, PromQL helpers, panel factories.

Every panel and target goes through here so that the datasource, refIds, panel ids and the
template-variable selectors are set in one place (the SDK leaves refId "" and id 0 otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from grafana_foundation_sdk.builders import (
    barchart,
    bargauge,
    heatmap,
    prometheus,
    stat,
    timeseries,
)
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Selectors. Spec metrics carry `family`; device and exporter metrics do not (filtering them
# on family would hide them). In agent mode every series also has `worker`; panels sum it away
# unless they are about one worker.
SPEC = 'job=~"$job", instance=~"$instance", family=~"$family"'
HOST = 'job=~"$job", instance=~"$instance"'
RI = "$__rate_interval"
# First tokens come once per request: a rate window of a few scrapes is mostly empty, so their
# panels look back further.
SPARSE = "5m"


def rate(metric: str, sel: str = SPEC, window: str = RI) -> str:
    return f"rate({metric}{{{sel}}}[{window}])"


def sum_rate(metric: str, by: Sequence[str] = (), sel: str = SPEC, window: str = RI) -> str:
    grouping = f" by ({', '.join(by)}) " if by else ""
    return f"sum{grouping}({rate(metric, sel, window)})"


def ratio(num: str, den: str, matching: str = "") -> str:
    """`num / (den > 0)`: a series whose denominator is 0 (an idle worker: its counters exist
    but do not move) gives no sample, so a panel reads "No data" rather than 0/0 = NaN; while
    busy the values are the plain quotient's (as the recording rules guard theirs). `num` and
    `den` are single terms (an aggregation, a selector). `matching` is the division's
    vector-matching modifiers, e.g. "ignoring(phase) group_left": a bare group_left or
    group_right gets an empty label list, or it would read the parenthesised denominator as
    its labels (a parse error)."""
    m = matching.strip()
    if m.endswith(("group_left", "group_right")):
        m += "()"
    return f"{num} / {m + ' ' if m else ''}({den} > 0)"


def quantile(q: float, hist: str, by: Sequence[str] = (), sel: str = SPEC, window: str = RI) -> str:
    """histogram_quantile over the rate of a classic histogram's buckets, kept only where the
    histogram observed something in the window: over all-zero bucket rates (an idle worker)
    histogram_quantile gives NaN, and the panel would show it rather than "No data"."""
    buckets = sum_rate(hist + "_bucket", ("le", *by), sel, window)
    count = sum_rate(hist + "_count", by, sel, window)
    return f"histogram_quantile({q}, {buckets}) and on ({', '.join(by)}) ({count} > 0)"


def mean(hist: str, by: Sequence[str] = (), sel: str = SPEC, window: str = RI) -> str:
    """Mean observation over the window: rate(sum) / rate(count), none while nothing is observed."""
    return ratio(
        sum_rate(hist + "_sum", by, sel, window), sum_rate(hist + "_count", by, sel, window)
    )


def target(
    expr: str,
    legend: str = "__auto",
    *,
    exemplar: bool = False,
    instant: bool = False,
    fmt: str | None = None,
) -> prometheus.Dataquery:
    t = prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DS)
    t = t.instant() if instant else t.range()
    if exemplar:
        t = t.exemplar(True)
    if fmt:
        t = t.format(fmt)
    return t


class Ids:
    """Hands out panel ids in build order, so the JSON is stable run to run."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n


def _finish(
    panel, ids: Ids, title: str, desc: str, targets: Iterable[prometheus.Dataquery], w: int, h: int
):
    panel = panel.id(ids.next()).title(title).description(desc).datasource(DS).span(w).height(h)
    for i, t in enumerate(targets):
        panel = panel.with_target(t.ref_id(chr(ord("A") + i)))
    return panel


def legend_table(calcs: Sequence[str] = ("mean", "max", "lastNotNull")) -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(list(calcs))
    )


def ts(
    ids: Ids,
    title: str,
    desc: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str = "s",
    w: int = 12,
    h: int = 8,
    stacking: common.StackingMode | None = None,
    fill: float = 0,
    min_val: float | None = None,
    max_val: float | None = None,
) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .unit(unit)
        .line_width(1)
        .fill_opacity(fill)
        .legend(legend_table())
        .tooltip(
            cb.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if stacking is not None:
        p = p.stacking(cb.StackingConfig().mode(stacking))
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    return _finish(p, ids, title, desc, targets, w, h)


def stat_panel(
    ids: Ids,
    title: str,
    desc: str,
    t: prometheus.Dataquery,
    *,
    unit: str,
    decimals: int = 2,
    w: int = 4,
) -> stat.Panel:
    p = (
        stat.Panel()
        .unit(unit)
        .decimals(decimals)
        .graph_mode(common.BigValueGraphMode.AREA)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    return _finish(p, ids, title, desc, [t], w, 4)


def heatmap_panel(
    ids: Ids,
    title: str,
    desc: str,
    t: prometheus.Dataquery,
    *,
    unit: str = "s",
    w: int = 12,
    h: int = 9,
) -> heatmap.Panel:
    # calculate(False): Prometheus already bucketed the data; the `le` layout tells Grafana the
    # buckets are upper bounds, so it de-accumulates them instead of re-binning.
    p = (
        heatmap.Panel()
        .calculate(False)
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        .y_axis(heatmap.YAxisConfig().unit(unit))
        .color(
            heatmap.HeatmapColorOptions()
            .mode(hm.HeatmapColorMode.SCHEME)
            .scheme("Spectral")
            .scale(hm.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
        )
        .cell_gap(1)
        .show_value(common.VisibilityMode.NEVER)
        .show_y_histogram()
        .exemplars_color("rgba(255,0,255,0.7)")
    )
    return _finish(p, ids, title, desc, [t], w, h)


def bars(
    ids: Ids,
    title: str,
    desc: str,
    t: prometheus.Dataquery,
    *,
    unit: str,
    transformations: Sequence[dm.DataTransformerConfig] = (),
    w: int = 12,
    h: int = 9,
) -> bargauge.Panel:
    p = (
        bargauge.Panel()
        .unit(unit)
        .orientation(common.VizOrientation.HORIZONTAL)
        .display_mode(common.BarGaugeDisplayMode.GRADIENT)
        .show_unfilled(True)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    for tr in transformations:
        p = p.with_transformation(tr)
    return _finish(p, ids, title, desc, [t], w, h)


def bar_chart(
    ids: Ids,
    title: str,
    desc: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str,
    x_field: str,
    transformations: Sequence[dm.DataTransformerConfig] = (),
    w: int = 12,
    h: int = 9,
    repeat: str = "",
) -> barchart.Panel:
    """Bars over a categorical x field (a label turned into a table column), grouped by query;
    ``repeat``: one panel per value of that variable (bars of several series share each x)."""
    p = (
        barchart.Panel()
        .unit(unit)
        .x_field(x_field)
        .show_value(common.VisibilityMode.NEVER)
        .group_width(0.8)
        .legend(
            cb.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    for tr in transformations:
        p = p.with_transformation(tr)
    if repeat:
        p = p.repeat(repeat).repeat_direction("h").max_per_row(2)
    return _finish(p, ids, title, desc, targets, w, h)
