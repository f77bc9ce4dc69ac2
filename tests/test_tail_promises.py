"""The tail's promises: it publishes every round it reads (backpressure, not drops), a burst
line costs a few records whatever its rounds, and values no clock produces are reported by
line number instead of being published or passed off as another program's line."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request

from memra_obs.legacy import phase_lines, prof_line
from memra_obs.records import SpecFirstTokenProf, SpecPhaseNs
from memra_obs.tail import Rebuilder, Tail
from memra_obs.timeline import RoundRecord

PHASE = (
    "[glm5-phase] rounds=6 k=4 total=29.37ms | draft=9.49 verify=16.33 accept=1.77 roll=0.83 "
    "maint=0.95 | per-round ms: draft=1.581 verify=2.722 accept=0.295 roll=0.138 maint=0.158 "
    "total=4.895"
)


def seed_log(lines: int, seed: int = 5) -> tuple[list[str], int]:
    """A Rust worker's stderr at trace level 1: phase lines of bursts up to 2,880 rounds."""
    rng = random.Random(seed)
    out, rounds = [], 0
    for _ in range(lines):
        n = rng.choice([1, 6, 60, 480, 2880])
        p = SpecPhaseNs(*(rng.randint(n * 10**5, n * 9 * 10**6) for _ in range(5)), rounds=n)
        out += phase_lines(p, "glm5-phase", "glm5-phase-v", 4)
        rounds += n
    return out, rounds


