"""The parser and the tail under random and mutated lines: only LegacyParseError, never a
wrong record; the tail's books hold whatever arrives, however it is chunked."""

from __future__ import annotations

import itertools
import random
import re
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from memra_obs import legacy
from memra_obs.flags import override_line
from memra_obs.legacy import (
    FirstTokenLine,
    LegacyParseError,
    OverrideLine,
    PhaseLine,
    RoundsLine,
    SummaryLine,
    VerifyLine,
    format_line,
    parse_line,
    phase_lines,
    prof_line,
    prof_rounds_lines,
)
from memra_obs.records import (
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
)
from memra_obs.tail import Rebuilder, Tail
from memra_obs.timeline import BurstRecord, RoundRecord

ms64 = st.one_of(
    st.floats(min_value=0, max_value=1e9, allow_nan=False),
    st.floats(min_value=0, max_value=1.7e308, allow_nan=False, allow_infinity=False),
)
counts = st.integers(0, 2**64 - 1)
profs = st.builds(
    SpecFirstTokenProf,
    **{f: ms64 for f in legacy.FIRST_TOKEN_MS_FIELDS},
    draft_kv_mb=ms64,
    first_round_tokens=counts,
    first_burst_rounds=st.integers(0, 100),
    first_burst_tokens=counts,
    draft_prime_rows=counts,
    draft_prime_chunks=counts,
    draft_prime_arm=st.sampled_from(["", "eager", "chunked"]),
    free_mb_before=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 2**40)), max_size=3),
    free_mb_after=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 2**40)), max_size=3),
)
f32s = st.floats(min_value=0, max_value=3.3999999521443642e38, width=32)
rows = st.builds(
    SpecRoundProf,
    wall_ms=f32s, draft_ms=f32s, verify_ms=f32s, accept_ms=f32s, rest_ms=f32s,
    k=st.integers(0, 65535), j=st.integers(0, 65535),
    ctx=st.integers(0, 2**32 - 1), seq_rows=st.integers(0, 2**32 - 1),
)  # fmt: skip
tags = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,20}", fullmatch=True).filter(
    lambda t: not t.startswith("spec-")
)


@st.composite
def valid_lines(draw: st.DrawFn) -> tuple[str, object]:
    """A line this project or the seed prints, with the record it must parse back to."""
    kind = draw(st.sampled_from(["phase", "verify", "prof", "row", "summary", "override"]))
    if kind in ("phase", "verify"):
        ns = draw(st.lists(st.integers(0, 10**15), min_size=5, max_size=5))
        p = SpecPhaseNs(*ns, rounds=draw(st.integers(1, 10**6)))
        split = VerifySplit(*draw(st.lists(st.integers(0, 10**12), min_size=4, max_size=4)))
        tag, k = draw(tags), draw(st.integers(0, 64))
        lines = phase_lines(p, tag, tag + "-v", k, 2, split)
        line = lines[0] if kind == "phase" else lines[1]
        rec = parse_line(line)
        assert rec is not None
        return line, (kind, tag, p.rounds, k)
    if kind == "prof":
        prof = draw(profs)
        return prof_line(prof), prof
    if kind == "row":
        r, i = draw(rows), draw(st.integers(0, 10**6))
        return prof_rounds_lines([r], i)[0], (i, r)
    if kind == "summary":
        log = SpecRoundsLog()
        for r in draw(st.lists(rows, max_size=8)):
            log.push(r)
        return legacy.prof_summary_line(log), len(log.rounds)
    g, a = draw(st.sampled_from([(1, 2), (2, 1)]))
    return override_line(g, a), (g, a)


def _check_valid(line: str, want: object) -> None:
    rec = parse_line(line)
    assert rec is not None
    assert format_line(rec) == line
    if isinstance(rec, FirstTokenLine):
        assert rec.prof == want
    elif isinstance(rec, RoundsLine):
        assert (rec.row, rec.prof) == want
    elif isinstance(rec, SummaryLine):
        assert rec.rounds == want
    elif isinstance(rec, OverrideLine):
        assert (rec.general, rec.alias) == want
    else:
        assert isinstance(rec, (PhaseLine, VerifyLine))
        kind, tag, rounds, k = want  # type: ignore[misc]
        assert (rec.tag, rec.rounds, rec.k) == ((tag if kind == "phase" else tag + "-v"), rounds, k)


@given(valid_lines(), st.sampled_from(["", "\n", "\r\n"]))
def test_valid_lines_parse_to_their_own_record(lv, end):
    """Every line the formatters write (any ending) parses to exactly its record."""
    line, want = lv
    _check_valid(line, want)
    assert parse_line(line + end) == parse_line(line)


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """A valid line, damaged: truncated, bytes inserted, deleted or replaced."""
    line, _ = draw(valid_lines())
    chars = list(line)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["cut", "insert", "delete", "replace"]))
        i = draw(st.integers(0, len(chars)))
        c = draw(st.sampled_from([*list("0123456789.-=[]() |:,eE_ak\r\t\x00�é"), "\n"]))
        if op == "cut":
            chars = chars[:i]
        elif op == "insert":
            chars.insert(i, c)
        elif chars and op == "delete":
            del chars[min(i, len(chars) - 1)]
        elif chars:
            chars[min(i, len(chars) - 1)] = c
    return "".join(chars)


