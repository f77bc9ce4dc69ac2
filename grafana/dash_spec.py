"""The "memra · speculative decoding" dashboard: one worker or a fleet of them.

Metric names are the public interface of docs/DESIGN §5; the live test
(tests/test_stack_live.py) runs every expression below against a Prometheus that scraped
`memra-obs demo`, so a renamed metric or label fails there, not in front of a user.
"""

from __future__ import annotations

from dash_common import (
    DS,
    HOST,
    RI,
    SPARSE,
    SPEC,
    Ids,
    bar_chart,
    bars,
    heatmap_panel,
    mean,
    quantile,
    rate,
    ratio,
    stat_panel,
    sum_rate,
    target,
    ts,
)
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm

UID = "memra-spec"

# The first-token profile (SpecFirstTokenProf) in session order; a share sits under the phase
# that contains it (prime_tap_dtoh is part of prime; draft_prime and the round-1 phases run
# inside first_burst; the hook is first_burst's host-side share), so only top-level bars add up.
FIRST_TOKEN_WATERFALL: tuple[tuple[str, str], ...] = (
    ("cache_alloc", "cache alloc"),
    ("sink_alloc", "tap sink alloc"),
    ("prime", "target prime"),
    ("prime_tap_dtoh", "  prime › tap DtoH"),
    ("capture", "prefix capture"),
    ("anchor", "boundary token"),
    ("draft_alloc", "draft state build"),
    ("first_burst", "first burst"),
    ("draft_prime", "  burst › drafter prime"),
    ("draft_prime_h2d", "    prime › h2d"),
    ("draft_prime_feat", "    prime › features"),
    ("draft_prime_kv", "    prime › k/v ingest"),
    ("first_draft", "  burst › round-1 draft"),
    ("first_verify", "  burst › round-1 verify"),
    ("first_accept", "  burst › round-1 accept"),
    ("first_roll", "  burst › round-1 rollback"),
    ("first_maint", "  burst › round-1 maint"),
    ("first_burst_hook", "  burst › commit hook"),
    ("unattributed", "unattributed (snapshots, set-up)"),
)

_ALL = dm.VariableOption(text="All", value="$__all", selected=True)


def _query_var(name: str, label: str, query: str) -> db.QueryVariable:
    # ".*" rather than Grafana's default of listing every value: a fleet has many instances
    # and a long regex alternation makes every panel query slow.
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query(query)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(_ALL)
    )


def variables() -> list:
    return [
        db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
        _query_var("job", "job", "label_values(memra_spec_rounds_total, job)"),
        _query_var(
            "instance", "instance", 'label_values(memra_spec_rounds_total{job=~"$job"}, instance)'
        ),
        _query_var(
            "family",
            "family",
            'label_values(memra_spec_rounds_total{job=~"$job", instance=~"$instance"}, family)',
        ),
    ]


Section = tuple[str, list]


def overview(ids: Ids) -> Section:
    acc, dr, rd = (
        "memra_spec_accepted_tokens_total",
        "memra_spec_drafted_tokens_total",
        "memra_spec_rounds_total",
    )
    return "Overview", [
        stat_panel(
            ids,
            "Rounds / s",
            "Verify rounds per second, all selected workers.",
            target(sum_rate(rd)),
            unit="ops",
        ),
        stat_panel(
            ids,
            "Tokens / s",
            "Committed tokens per second: accepted drafts plus the one bonus "
            "token every round commits (mean j of the rounds whose counts are known, "
            "times every round: a tailed log has rounds without).",
            target(f"(1 + {mean('memra_spec_accepted_tokens_per_round')}) * {sum_rate(rd)}"),
            unit="ops",
        ),
        stat_panel(
            ids,
            "Acceptance",
            "Accepted / drafted tokens.",
            target(ratio(sum_rate(acc), sum_rate(dr))),
            unit="percentunit",
        ),
        stat_panel(
            ids,
            "Round p99",
            "99th percentile of the per-round wall.",
            target(quantile(0.99, "memra_spec_round_seconds")),
            unit="s",
            decimals=4,
        ),
        stat_panel(
            ids,
            "First token p50",
            f"Median first-token latency over the last {SPARSE} (one observation per request).",
            target(quantile(0.5, "memra_spec_first_token_seconds", sel=HOST, window=SPARSE)),
            unit="s",
            decimals=3,
        ),
        stat_panel(
            ids,
            "Slow-round share",
            "Share of rounds slower than 1.5x the median of their session's last 64.",
            target(ratio(sum_rate("memra_spec_slow_rounds_total"), sum_rate(rd))),
            unit="percentunit",
        ),
    ]


