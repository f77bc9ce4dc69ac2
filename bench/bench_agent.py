"""What publication costs the serving loop: no telemetry vs in-process vs agent mode.

The tail loop: rounds whose verify releases the GIL for 2 ms (``time.sleep(0.002)`` standing
in for device work), instrumented through the observer (``begin_round`` / ``end_*`` /
``end_round``, a burst per 8 rounds, a session per 64 rounds). Overhead of a round = its
period (round start to next round start) minus 2 ms; the sleep's own overshoot is in every
mode, so compare against ``none``.

    python bench/bench_agent.py [--rounds 1000] [--reps 3]

Modes (each run in a fresh process, interleaved over repetitions):
  none     the no-op observer
  inproc   QueueSink + span exporter (OTLP-JSON file) + PrometheusExporter, in this process
  ring     RingSink alone, nobody reading (the writer's own cost)
  agent    RingSink in this process; ``memra-obs agent`` in another process publishing the
           same exporters (spans file, /metrics), at its default priority (SCHED_IDLE)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("none", "inproc", "ring", "agent")
DEVICE_S = 0.002


def _env(tmp: Path, mode: str, rings: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(
        MEMRA_OBS_SPANS_FILE=str(tmp / f"spans-{mode}.jsonl"),
        MEMRA_OBS_METRICS_ADDR="127.0.0.1:0",
        MEMRA_OBS_WORKER="bench",
    )
    if mode != "none":
        env["MEMRA_OBS_SINKS"] = "otel,prometheus"
    if mode in ("ring", "agent"):
        env["MEMRA_OBS_AGENT"] = str(rings / mode)
    return env


def loop(obs: Any, rounds: int, warmup: int = 50) -> list[float]:
    """Run the tail loop; returns per-round overhead in ms (period - 2 ms)."""
    clock = time.perf_counter_ns
    starts: list[int] = []
    n = 0
    total = rounds + warmup + 1
    while n < total:
        with obs.session("glm5") as s:
            for _ in range(8):
                b = s.burst(4)
                for _ in range(8):
                    starts.append(clock())
                    b.begin_round()
                    b.end_draft()
                    time.sleep(DEVICE_S)
                    b.end_verify()
                    b.end_accept()
                    b.end_rollback()
                    b.end_round(k=4, j=n % 5, ctx=1000 + n)
                    n += 1
                    if n >= total:
                        break
                b.end()
                if n >= total:
                    break
    periods = [(b - a) / 1e6 - DEVICE_S * 1e3 for a, b in itertools.pairwise(starts)]
    return periods[warmup : warmup + rounds]


def child(mode: str, rounds: int) -> dict[str, Any]:
    """One measurement in this (fresh) process; the agent mode starts its agent first."""
    from memra_obs.observer import NOOP_OBSERVER
    from memra_obs.wiring import build_observer

    agent = None
    if mode == "agent":
        agent = subprocess.Popen(
            [sys.executable, "-m", "memra_obs.cli", "agent"],
            env=os.environ.copy(),
            stderr=subprocess.PIPE,
            text=True,
        )
        assert agent.stderr is not None
        agent.stderr.readline()  # "[memra-obs agent] publishing ..."
    try:
        obs: Any = NOOP_OBSERVER if mode == "none" else build_observer(level=0, prof=False)
        assert obs.enabled == (mode != "none")
        over = loop(obs, rounds)
        obs.shutdown(10.0)
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(30)
    over.sort()
    return {
        "mode": mode,
        "mean": statistics.fmean(over),
        "p50": over[len(over) // 2],
        "p99": over[math.ceil(len(over) * 0.99) - 1],
        "max": over[-1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds)))
        return 0
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    # Rings belong in memory (tmpfs): on a disk filesystem writeback faults the loop.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp,
        tempfile.TemporaryDirectory(prefix="bench-agent-rings-", dir=shm) as rings,
    ):
        for rep in range(args.reps):
            (Path(tmp) / f"r{rep}").mkdir()  # the span files' (before: none, every span dropped)
            for mode in MODES:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", mode, "--rounds", str(args.rounds)],
                    env=_env(Path(tmp) / f"r{rep}", mode, Path(rings) / f"r{rep}"),
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if out.returncode != 0:
                    print(out.stderr, file=sys.stderr)
                    return 1
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    print(
        f"tail loop: {args.rounds} rounds x 2 ms GIL-released verify, burst/8 rounds, "
        f"session/64; median of {args.reps} runs; overhead = period - 2 ms, in ms; "
        f"cpus={os.cpu_count()}"
    )
    head = f"{'mode':<8} {'mean':>7} {'p50':>7} {'p99':>7} {'max':>7} {'Δmean':>7} {'Δp99':>7}"
    print(head)
    print("-" * len(head))
    for m in MODES:
        print(
            f"{m:<8} {med(m, 'mean'):7.3f} {med(m, 'p50'):7.3f} {med(m, 'p99'):7.3f} "
            f"{med(m, 'max'):7.3f} {med(m, 'mean') - med('none', 'mean'):+7.3f} "
            f"{med(m, 'p99') - med('none', 'p99'):+7.3f}"
        )
    print("per run (mean/p99): " + "; ".join(
        f"{m}: " + ", ".join(f"{r['mean']:.3f}/{r['p99']:.3f}" for r in results[m]) for m in MODES
    ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
