"""How many tagged lines a second ``memra-obs tail`` parses and publishes on one core.

    python bench/bench_tail.py [--sessions N] [--repeat R] [--trace-only] [--profile]

The input is a realistic worker's stderr at trace level 2 with the profile on: per burst of
6 rounds a phase line and its level-2 line, one ``[spec-prof-rounds]`` row per logged round
(the first 64 of a session), and per session one ``[spec-prof]`` and one
``[spec-prof-summary]`` line; sessions of 20-120 rounds, so later bursts have no rows (as in
production). Lines are formatted by :mod:`memra_obs.legacy` itself from random records, so
they are byte-identical to a worker's.

Everything runs on the calling thread (the tail's export worker is bypassed: on one core it
would only interleave the same work), in 64 KiB chunks as the tail reads them. Pure Python:
the one parser (:func:`memra_obs.legacy.parse_line`), no C. Stages, each timed over the
whole input:

``parse``       ``legacy.parse_line`` on every line (the parser alone)
``rebuild``     ``Tail.feed``: split, parse, rebuild records; records discarded
``+prom``       the same, exported to a ``PrometheusExporter`` (the /metrics state), as
                ``memra-obs tail`` wires it with ``MEMRA_OBS_SINKS=prometheus``
``prom alone``  that exporter fed the same batches, prebuilt: its share of ``+prom``
``+prom+spans`` the records to the PrometheusExporter and the span exporter writing
                OTLP-JSON to a file (the tail's default sinks)

The goal is 100,000 tagged lines/s for ``+prom`` on one core (metrics are the tail's main
product; a live worker prints a few hundred lines a second, so one tail core keeps up with
hundreds of busy workers); ``+prom+spans`` is quoted for what a span per round and phase
costs on top. ``--trace-only`` drops the profile's lines (a worker with only
``MEMRA_SPEC_TRACE=2``: 2.9 rounds per line). Figures: the README's tail section.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from memra_obs.legacy import (
    parse_line,
    phase_lines,
    prof_line,
    prof_rounds_lines,
    prof_summary_line,
)
from memra_obs.records import (
    SPEC_PROF_ROUNDS,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
)
from memra_obs.tail import Rebuilder, Tail

GOAL = 100_000
BURST = 6


def worker_stderr(sessions: int, seed: int = 7, prof: bool = True) -> list[str]:
    """The legacy lines of ``sessions`` sessions, in a worker's print order (``prof``:
    the profile's lines too, else only the level-2 trace's two lines per burst)."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(sessions):
        n_rounds = rng.randint(20, 120)
        log = SpecRoundsLog()
        done = 0
        first = True
        while done < n_rounds:
            n = min(BURST, n_rounds - done)
            p = SpecPhaseNs()
            rows = []
            for _ in range(n):
                d, v, a, r, m = (rng.randint(200_000, 1_200_000), rng.randint(2_000_000, 7_000_000),
                                 rng.randint(200_000, 400_000), rng.randint(100_000, 200_000),
                                 rng.randint(100_000, 200_000))  # fmt: skip
                p.add(SpecPhaseNs(d, v, a, r, m, 1))
                k = 4
                j = rng.randint(0, 4)
                rows.append(SpecRoundProf(wall_ms=(d + v + a + r + m) / 1e6, draft_ms=d / 1e6, verify_ms=v / 1e6,
                                          accept_ms=a / 1e6, rest_ms=(r + m) / 1e6, k=k, j=j,
                                          ctx=2000 + done, seq_rows=0))  # fmt: skip
            split = VerifySplit(
                kda=p.verify // 3, kda_scan=p.verify // 8, mla=p.verify // 5, ffn=p.verify // 4
            )
            out.extend(phase_lines(p, "glm5-phase", "glm5-phase-v", 4, 2, split))
            done += n
            if not prof:
                continue
            if first:
                ft = SpecFirstTokenProf(
                    cache_alloc_ms=0.4, prime_ms=35.9, capture_ms=0.2, anchor_ms=0.2, draft_alloc_ms=0.19,
                    draft_prime_ms=4.27, first_draft_ms=1.0, first_verify_ms=2.9, first_accept_ms=0.34,
                    first_roll_ms=0.14, first_maint_ms=0.18, first_round_tokens=rows[0].j + 1,
                    first_burst_ms=rows[0].wall_ms + 30.0, first_burst_hook_ms=0.7, first_burst_rounds=n,
                    first_burst_tokens=sum(r.j + 1 for r in rows) + 1, draft_prime_rows=2591,
                    draft_prime_chunks=11, draft_prime_arm="eager", draft_kv_mb=181.938,
                    free_mb_before=[(0, 79511)], free_mb_after=[(0, 79285)],
                )  # fmt: skip
                out.append(prof_line(ft))
                first = False
            for row in rows:
                log.push(row)
            fresh = log.fresh()
            out.extend(prof_rounds_lines(fresh, log.printed - len(fresh)))
            if not log.wants_more() and not log.summarized:
                log.summarized = True
                out.append(prof_summary_line(log))
        if prof and not log.summarized:
            out.append(prof_summary_line(log))
    return out