def round_latency(ids: Ids) -> Section:
    b = "memra_spec_round_seconds"
    return "Round wall", [
        heatmap_panel(
            ids,
            "Per-round wall distribution",
            "Rounds per second in each bucket of memra_spec_round_seconds (a rate: an increase over "
            "the rate interval would count a round in every cell its window overlaps). "
            "Exemplars (dots) carry the round's trace_id: click one to open the trace in Jaeger.",
            target(
                f"sum by (le) (rate({b}_bucket{{{SPEC}}}[{RI}]))",
                "{{le}}",
                exemplar=True,
                fmt="heatmap",
            ),
        ),
        ts(
            ids,
            "Round wall p50 / p90 / p99",
            "Quantiles of the per-round wall from the histogram buckets (bucket-interpolated). Exemplars "
            "are on the p99 query only: the same exemplars serve all three lines, so they are drawn once.",
            [
                target(quantile(0.5, b), "p50"),
                target(quantile(0.9, b), "p90"),
                target(quantile(0.99, b), "p99", exemplar=True),
            ],
            h=9,
        ),
        ts(
            ids,
            "Round wall p99 by worker",
            "One line per instance and worker (agent mode adds the worker label): spots the one slow rank.",
            [
                target(
                    quantile(0.99, b, ("instance", "worker")),
                    "{{instance}} {{worker}}",
                    exemplar=True,
                )
            ],
            w=24,
            h=7,
        ),
    ]


def phases(ids: Ids) -> Section:
    h, v = "memra_spec_phase_seconds", "memra_spec_verify_split_seconds"
    return "Phases", [
        ts(
            ids,
            "Phase share of round wall",
            "Where the round's time goes: draft / verify / accept / rollback / maint, stacked to 100%.",
            [
                target(
                    ratio(
                        sum_rate(f"{h}_sum", ("phase",)),
                        sum_rate(f"{h}_sum"),
                        "ignoring(phase) group_left",
                    ),
                    "{{phase}}",
                )
            ],
            unit="percentunit",
            stacking=common.StackingMode.PERCENT,
            fill=60,
        ),
        ts(
            ids,
            "Mean phase time per round",
            "Mean seconds per round in each phase, stacked: the top of the stack is the mean round wall.",
            [target(mean(h, ("phase",)), "{{phase}}")],
            stacking=common.StackingMode.NORMAL,
            fill=40,
        ),
        ts(
            ids,
            "Phase p99",
            "99th percentile per phase.",
            [target(quantile(0.99, h, ("phase",)), "{{phase}}", exemplar=True)],
        ),
        ts(
            ids,
            "Verify sub-split (level 2)",
            "Mean seconds per round of the verify parts (MEMRA_SPEC_TRACE=2). Nested, not additive: "
            "kda_scan is part of kda and ffn part of rest; kda + mla + rest = verify (the verify "
            "of the workers and families that split it: a level-1 one's rounds are not here).",
            [
                target(mean(v, ("part",)), "{{part}}"),
                target(ratio(split_verify(h, "_sum"), split_verify(h, "_count")), "verify (total)"),
            ],
        ),
    ]


def split_verify(h: str, part: str) -> str:
    """The verify phase's rate over the series whose verify is split (level 2): a worker or
    family at level 1 among those selected would put rounds in the total and not the parts."""
    verify = rate(h + part, SPEC + ', phase="verify"')
    split = rate("memra_spec_verify_split_seconds_count", SPEC + ', part="rest"')
    return f"sum({verify} and ignoring(phase, part) {split} > 0)"


def per_round_mean(hist: str, by: tuple[str, ...]) -> str:
    """Mean of a per-round histogram over the panel's rate window: rate(_sum) / rate(_count)."""
    return mean(hist, by)