@given(
    st.one_of(
        mutated(),
        st.text(max_size=300),
        st.text(alphabet="[]spec-prof rounds=0123456789.|ms ", max_size=200),
    )
)
def test_damaged_lines_raise_only_legacy_parse_error(line):
    """Random and mutated lines: a record, None, or LegacyParseError; nothing else escapes,
    and any record that comes back formats to a line that parses back to itself."""
    try:
        rec = parse_line(line)
    except LegacyParseError as exc:
        assert exc.line == line and exc.reason
        return
    if rec is not None:  # format(parse(.)) is a projection: once normalized, a fixed point
        norm = format_line(rec)
        assert format_line(parse_line(norm)) == norm  # type: ignore[arg-type]


@settings(max_examples=100)
@given(
    st.lists(
        st.one_of(
            valid_lines().map(lambda lv: lv[0].encode()),
            mutated().map(lambda s: s.encode("utf-8", "surrogatepass")),
            st.binary(max_size=80),
        ),
        max_size=12,
    ),
    st.integers(1, 512),
)
def test_tail_passes_any_bytes_through_and_never_raises(chunks, size):
    """Whatever bytes arrive, in whatever pieces: the same bytes come out, lines are
    counted, and the tail neither raises nor stops."""
    data = b"\n".join(chunks)
    out = _Sink()
    notes: list[str] = []
    tail = Tail(Rebuilder("fuzz"), lambda batch: None, out=out, notes=notes.append)
    t = time.perf_counter_ns()
    for i in range(0, len(data), size):
        tail.feed(data[i : i + size], t)
        tail.tick(t + 10**9)
        t += 1000
    tail.close(t)
    assert out.data == data
    assert tail.lineno == data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


class _Sink:
    def __init__(self) -> None:
        self.data = b""

    def write(self, b: bytes) -> int:
        self.data += bytes(b)
        return len(b)

    def flush(self) -> None:
        pass


# ------------------------------------------------------------------- the tail's fast path

_ROW = (
    "[spec-prof-rounds] row=0 wall_ms=5.25 draft_ms=1.0 verify_ms=3.5 accept_ms=0.25 "
    "rest_ms=0.5 k=4 j=2 ctx=100 seq_rows=0"
)
_PHASE_L = (
    "[glm5-phase] rounds=6 k=4 total=29.37ms | draft=9.49 verify=16.33 accept=1.77 roll=0.83 "
    "maint=0.95 | per-round ms: draft=1.581 verify=2.722 accept=0.295 roll=0.138 maint=0.158 "
    "total=4.895"
)
_VERIFY_L = (
    "[glm5-phase-v] rounds=6 k=4 | per-round ms: vkda=0.893 (scan=0.357) vmla=0.552 "
    "vrest=1.277 (vffn=0.788)"
)


def _tail_records(data: bytes, chunk: int) -> tuple[Any, ...]:
    """What a tail makes of ``data`` read in ``chunk``-byte pieces: records, reports,
    counters, line count."""
    out: list[Any] = []
    notes: list[str] = []
    rb = Rebuilder("fuzz", rng=random.Random(3), epoch_ns=lambda: 5, mono_ns=lambda: 7)
    tail = Tail(rb, out.extend, out=None, notes=notes.append, report_limit=10**6)
    t = 10**12
    for i in range(0, len(data), chunk):
        tail.feed(data[i : i + chunk], t)
        t += 10**6
    tail.close(t)
    st_ = tail.stats
    # Session ids come from a process-wide counter: compare them relative to the first.
    ids = sorted({r.session for r in out})
    rel = {sid: i for i, sid in enumerate(ids)}
    recs = [r._replace(session=rel[r.session]) for r in out]
    return (recs, notes, dict(st_.lines), dict(st_.malformed), dict(st_.orphans), tail.lineno)


def _durations(r: Any) -> Any:
    """A record without its absolute times (they follow the arrival of each chunk)."""
    if type(r) is RoundRecord:
        return r._replace(t_ns_mono=r.phase_ns())
    if type(r) is BurstRecord:
        return r._replace(start_ns_mono=0, end_ns_mono=r.end_ns_mono - r.start_ns_mono)
    if hasattr(r, "intervals"):
        return r._replace(intervals=tuple((n, b - a) for n, a, b in r.intervals))
    return r._replace(**{f: 0 for f in ("start_ns_mono", "end_ns_mono") if f in r._fields})


