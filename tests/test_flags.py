"""The seed's flags: pure resolution, read-once accessors, the loud override line."""

from __future__ import annotations

import io
import time

import pytest

from memra_obs import flags


def test_level_resolution_honors_both_names_general_wins():
    """The seed's own unit test, ported: either name alone, general wins, junk is off."""
    f = flags.spec_trace_level_from
    buf = io.StringIO()
    assert f(None, None, buf) == 0
    assert f("x", None, buf) == 0
    assert f("1", None, buf) == 1
    assert f("2", None, buf) == 2
    assert f(None, "1", buf) == 1
    assert f(None, "2", buf) == 2
    assert f("2", "2", buf) == 2
    assert f("1", "2", buf) == 1
    assert f("2", "1", buf) == 2
    assert f("x", "1", buf) == 1
    assert flags.parse_level("0") is None


@pytest.mark.parametrize("junk", ["0", "3", "", " 1", "1 ", "01", "true", "on", "2\n", "١"])
def test_junk_levels_are_off_never_errors(junk):
    """A typo in a diagnostic flag means off, by the seed's law."""
    assert flags.parse_level(junk) is None
    assert flags.spec_trace_level_from(junk, None, io.StringIO()) == 0


def test_override_line_is_verbatim_and_only_on_disagreement():
    """Both names valid and different: exactly one line, the DESIGN's bytes."""
    buf = io.StringIO()
    assert flags.spec_trace_level_from("1", "2", buf) == 1
    assert buf.getvalue() == (
        "[spec-trace] MEMRA_SPEC_TRACE=1 overrides MEMRA_GLM5_SPEC_TRACE=2 "
        "(the general flag wins; unset one to silence this)\n"
    )
    for g, a in [("2", "2"), ("x", "1"), ("1", None), ("1", "junk")]:
        quiet = io.StringIO()
        flags.spec_trace_level_from(g, a, quiet)
        assert quiet.getvalue() == ""


def test_level_is_read_once_per_process(monkeypatch, capsys):
    """The accessor reads the environment once; later changes are not seen."""
    monkeypatch.setenv("MEMRA_SPEC_TRACE", "2")
    monkeypatch.setenv("MEMRA_GLM5_SPEC_TRACE", "1")
    assert flags.spec_trace_level() == 2
    assert flags.spec_trace_on()
    monkeypatch.setenv("MEMRA_SPEC_TRACE", "1")
    assert flags.spec_trace_level() == 2
    assert capsys.readouterr().err.count("overrides") == 1


@pytest.mark.parametrize(("value", "on"), [("0", False), ("1", True), ("2", True), ("x", False)])
def test_trace_is_on_from_level_1(monkeypatch, value, on):
    """``spec_trace_on()`` is the seed's ``level >= 1``: level 1 alone turns phase lines on."""
    monkeypatch.setenv("MEMRA_SPEC_TRACE", value)
    monkeypatch.delenv("MEMRA_GLM5_SPEC_TRACE", raising=False)
    assert flags.spec_trace_on() is on


def test_the_override_line_with_no_stderr_never_raises(monkeypatch):
    """A daemon started with ``2>&-`` has ``sys.stderr`` None: the override line raised
    AttributeError out of the first ``get_observer()`` (the seed's eprintln! ignores it)."""
    monkeypatch.setattr("sys.stderr", None)
    assert flags.spec_trace_level_from("1", "2") == 1


def test_the_override_line_is_said_once_under_threads(monkeypatch, capfd):
    """Threads reading the level at once print one override line (the seed's OnceLock);
    functools.cache let each thread that missed the cache print it."""
    import threading

    monkeypatch.setenv("MEMRA_SPEC_TRACE", "1")
    monkeypatch.setenv("MEMRA_GLM5_SPEC_TRACE", "2")
    slow = flags.spec_trace_level_from  # widen the window two threads race through

    def level_from(*a):
        time.sleep(0.01)
        return slow(*a)

    monkeypatch.setattr(flags, "spec_trace_level_from", level_from)

    def read(go: threading.Barrier) -> None:
        go.wait()
        flags.spec_trace_level()

    for _ in range(5):
        flags._reset()
        go = threading.Barrier(8)
        ts = [threading.Thread(target=read, args=(go,)) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert capfd.readouterr().err.count("overrides") == 5


def test_alias_alone_is_honored(monkeypatch):
    """The glm5 name is never silently dead."""
    monkeypatch.setenv("MEMRA_GLM5_SPEC_TRACE", "1")
    assert flags.spec_trace_level() == 1


@pytest.mark.parametrize(
    ("value", "on"), [(None, False), ("1", True), ("2", False), ("true", False), (" 1", False)]
)
def test_prof_is_exactly_one(monkeypatch, value, on):
    """MEMRA_SPEC_PROF is on only for the exact string 1."""
    if value is not None:
        monkeypatch.setenv("MEMRA_SPEC_PROF", value)
    assert flags.spec_prof_on() is on


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("0", False), ("false", True), ("", True)]
)
def test_first_token_eager_defaults_on(monkeypatch, value, on):
    """The eager first-token door is on unless set to exactly 0."""
    if value is not None:
        monkeypatch.setenv("MEMRA_SPEC_FIRST_TOKEN_EAGER", value)
    assert flags.first_token_eager() is on