def acceptance(ids: Ids) -> Section:
    acc, dr = "memra_spec_accepted_tokens_total", "memra_spec_drafted_tokens_total"
    by = ("family",)
    return "Acceptance", [
        ts(
            ids,
            "Acceptance rate",
            "Accepted / drafted tokens per family. A collapse here is the MemraSpecAcceptanceCollapse alert.",
            [target(ratio(sum_rate(acc, by), sum_rate(dr, by)), "{{family}}")],
            unit="percentunit",
            min_val=0,
            max_val=1,
        ),
        ts(
            ids,
            "Drafted, accepted and committed tokens per round",
            "Mean k (drafted), mean j (the accepted length) and j+1 (tokens a round commits: the "
            "accepted drafts plus the bonus token).",
            # Means of the per-round histograms: their _count holds only rounds whose k and
            # j are known (a tailed stream carries rounds without them).
            [
                target(
                    per_round_mean("memra_spec_drafted_tokens_per_round", by),
                    "drafted k {{family}}",
                ),
                target(
                    per_round_mean("memra_spec_accepted_tokens_per_round", by),
                    "accepted j {{family}}",
                ),
                target(
                    f"1 + {per_round_mean('memra_spec_accepted_tokens_per_round', by)}",
                    "tokens/round {{family}}",
                ),
            ],
            unit="short",
        ),
        bars(
            ids,
            "Accepted length distribution",
            "Rounds by accepted tokens j over the dashboard range.",
            target(
                f"sum by (le) (increase(memra_spec_accepted_tokens_per_round_bucket{{{SPEC}}}[$__range]))",
                "{{le}}",
                instant=True,
                fmt="heatmap",
            ),
            unit="short",
            w=24,
            h=7,
        ),
    ]


# The k advisor's gauges (sliding window of recent rounds, memra_obs.analysis.AdviceWindow).
# Every one of them is an estimate from the loop's own acceptance and phase costs; the titles
# say so. README, "Acceptance analytics and the k advisor", has the formulas.
EST_TPS = "memra_spec_estimated_tokens_per_second"  # {family, k}: throughput(k) for k = 1..bound
REC_K = "memra_spec_recommended_k"
SPEEDUP = "memra_spec_estimated_speedup"
EXP_TOK = "memra_spec_expected_tokens_per_round"
#: The advisor row's panels take ids from here, so the rows after it keep theirs.
ADVISOR_IDS = 100


def _throughput_vs_k(ids: Ids):
    est = f"avg by (family, k) ({EST_TPS}{{{SPEC}}})"
    # count_values turns each recommended k into a `k` label: the bar of every k a worker
    # advises (agent mode: workers may disagree, and max marked one the others did not advise).
    rec = f'count_values by (family) ("k", {REC_K}{{{SPEC}}})'
    # Two instant tables (every k; the advised k) merged on (family, k), k made a number so
    # the bars sort 1, 2, ..., 16 rather than as strings.
    transformations = [
        dm.DataTransformerConfig(id_val="merge", options={}),
        dm.DataTransformerConfig(
            id_val="convertFieldType",
            options={"conversions": [{"targetField": "k", "destinationType": "number"}]},
        ),
        dm.DataTransformerConfig(id_val="sortBy", options={"sort": [{"field": "k"}]}),
        dm.DataTransformerConfig(
            id_val="organize",
            options={
                "excludeByName": {"Time": True},
                "renameByName": {
                    "Value #A": "estimated tokens/s (estimate)",
                    "Value #B": "at the recommended k",
                },
            },
        ),
    ]
    return bar_chart(
        ids,
        "Throughput vs k (estimate)",
        "The advisor's estimated tokens/s at each draft length k, E(k) / t_round(k), from the "
        "acceptance curve and the phase costs of the window's recent rounds (an estimate, not "
        "a measurement). It is one loop's rate (one request stream, its rounds back to back), "
        "not the worker's: the Tokens / s stat adds every busy loop and worker, so it reads "
        "about that many times higher; compare bars with each other, not with it. The second "
        "bar marks the recommended k (every k some worker "
        "recommends, when workers disagree: the bars average the workers' curves, each worker "
        "advises from its own). One panel per family ($family repeats it): the bars of "
        "several families would share each k.",
        [
            target(est, "{{family}}", instant=True, fmt="table"),
            target(
                f"{est} and on (family, k) {rec}",
                "{{family}} recommended",
                instant=True,
                fmt="table",
            ),
        ],
        unit="ops",
        x_field="k",
        transformations=transformations,
        repeat="family",
    )