def test_a_burst_line_costs_a_few_records_not_one_per_round():
    """2,880 rounds known only by their means: at most six records (runs of equal rounds)."""
    p = SpecPhaseNs(10**9 + 7, 3 * 10**9 + 1, 10**8 + 3, 5 * 10**7, 7 * 10**7 + 9, rounds=2880)
    out: list = []
    tail = Tail(Rebuilder("w"), out.extend, out=None)
    tail.feed(("\n".join(phase_lines(p, "glm5-phase", "glm5-phase-v", 4)) + "\n").encode(), 1)
    tail.close(2)
    rounds = [r for r in out if type(r) is RoundRecord]
    assert len(rounds) <= 6 and sum(r.repeat for r in rounds) == 2880


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_a_piped_log_publishes_every_round_and_the_end_line_agrees():
    """664 seed-format lines (~300k rounds, bursts up to 2,880): ``memra-obs tail -`` serves
    every round on /metrics, and its end line says the same and 0 dropped."""
    lines, rounds = seed_log(664)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_OBS_", "OTEL_"))}
    env.update(MEMRA_OBS_SINKS="prometheus", MEMRA_OBS_METRICS_ADDR="127.0.0.1:0",
               MEMRA_OBS_QUEUE_SIZE="16")  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "memra_obs.cli", "tail", "-", "--worker", "w0"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    err = bytearray()

    def pump() -> None:
        for chunk in iter(lambda: p.stderr.read1(65536), b""):  # type: ignore[union-attr]
            err.extend(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        p.stdin.write(("\n".join(lines) + "\n").encode())  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while b"/metrics on " not in err and time.monotonic() < deadline:
            time.sleep(0.05)
        url = re.search(rb"/metrics on (\S+)", bytes(err)).group(1).decode()  # type: ignore[union-attr]
        pat = re.compile(r'^memra_spec_rounds_total\{family="glm5",worker="w0"\} (\S+)$', re.M)
        seen = 0.0
        while time.monotonic() < deadline:
            m = pat.search(_scrape(url))
            seen = float(m.group(1)) if m else 0.0
            if seen >= rounds:
                break
            time.sleep(0.1)
        assert seen == rounds
        dropped = re.search(r'memra_obs_dropped_total\{signal="records"\} (\S+)', _scrape(url))
        assert dropped is not None and float(dropped.group(1)) == 0
    finally:
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(60)
        reader.join(10)
    assert f"{rounds} rounds (0 from rows), 0 records dropped" in err.decode()


def _tail_notes(lines: list[str], **kw) -> tuple[list[str], list, Tail]:
    notes: list[str] = []
    out: list = []
    tail = Tail(Rebuilder("w"), out.extend, out=None, notes=notes.append, **kw)
    tail.feed(("\n".join(lines) + "\n").encode(), 1)
    tail.close(2)
    return notes, out, tail


def test_values_no_clock_produces_are_reported_by_line():
    """Negative and infinite durations, a profile naming 20,000 devices, a damaged tag of the
    project's own: each reported with its line number, none published."""
    prof = SpecFirstTokenProf(first_burst_rounds=6, free_mb_before=[(i, 1) for i in range(20_000)])
    lines = [
        "worker starting",
        PHASE.replace("draft=9.49", "draft=-9.49"),
        PHASE.replace("accept=1.77", "accept=1" + "0" * 400 + ".00"),
        prof_line(prof),
        "[spec-prof-roundsX] row=0 wall_ms=5.0 draft_ms=1.0 verify_ms=3.0 accept_ms=0.5 "
        "rest_ms=0.5 k=4 j=2 ctx=9 seq_rows=0",
    ]
    notes, out, tail = _tail_notes(lines, max_devices=64)
    assert [n.split(":")[1] for n in notes] == ["2", "3", "4", "5"], notes
    assert "negative or infinite duration" in notes[0] and "negative or infinite" in notes[1]
    assert "MEMRA_OBS_MAX_DEVICES" in notes[2] and "unknown tag [spec-prof-roundsX]" in notes[3]
    assert out == [] and tail.stats.total_malformed == 4


def test_past_the_report_limit_bad_lines_are_counted_and_that_is_said_once():
    """A log of thousands of bad lines must not flood the tail's stderr: the first
    ``report_limit`` are said one by one, then one line says the rest are only counted."""
    bad = PHASE.replace("draft=9.49", "draft=-9.49")
    notes, out, tail = _tail_notes([bad] * 5, report_limit=2)
    assert [n.split(":")[1] for n in notes[:2]] == ["1", "2"] and len(notes) == 3, notes
    assert notes[2].startswith("more than 2 bad lines; counting the rest without reporting")
    assert out == [] and tail.stats.total_malformed == 5


def test_a_refusal_quoting_a_long_value_is_one_short_note():
    """A refusal quotes the value it refused: a [spec-prof] whose draft_prime_arm or prime_ms
    is 300,000 characters gave a 300-600 KB note on the tail's stderr (and a report table cell
    as long, 200 of them a page). The reason is cut to 200 characters, the excerpt to 80."""
    prof = prof_line(SpecFirstTokenProf(first_burst_rounds=6))
    lines = [
        re.sub(r"draft_prime_arm=\S*", "draft_prime_arm=" + "\u00e9" * 300_000, prof),
        re.sub(r"prime_ms=\S*", "prime_ms=" + "9" * 300_000 + "x", prof),
    ]
    notes, out, tail = _tail_notes(lines)
    assert out == [] and [n.split(":")[1] for n in notes] == ["1", "2"], [n[:100] for n in notes]
    assert "draft_prime_arm must be a word" in notes[0] and "prime_ms='999" in notes[1]
    assert max(map(len, notes)) < 400 and tail.stats.total_malformed == 2


def test_new_tags_mint_at_most_max_families_of_series():
    """A hostile stream: 200 new tags (each family ~156 series: 2,000 made 312,000 series, a
    27 MB /metrics) and a 900 KB tag (a 140 MB /metrics, GBs of memory). Past
    ``max_families`` (MEMRA_OBS_MAX_FAMILIES) a new family's lines are refused, said once
    and counted as unplaced; a known family still goes through; the long tag is malformed."""
    from prometheus_client import CollectorRegistry, generate_latest

    from memra_obs.prom import PrometheusExporter

    reg = CollectorRegistry()
    prom = PrometheusExporter(reg, worker="w", worker_label=True)
    body = PHASE.split("] ", 1)[1]
    lines = [f"[f{i}-phase] {body}" for i in range(200)]
    lines += [f"[{'f' * 900_000}-phase] {body}", f"[f1-phase] {body}"]
    notes: list[str] = []
    tail = Tail(Rebuilder("w", max_families=3), prom.export, out=None, notes=notes.append)
    tail.feed(("\n".join(lines) + "\n").encode(), 1)
    tail.close(2)
    text = generate_latest(reg).decode()
    assert set(re.findall(r'family="([^"]*)"', text)) == {"f0", "f1", "f2"} and len(text) < 10**5
    assert tail.stats.orphans["phase"] == 197 and tail.stats.malformed["phase"] == 1
    assert [n.split(": ", 2)[:2] for n in notes] == [
        ["-:4", "past MEMRA_OBS_MAX_FAMILIES=3"],
        ["-:201", "malformed phase line"],
    ]
    assert "a tag over 64 characters" in notes[1] and len(notes[1]) < 300


def test_a_line_over_one_mib_is_reported_and_passed_through():
    """A tagged line longer than MAX_LINE: passed through whole, reported with its number."""
    from memra_obs.tail.passthrough import MAX_LINE

    sink = bytearray()

    class Out:
        def write(self, b: bytes) -> None:
            sink.extend(b)

        def flush(self) -> None:
            pass

    notes: list[str] = []
    tail = Tail(Rebuilder("w"), lambda b: None, out=Out(), notes=notes.append)  # type: ignore[arg-type]
    big = b"[spec-prof-rounds] row=0 " + b"9" * (MAX_LINE + 10)
    data = b"ok\n" + big + b"\n" + PHASE.encode() + b"\n"
    for i in range(0, len(data), 65536):
        tail.feed(data[i : i + 65536], 1)
    tail.close(2)
    assert bytes(sink) == data
    assert len(notes) == 1 and notes[0].startswith("-:2: a line over 1048576 bytes")
    assert tail.lineno == 3 and tail.stats.lines["phase"] == 1


def test_an_over_long_last_line_ends_at_a_rotation_or_the_end():
    """An over-long line cut off by a rotation (settle) or the end of input is one line: the
    rotated-in file's first line is parsed (it was taken for the over-long line's end)."""
    from memra_obs.tail.passthrough import MAX_LINE

    recs: list = []
    tail = Tail(Rebuilder("w"), recs.extend, out=None, notes=lambda s: None)
    tail.feed(b"x" * (MAX_LINE + 1), 0)
    tail.settle(1)
    tail.feed(PHASE.encode() + b"\n", 2)
    tail.close(3)
    assert tail.lineno == 2 and tail.stats.lines["other"] == 1 and tail.stats.lines["phase"] == 1
    assert sum(1 for r in recs if isinstance(r, RoundRecord)) > 0
    end = Tail(Rebuilder("w"), lambda b: None, out=None, notes=lambda s: None)
    end.feed(b"x" * (MAX_LINE + 1), 0)
    end.close(1)
    assert end.lineno == 1 and end.stats.lines["other"] == 1


def test_every_line_over_one_mib_is_reported_also_inside_one_big_chunk():
    """A line over MAX_LINE read in one chunk (a library caller's, or the benchmark's) is
    reported whatever it starts with, as one that spans chunks is."""
    from memra_obs.tail.passthrough import MAX_LINE

    notes: list[str] = []
    tail = Tail(Rebuilder("w"), lambda b: None, out=None, notes=notes.append)
    tail.feed(b"ok\n" + b"9" * (MAX_LINE + 10) + b"\n" + PHASE.encode() + b"\n", 1)
    tail.close(2)
    assert len(notes) == 1 and notes[0].startswith("-:2: a line over 1048576 bytes")
    assert tail.lineno == 3 and tail.stats.lines["other"] == 2


def test_a_line_over_one_mib_in_cri_parts_is_reported_as_a_plain_one_is():
    """A pod's log (/var/log/pods) splits a long line into 16 KiB ``P`` parts: joined past
    MAX_LINE it read as nothing, unsaid (a plain log's same bytes were reported), and the
    report dropped it alike. Both say it now, with its line number."""
    from memra_obs.report.inputs import Run, _read_log
    from memra_obs.tail.passthrough import MAX_LINE

    ts = "2026-12-07T01:02:03.123456789Z"
    body = "\r 42%|####      |" * (MAX_LINE // 16 + 1) + PHASE
    parts = [body[i : i + 16384] for i in range(0, len(body), 16384)]
    cri = [f"{ts} stderr P {p}" for p in parts[:-1]] + [f"{ts} stderr F {parts[-1]}"]
    cri.append(f"{ts} stderr F {PHASE}")
    notes: list[str] = []
    tail = Tail(Rebuilder("w"), lambda b: None, out=None, notes=notes.append)
    tail.feed(("\n".join(cri) + "\n").encode(), 1)
    tail.close(2)
    assert len(notes) == 1 and notes[0].startswith(f"-:{len(parts)}: a line over 1048576 bytes")
    assert tail.stats.lines["phase"] == 1
    run = Run("pod.log")
    _read_log(cri, run, 64)
    assert [(n, why[:20]) for n, why, _ in run.refused] == [(len(parts), "a line over 1048576 ")]
