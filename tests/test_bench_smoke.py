"""bench/bench_observer.py and bench/bench_prom.py still run (tiny inputs; figures not judged)
and time what their goals state."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_observer
import bench_prom


def test_bench_observer_flushes_each_tail_run_before_the_next(monkeypatch, capsys):
    """A config's export backlog left running landed in the next config's first rounds."""
    events: list[str] = []
    real_tail, real_obs_flush, real_naive_flush = (
        bench_observer.tail,
        bench_observer.Observer.flush,
        bench_observer.Naive.flush,
    )

    def tail(run, n):
        events.append("tail")
        return real_tail(run, n)

    def obs_flush(self, *a, **k):
        events.append("flush")
        return real_obs_flush(self, *a, **k)

    def naive_flush(self):
        events.append("flush")
        return real_naive_flush(self)

    monkeypatch.setattr(bench_observer, "tail", tail)
    monkeypatch.setattr(bench_observer.Observer, "flush", obs_flush)
    monkeypatch.setattr(bench_observer.Naive, "flush", naive_flush)
    bench_observer.main(["--rounds", "64", "--tail-rounds", "20", "--repeats", "1"])
    out = capsys.readouterr().out
    # the sign is the machine's: 20 rounds under CI load once read -3.5 ms (b) against no telemetry
    assert re.search(r"\(b\) all sinks on .* p99 [+-]\d+\.\d{3} vs none", out), out
    at = [i for i, e in enumerate(events) if e == "tail"]
    assert len(at) == 5, events  # no telemetry, (c), (b), (b+prof), (d)
    for start, end in zip(at[1:], [*at[2:], len(events)], strict=True):
        assert "flush" in events[start:end], events  # each telemetry run settles before the next


def test_bench_prom_times_the_scrape_of_a_live_set(capsys):
    """The GET it quoted hit every child's memoised text: a live loop's scrape changes them."""
    bench_prom.main(["--rounds", "64", "--scrapes", "1"])
    out = capsys.readouterr().out
    assert "(991 samples;" in out, out  # a new metric changes it (README, prom/model.py quote it)
    for row in ("GET /metrics, all changed", "GET /metrics gzip, all changed"):
        assert f"\n  {row} " in out, row