def advisor(ids: Ids) -> Section:
    acc = "memra_spec_accepted_tokens_by_position_total"
    dr = "memra_spec_drafted_tokens_by_position_total"
    by = ("family", "position")
    return "Acceptance & k advisor", [
        ts(
            ids,
            "Acceptance by position",
            "Accepted / drafted tokens at each draft position (0-based, as vLLM's "
            "num_accepted_tokens_per_pos): the share of drafts made at that position that were "
            "accepted, every draft before them accepted too. With k constant, its ratio to the "
            "previous position is the conditional acceptance the k advisor works from; when k "
            "varies it is not (README: Acceptance by position, right when k varies).",
            [target(ratio(sum_rate(acc, by), sum_rate(dr, by)), "{{family}} pos {{position}}")],
            unit="percentunit",
            min_val=0,
            max_val=1,
            h=9,
        ),
        _throughput_vs_k(ids),
        ts(
            ids,
            "Recommended k (estimate) and current k",
            "The draft length that maximises the estimated tokens/s over the window of recent "
            "rounds, per worker, as its median over 10 minutes, beside the mean k the loop "
            "actually drafted. Near the best k the curve is flat (neighbours within a percent "
            "or two), so the instant advice flips between them on a steady load; the median "
            "holds what the window keeps choosing.",
            [
                target(
                    f"max by (family, instance, worker) "
                    f"(quantile_over_time(0.5, {REC_K}{{{SPEC}}}[10m]))",
                    "{{family}} recommended (estimate, 10m median) {{instance}} {{worker}}",
                ),
                target(
                    per_round_mean("memra_spec_drafted_tokens_per_round", ("family",)),
                    "{{family}} current mean k",
                ),
            ],
            unit="short",
            w=8,
        ),
        ts(
            ids,
            "Expected tokens per round at the recommended k (estimate)",
            "E(k) = 1 + Σ S(i) at the recommended k (an estimate), beside the tokens a round "
            "actually commits now (1 + mean accepted j, at the current k).",
            [
                target(f"avg by (family) ({EXP_TOK}{{{SPEC}}})", "{{family}} E(k*) estimate"),
                target(
                    f"1 + {per_round_mean('memra_spec_accepted_tokens_per_round', ('family',))}",
                    "{{family}} measured now",
                ),
            ],
            unit="short",
            w=8,
        ),
        ts(
            ids,
            "Estimated speedup over plain decoding (estimate)",
            "Estimated tokens/s at the recommended k over a plain one-token-per-step loop's "
            "(its step is the verify fit at one row unless the loop measured one). Below 1, "
            "speculation costs more than it buys.",
            [target(f"avg by (family) ({SPEEDUP}{{{SPEC}}})", "{{family}} speedup (estimate)")],
            unit="suffix:×",
            w=8,
        ),
    ]


def slow_rounds(ids: Ids) -> Section:
    slow, rd = "memra_spec_slow_rounds_total", "memra_spec_rounds_total"
    tail = "memra_obs_tail_rounds_total"  # source: row (measured) or burst_mean
    return "Slow rounds", [
        ts(
            ids,
            "Slow-round share",
            "Slow rounds / all rounds per family; a round is slow when its wall exceeds 1.5x the median "
            "of its session's last 64 rounds. A rise here is the "
            "MemraSpecSlowRoundShareRising alert. A worker read by memra-obs tail: rounds past a "
            "session's 64 logged rows carry their burst's mean wall and are never slow, so its "
            "share reads low; 'rounds measured one by one (tail)' is the share with a row.",
            [
                target(ratio(sum_rate(slow, ("family",)), sum_rate(rd, ("family",))), "{{family}}"),
                target(
                    ratio(
                        sum_rate(tail, ("instance", "worker"), HOST + ', source="row"'),
                        sum_rate(tail, ("instance", "worker"), HOST),
                    ),
                    "rounds measured one by one (tail) {{instance}} {{worker}}",
                ),
            ],
            unit="percentunit",
            min_val=0,
        ),
        ts(
            ids,
            "Slow rounds / s by worker",
            "Which worker the slow rounds come from.",
            [target(sum_rate(slow, ("instance", "worker")), "{{instance}} {{worker}}")],
            unit="ops",
        ),
        ts(
            ids,
            "Per-row verify rows per round",
            "Mean verify rows per round that took the per-row (sequential) mixer arm instead of the "
            "batched one (seq_rows): the usual cause of a slow round at depth.",
            [
                target(
                    ratio(
                        sum_rate("memra_spec_verify_seq_rows_total", ("family",)),
                        sum_rate("memra_spec_drafted_tokens_per_round_count", ("family",)),
                    ),
                    "{{family}}",
                )
            ],
            unit="short",
            w=24,
            h=7,
        ),
    ]