def chunks(data: bytes, size: int = 1 << 16) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def run_tail(
    blob_chunks: list[bytes], publish: Callable[[list[Any]], None], rebuilder: Rebuilder
) -> Tail:
    tail = Tail(rebuilder, publish, out=None)
    t = time.perf_counter_ns()
    for c in blob_chunks:
        tail.feed(c, t)
        t += 1_000_000
    tail.close(t)
    return tail


def stage(name: str, n_lines: int, fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    rate = n_lines / best
    print(
        f"{name:14s} {rate:>12,.0f} tagged lines/s   ({best * 1e3:8.1f} ms for {n_lines:,} lines)"
    )
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the +prom stage")
    ap.add_argument("--trace-only", action="store_true",
                    help="a worker without MEMRA_SPEC_PROF: phase + level-2 lines only")  # fmt: skip
    ap.add_argument("--only", metavar="STAGE", help="run that stage once, quietly (`none`: only "
                    "build the input), for instruction counts: valgrind --tool=callgrind python "
                    "bench/bench_tail.py --only rebuild, minus the same with --only none")  # fmt: skip
    a = ap.parse_args(argv)
    if a.only is not None:
        names = ("none", "parse", "rebuild", "+prom", "prom alone", "+prom+spans")
        if a.only not in names:
            ap.error(f"--only: one of {', '.join(names)}")
        return _only(a)

    lines, blob, parts, n = _input(a)
    kinds: dict[str, int] = {}
    for line in lines:
        tag = line[1 : line.index("]")]
        kinds[tag] = kinds.get(tag, 0) + 1
    rounds = sum(int(line.split()[1][7:]) for line in lines if line.startswith("[glm5-phase] "))
    print(f"python {sys.version.split()[0]} ({sys.executable}), input: {n:,} tagged lines, {rounds:,} rounds, "
          f"{len(blob) / 1e6:.1f} MB; mix: " + ", ".join(f"{k} {v / n:.0%}" for k, v in kinds.items()))  # fmt: skip
    if not a.trace_only:
        print(f"rows cover the first {SPEC_PROF_ROUNDS} rounds of each session")

    fns = _stages(lines, parts)
    stage("parse", n, fns["parse"], a.repeat)
    stage("rebuild", n, fns["rebuild"], a.repeat)
    rate = stage("+prom", n, fns["+prom"], a.repeat)
    floor = stage("prom alone", n, fns["prom alone"], a.repeat)
    stage("+prom+spans", n, fns["+prom+spans"], max(1, a.repeat - 1))
    # A parser that refused the lines would be fast and publish nothing: count what arrived.
    published = fns["+prom"]().registry.get_sample_value(  # type: ignore[attr-defined]
        "memra_spec_rounds_total", {"family": "glm5", "worker": "bench"}
    )
    if published != rounds:
        print(f"+prom published {published} of the input's {rounds:,} rounds: not a measure")
        return 1
    print(f"+prom published every one of the input's {rounds:,} rounds to /metrics")
    verdict = "meets" if rate >= GOAL else "misses"
    print(f"+prom {verdict} the goal of {GOAL:,} tagged lines/s ({rate / GOAL:.2f}x); "
          f"the PrometheusExporter's share: {1e6 / floor:.2f} us/line "
          f"({1e6 * n / floor / rounds:.2f} us/round)")  # fmt: skip

    if a.profile:
        prom = new_prom()
        cProfile.runctx("run_tail(parts, prom.export, rb)", globals(), {"parts": parts,
                        "prom": prom, "run_tail": run_tail, "rb": Rebuilder("bench")},
                        "/tmp/bench_tail.prof")  # fmt: skip
        pstats.Stats("/tmp/bench_tail.prof").sort_stats("tottime").print_stats(18)
    return 0


def _input(a: argparse.Namespace) -> tuple[list[str], bytes, list[bytes], int]:
    lines = worker_stderr(a.sessions, prof=not a.trace_only)
    blob = ("\n".join(lines) + "\n").encode()
    return lines, blob, chunks(blob), len(lines)


def _only(a: argparse.Namespace) -> int:
    """One stage, once: deterministic enough for callgrind (seeded input and rebuilder)."""
    lines, _, parts, _ = _input(a)
    fns = _stages(
        lines, parts, lambda: Rebuilder("bench", rng=random.Random(0)), a.only == "prom alone"
    )
    if "prom" in a.only:
        new_prom()  # its imports and families outside the count
    fns.get(a.only, lambda: None)()
    return 0


def new_prom(traced: bool = False) -> Any:
    """The exporter as the tail's wiring builds it (``traced``: a span exporter runs too)."""
    from memra_obs.prom import PrometheusExporter

    reg = CollectorRegistry()
    return PrometheusExporter(registry=reg, worker="bench", worker_label=True, traced=traced)


def _stages(
    lines: list[str],
    parts: list[bytes],
    rebuilder: Callable[[], Rebuilder] = lambda: Rebuilder("bench"),
    prebuild: bool = True,
) -> dict[str, Callable[[], object]]:
    """Each stage as a call over the whole input (``prebuild``: the batches of ``prom alone``)."""

    def parse_all() -> None:
        for line in lines:
            parse_line(line)

    def with_prom() -> Any:
        prom = new_prom()
        run_tail(parts, prom.export, rebuilder())
        return prom

    # The exporter alone, on the batches rebuilt beforehand: its share of +prom.
    batches: list[list[Any]] = []
    if prebuild:
        run_tail(parts, batches.append, rebuilder())

    def prom_only() -> None:
        prom = new_prom()
        for b in batches:
            prom.export(b)

    def with_spans() -> None:
        from memra_obs.environment import Settings
        from memra_obs.otel import build_span_exporter

        with tempfile.TemporaryDirectory() as d:
            st = Settings.resolve({}, spans_file=os.path.join(d, "spans.jsonl"))
            sx = build_span_exporter(st, env={})
            assert sx is not None
            prom = new_prom(traced=True)

            def both(batch: list[Any]) -> None:
                prom.export(batch)
                sx.export(batch)
                # Wait for the file writer: its request queue would otherwise fill up and
                # drop spans (their writing then missing from the figure).
                sx.flush(30.0)

            run_tail(parts, both, rebuilder())
            sx.shutdown(30.0)
            assert not sx.dropped_spans, sx.dropped_spans

    return {
        "parse": parse_all,
        "rebuild": lambda: run_tail(parts, lambda b: None, rebuilder()),
        "+prom": with_prom,
        "prom alone": prom_only,
        "+prom+spans": with_spans,
    }


if __name__ == "__main__":
    sys.exit(main())