@st.composite
def worker_streams(draw: st.DrawFn) -> list[str]:
    """A worker's stderr (sessions of bursts: phase and level-2 lines, the profile, rows,
    summaries), then damaged: lines mutated, lost, given a "\r", phase lines under the
    parser's own tags, other programs' lines."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    ms = 1_000_000
    lines: list[str] = []
    for _ in range(rng.randint(1, 3)):
        prof_on = rng.random() < 0.8
        level = rng.choice([1, 2])
        log = SpecRoundsLog()
        done, first, n_rounds = 0, True, rng.randint(1, 90)
        while done < n_rounds:
            n = min(rng.randint(1, 8), n_rounds - done)
            p = SpecPhaseNs()
            rows = []
            for _ in range(n):
                d, v, a, r, m = (rng.choice([0, rng.randint(1, 9 * ms)]) for _ in range(5))
                p.add(SpecPhaseNs(d, v, a, r, m, 1))
                k = rng.randint(0, 8)
                rows.append(SpecRoundProf(
                    wall_ms=(d + v + a + r + m) / 1e6, draft_ms=d / 1e6, verify_ms=v / 1e6,
                    accept_ms=a / 1e6, rest_ms=(r + m) / 1e6, k=k, j=rng.randint(0, k),
                    ctx=1000 + done, seq_rows=rng.choice([0, k + 1]),
                ))  # fmt: skip
            split = VerifySplit(*(rng.randint(0, p.verify) for _ in range(4)))
            lines.extend(phase_lines(p, "glm5-phase", "glm5-phase-v", 4, level, split))
            done += n
            if not prof_on:
                continue
            if first:
                lines.append(prof_line(SpecFirstTokenProf(
                    prime_ms=rng.random() * 40, first_draft_ms=0.5, first_verify_ms=2.5,
                    first_burst_ms=rows[0].wall_ms + 3, first_burst_rounds=n,
                    first_burst_tokens=n + 1, draft_prime_arm="eager",
                    free_mb_before=[(0, 80_000)], free_mb_after=[(0, 79_000)],
                )))  # fmt: skip
                first = False
            for r in rows:
                log.push(r)
            fresh = log.fresh()
            lines.extend(prof_rounds_lines(fresh, log.printed - len(fresh)))
            if not log.wants_more() and not log.summarized:
                log.summarized = True
                lines.append(legacy.prof_summary_line(log))
        if prof_on and not log.summarized:
            lines.append(legacy.prof_summary_line(log))
    for _ in range(draw(st.integers(0, 6))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["mutate", "lose", "cr", "spec-tag", "other"]))
        if op == "mutate":
            lines[i] = draw(_damaged(lines[i]))
        elif op == "lose":
            del lines[i]
        elif op == "cr":
            lines[i] += "\r"
        elif op == "spec-tag":
            tag = draw(st.sampled_from(["spec-prof", "spec-prof-rounds", "spec-trace"]))
            lines.insert(i, _PHASE_L.replace("[glm5-phase]", f"[{tag}]"))
            lines.insert(i, _VERIFY_L.replace("[glm5-phase-v]", f"[{tag}]"))
        else:
            lines.insert(i, "[INFO] some other program: rounds=3 total=5")
    return lines


def _damaged(line: str) -> st.SearchStrategy[str]:
    @st.composite
    def damage(draw: st.DrawFn) -> str:
        chars = list(line)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(chars)))
            c = draw(st.sampled_from(list("0123456789.-=[] |e")))
            op = draw(st.sampled_from(["cut", "insert", "replace"]))
            if op == "cut":
                chars = chars[:i]
            elif op == "insert":
                chars.insert(i, c)
            elif chars:
                chars[min(i, len(chars) - 1)] = c
        return "".join(chars)

    return damage()


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        worker_streams(),
        st.lists(
            st.one_of(
                valid_lines().map(lambda lv: lv[0]),
                mutated(),
                st.sampled_from([_ROW, _PHASE_L, _VERIFY_L]).map(lambda x: x + "\r"),
            ),
            max_size=30,
        ),
    )
)
def test_the_tail_keeps_its_books_on_damaged_streams(lines):
    """A worker's stream, damaged, or any mix of valid, damaged and odd lines: the records,
    reports (line numbers and reasons) and counters do not depend on how the bytes were
    chunked; every line is counted once; every refusal is reported with its line number;
    rounds sit back to back inside their bursts."""
    data = "\n".join(lines).encode("utf-8", "surrogatepass") + b"\n"
    want = _tail_records(data, 1 << 16)
    got = _tail_records(data, 997)
    assert [_durations(r) for r in got[0]] == [_durations(r) for r in want[0]]
    assert got[1:] == want[1:]
    recs, notes, seen, malformed, orphans, lineno = want
    assert sum(seen.values()) == lineno == data.count(b"\n")
    assert len(notes) == sum(malformed.values()) + sum(orphans.values())
    assert all(re.match(r"-:[0-9]+: ", n) for n in notes)
    by_burst: dict[tuple[int, int], list[RoundRecord]] = {}
    for r in recs:
        if type(r) is RoundRecord:
            assert list(r.t_ns_mono) == sorted(r.t_ns_mono) and r.repeat >= 1
            by_burst.setdefault((r.session, r.burst), []).append(r)
    for b in (r for r in recs if type(r) is BurstRecord):
        rs = by_burst.get((b.session, b.index), [])
        assert sum(r.repeat for r in rs) == b.phases.rounds
        for r0, r1 in itertools.pairwise(rs):
            assert r0.t_ns_mono[0] + r0.repeat * r0.wall_ns == r1.t_ns_mono[0]