def _waterfall_transforms() -> list[dm.DataTransformerConfig]:
    order = {name: i + 1 for i, (name, _) in enumerate(FIRST_TOKEN_WATERFALL)}
    return [
        # One frame per phase -> one frame with a field per phase; then put the fields in session
        # order (PromQL returns them sorted by label) and give them readable names.
        dm.DataTransformerConfig(
            id_val="joinByField", options={"byField": "Time", "mode": "outer"}
        ),
        dm.DataTransformerConfig(
            id_val="organize",
            options={
                "excludeByName": {"Time": True},
                "indexByName": {"Time": 0, **order},
                "renameByName": dict(FIRST_TOKEN_WATERFALL),
            },
        ),
    ]


def first_token(ids: Ids) -> Section:
    f, p = "memra_spec_first_token_seconds", "memra_spec_first_token_phase_seconds"
    return "First token", [
        ts(
            ids,
            "First-token latency",
            f"Quantiles over {SPARSE} windows (one observation per request).",
            [
                target(quantile(0.5, f, sel=HOST, window=SPARSE), "p50"),
                target(quantile(0.99, f, sel=HOST, window=SPARSE), "p99", exemplar=True),
            ],
            w=10,
            h=9,
        ),
        bars(
            ids,
            "First-token waterfall (mean per request)",
            "Mean seconds per request in each phase of the first-token profile over the dashboard "
            "range, in session order (a phase a request's route did not run counts 0 for it). "
            "Indented bars are shares of the bar above them; only unindented bars add up to the "
            "first-token wall.",
            # Over every request (the first-token count), not a phase's own _count: that counts
            # only the requests that ran it, and the bars would no longer add up (README).
            target(
                ratio(
                    f"sum by (phase) (increase({p}_sum{{{HOST}}}[$__range]))",
                    f"sum(increase({f}_count{{{HOST}}}[$__range]))",
                    "ignoring(phase) group_left",
                ),
                "{{phase}}",
                instant=True,
            ),
            unit="s",
            transformations=_waterfall_transforms(),
            w=14,
            h=9,
        ),
    ]


def device_and_exporter(ids: Ids) -> Section:
    return "Device memory and exporter health", [
        ts(
            ids,
            "Free GPU memory before / after session setup",
            "NVML free bytes per device before the trunk cache allocation and after the drafter KV "
            "allocation; a per-boot bimodality shows up here first.",
            [
                target(
                    f"max by (instance, worker, device, point) (memra_gpu_free_bytes{{{HOST}}})",
                    "{{instance}} {{worker}} gpu{{device}} {{point}}",
                )
            ],
            unit="bytes",
        ),
        ts(
            ids,
            "Exporter drops and errors",
            "Records dropped by a full queue or ring, and failed exports, per signal. Above zero for "
            "minutes is the MemraObsExporterDropping / MemraObsExportErrors alert.",
            [
                target(
                    sum_rate("memra_obs_dropped_total", ("instance", "signal"), sel=HOST),
                    "dropped {{signal}} {{instance}}",
                ),
                target(
                    sum_rate("memra_obs_export_errors_total", ("instance", "signal"), sel=HOST),
                    "export errors {{signal}} {{instance}}",
                ),
            ],
            unit="ops",
            min_val=0,
        ),
    ]


def build() -> db.Dashboard:
    ids = Ids()
    d = (
        db.Dashboard("memra · speculative decoding")
        .uid(UID)
        .description(
            "Per-round wall, phase attribution, acceptance and first-token profile of "
            "memra_obs-instrumented speculative-decoding workers."
        )
        .tags(["memra", "spec-decode"])
        .editable()
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .variables(variables())
    )
    # Expanded rows with their panels at the top level, after the row: Grafana only reads a
    # row's own `panels` list when the row is collapsed.
    advisor_ids = Ids()
    advisor_ids.n = ADVISOR_IDS
    for section in (
        overview,
        round_latency,
        phases,
        acceptance,
        advisor,
        slow_rounds,
        first_token,
        device_and_exporter,
    ):
        own = advisor_ids if section is advisor else ids
        title, panels = section(own)
        d = d.with_row(db.Row(title).id(own.next()))
        for panel in panels:
            d = d.with_panel(panel)
    return d
