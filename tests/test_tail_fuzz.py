"""The parser under random and mutated lines: only LegacyParseError, never a wrong record."""

from __future__ import annotations

import time

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
    round_prof,
    scan_line,
)
from memra_obs.records import (
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
)
from memra_obs.tail import Rebuilder, Tail

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


def _scan_agrees(line: str) -> None:
    """scan_line and parse_line say the same thing about ``line`` (record or reason)."""
    try:
        rec = parse_line(line)
    except LegacyParseError as e1:
        try:
            scan_line(line)
        except LegacyParseError as e2:
            assert e2.reason == e1.reason
        else:
            raise AssertionError("scan_line accepted what parse_line refused") from None
        return
    s = scan_line(line)
    assert (s is None) == (rec is None)
    if rec is not None and isinstance(rec, RoundsLine):
        assert round_prof(s[2]) == rec.prof  # type: ignore[index]


@given(valid_lines(), st.sampled_from(["", "\n", "\r\n"]))
def test_valid_lines_parse_to_their_own_record(lv, end):
    """Every line the formatters write (any ending) parses to exactly its record."""
    line, want = lv
    _check_valid(line, want)
    assert parse_line(line + end) == parse_line(line)
    _scan_agrees(line + end)


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
    _scan_agrees(line)


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
