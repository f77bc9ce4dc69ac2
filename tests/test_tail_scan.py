"""The tail's C scanner (memra_obs/tail/_scan.c) against the Python fast path, line by line.

The scanner may leave a line to the Python path (event 3) whenever it is unsure; a line it
takes must be one the Python fast path takes, with the same values. The whole-tail
equivalence (records, reports, counters) is tests/test_tail_fuzz.py's
``test_fast_patterns_change_nothing_the_tail_does``.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tail_fuzz import _PHASE_L, _ROW, _VERIFY_L, mutated, valid_lines

from memra_obs import legacy
from memra_obs.tail import core

scan = core.C_SCAN


needs_scan = pytest.mark.skipif(scan is None, reason="the C scanner is not built")


def _python_view(line: str) -> tuple:
    """What the Python fast path makes of one line: ("row", idx, ns..., counts),
    ("phase"/"verify", tag, values as floats), or ("other",)."""
    tok = legacy.FAST_ROW_LINES(line + "\n")
    assert len(tok) == 1
    if tok[0][0]:
        cols = core._row_columns(tok, 1)
        return ("row", *(c[0] for c in cols))
    if line[:1] != "[" or line.startswith("[spec-prof-rounds] "):
        return ("other",)
    for kind, match in (("phase", legacy.FAST_PHASE), ("verify", legacy.FAST_VERIFY)):
        m = match(line)
        if m is not None and m.group(1) not in legacy.FAST_TAGS_EXCLUDED:
            g = m.groups()
            return (kind, g[0], (int(g[1]), int(g[2]), *map(float, g[3:])))
    return ("other",)


def _c_view(line: str) -> tuple:
    events, rows, n, plain = scan(line + "\n")
    assert n == 1
    if plain:
        assert events == [] and rows is None
        return ("plain",)
    assert len(events) == 1
    ev = events[0]
    assert ev[1] == 0
    if ev[0] == 0:
        assert ev[2:] == (0, 1)
        return ("row", *(c[0] for c in rows))
    if ev[0] == 3:
        assert ev[2] == line
        return ("other",)
    return ("phase" if ev[0] == 1 else "verify", ev[2], ev[3])


def _agree(line: str) -> tuple:
    c = _c_view(line)
    py = _python_view(line)
    if c == ("plain",):
        assert not line.startswith("["), line
    elif c != ("other",):  # taken: exactly as the Python path would
        assert c == py, line
        for a, b in zip(
            c[2] if c[0] != "row" else (), py[2] if py[0] != "row" else (), strict=True
        ):
            assert struct.pack("<d", a) == struct.pack("<d", b), line  # -0.0 stays -0.0
    return c


@needs_scan
@settings(max_examples=400, deadline=None)
@given(valid_lines(), st.sampled_from(["", "\r", "\r\r"]))
def test_valid_lines_are_taken_as_python_takes_them(lv, end):
    line = lv[0] + end
    c = _agree(line)
    py = _python_view(line)
    if py[0] in ("row", "phase", "verify") and len(line) < 400:
        assert c[0] == py[0], line  # the scanner is not needlessly shy of real lines


@needs_scan
@settings(max_examples=600, deadline=None)
@given(mutated())
def test_damaged_lines_are_taken_only_as_python_takes_them(line):
    if "\n" not in line:
        _agree(line)


digits = st.text("0123456789", min_size=1, max_size=24)


@needs_scan
@settings(max_examples=600, deadline=None)
@given(st.booleans(), digits, digits)
def test_decimals_convert_as_float_does(neg, i, f):
    """Up to 15 digits the scanner divides exactly (M / 10**f); past that it calls
    CPython's own parser: either way the value is float()'s, sign of zero included."""
    s = ("-" if neg else "") + i + "." + f
    line = _PHASE_L.replace("total=4.895", "total=" + s)
    c = _agree(line)
    if c[0] == "phase":
        assert struct.pack("<d", c[2][-1]) == struct.pack("<d", float(s))
    if not neg and len(i) <= 30:
        row = _ROW.replace("wall_ms=5.25", "wall_ms=" + s)
        c = _agree(row)
        assert c[0] == "row"
        assert c[2] == round(struct.unpack("<f", struct.pack("<f", float(s)))[0] * 1e6)


@needs_scan
def test_edges():
    assert _agree(_ROW)[0] == "row"
    assert _agree(_ROW + "\r\r")[0] == "row"
    for bad in (
        _ROW.replace("row=0", "row=00"),
        _ROW.replace("row=0", "row=10000"),
        _ROW.replace("k=4", "k=65536"),
        _ROW.replace("ctx=100", "ctx=1000000000"),
        _ROW.replace("wall_ms=5.25", "wall_ms=-5.25"),
        _ROW.replace("wall_ms=5.25", "wall_ms=5."),
        _ROW.replace("wall_ms=5.25", "wall_ms=.25"),
        _ROW.replace("wall_ms=5.25", "wall_ms=1" + "0" * 30 + ".0"),
        _ROW.replace("wall_ms=5.25", "wall_ms=5.25e3"),
        _ROW + " ",
        _ROW + "\r ",
        _ROW[:-3],
        _PHASE_L.replace("[glm5-phase]", "[spec-prof]"),
        _PHASE_L.replace("[glm5-phase]", "[spec-trace]"),
        _VERIFY_L.replace("[glm5-phase-v]", "[spec-prof-summary]"),
        _PHASE_L.replace("[glm5-phase]", "[glm5\u00a0phase]"),  # a tag with NBSP: Python's \s
        _PHASE_L.replace("[glm5-phase]", "[glm5\x1fphase]"),  # and \x1f, both whitespace there
        _PHASE_L.replace("[glm5-phase]", "[glm5-\u00e9]"),
        _PHASE_L.replace("rounds=6", "rounds=" + "9" * 19),
        _PHASE_L.replace("total=4.895", "total=" + "1" * 80 + ".5"),
        _PHASE_L + " ",
        "[]",
        "[",
        "[x] rounds=1",
    ):
        assert _agree(bad) == ("other",), bad
    neg = _PHASE_L.replace("draft=1.581", "draft=-0.000")
    c = _agree(neg)
    assert c[0] == "phase" and struct.pack("<d", c[2][8]) == struct.pack("<d", -0.0)
    assert _agree(_VERIFY_L)[0] == "verify"
    assert _agree("")[0] == "plain" and _agree("hello [glm5-phase]")[0] == "plain"


@needs_scan
def test_runs_lines_and_the_last_line_without_newline():
    r0, r1 = _ROW, _ROW.replace("row=0", "row=1")
    text = "\n".join([r0, r1, "other", r1, "", _PHASE_L, "[bad", r0, r0]) + "\n" + r1
    events, rows, n, plain = scan(text)
    assert n == 10 and plain == 2
    assert [e[:2] for e in events] == [(0, 0), (0, 3), (1, 5), (3, 6), (0, 7)]
    assert [e[2:4] for e in events if e[0] == 0] == [(0, 2), (2, 3), (3, 6)]
    assert rows[0] == [0, 1, 1, 0, 0, 1]
    assert events[3][2] == "[bad"
    assert scan("") == ([], None, 0, 0)
    assert scan("\u00e9\n\x00[\n")[2:] == (2, 2)
    assert scan("[\x00]\n") == ([(3, 0, "[\x00]")], None, 1, 0)
    with pytest.raises(TypeError):
        scan(b"x\n")  # type: ignore[arg-type]
