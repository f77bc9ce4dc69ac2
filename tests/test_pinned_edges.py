"""Edges of the pure modules the other tests left open (found by hand mutation testing): each
test pins one behaviour a user sees (a byte of a line, a metric, a span, an advisor interval)."""

from __future__ import annotations

import json
import math
import random
import statistics
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

from memra_obs.analysis import advise, estimate_acceptance, fit_costs, wilson, z_of
from memra_obs.legacy import parse_line
from memra_obs.legacy.parse import CriJoin, LegacyParseError
from memra_obs.otel.spans import SpanBuilder, round_span_id, round_span_ids
from memra_obs.prom import encode
from memra_obs.prom.model import Family, SpecCollector
from memra_obs.records import (
    U16_MAX,
    U64_MAX,
    SeqRows,
    SpecFirstTokenProf,
    SpecRoundsLog,
    f32,
    round_prof,
)
from memra_obs.requests import RequestsExporter
from memra_obs.timeline import (
    FirstTokenRecord,
    PriorRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

NAME, TID, SID, PID, START, END, ATTRS, STATUS = range(8)
T = (1000, 1100, 1300, 1400, 1500, 1600)  # phases 100, 200, 100, 100, 100 ns: wall 600


def _session(trace_id: int = 5, sid: int = 0x77) -> SessionRecord:
    """mono = epoch - 10**18: span times read as ns from 10**18."""
    return SessionRecord(1, "glm5", "", "", "w", 1000, 1000, 10**18 + 1000, trace_id, sid, 0, 1,
                         False)  # fmt: skip


def _spans(*records):
    out: list = []
    b = SpanBuilder()
    b.add(records, out)
    b.finish_open(out)
    return out


class _Round:
    def __init__(self, k: int, j: int, ph: tuple[int, ...] = (1, 1, 1, 1, 1)) -> None:
        self.k, self.j, self.ph = k, j, ph

    def phase_ns(self) -> tuple[int, ...]:
        return self.ph


# --- records ---------------------------------------------------------------------------------


def test_f32_overflow_keeps_the_sign():
    assert f32(-1e39) == -math.inf and f32(1e39) == math.inf


def test_seq_rows_wrap_like_a_u64():
    rows = SeqRows(U64_MAX)
    rows.add(2)
    assert rows.take() == 1


def test_a_row_refuses_j_past_u16_on_every_path():
    with pytest.raises(ValueError, match="j="):
        round_prof(1.0, 0.1, 0.5, 0.1, 0.1, 4, U16_MAX + 1, 10, 0)


def test_the_summary_wall_mean_is_a_fold_over_the_sorted_walls():
    """The seed sums the sorted walls: tiny ones first add up where, after a large one, each is
    lost (5.0 + 3 * 2**-52: mean 1.25 + 2**-52 prints 1.3, the unsorted fold's 1.25 prints 1.2)."""
    tiny = 2.0**-52
    rows = [round_prof(5.0, 0.0, 0.0, 0.0, 0.0, 4, 2, 10, 0)]
    rows += [round_prof(tiny, 0.0, 0.0, 0.0, 0.0, 4, 2, 10, 0)] * 3
    assert " wall_ms mean=1.3 min=0.0 med=0.0 max=5.0 " in SpecRoundsLog(rows).summary()


# --- legacy parse ----------------------------------------------------------------------------


def test_a_cri_line_exactly_at_the_limit_is_joined_not_overlong():
    head = "2026-01-01T00:00:00.000000000Z stderr "
    join = CriJoin(limit=10)
    assert join(head + "P " + "x" * 10) == ""
    assert join(head + "F y") == head + "F " + "x" * 10 + "y"
    assert join.overlong == 0


@pytest.mark.parametrize("levels", [(3, 1), (1, 0), (2, 9)])
def test_an_override_line_with_a_level_no_flag_takes_is_refused(levels):
    g, a = levels
    line = (f"[spec-trace] MEMRA_SPEC_TRACE={g} overrides MEMRA_GLM5_SPEC_TRACE={a} "
            "(the general flag wins; unset one to silence this)")  # fmt: skip
    with pytest.raises(LegacyParseError):
        parse_line(line)


# --- analysis --------------------------------------------------------------------------------


def test_wilson_lower_bound_at_zero_successes_is_never_negative():
    z = z_of(0.95)
    assert all(0.0 <= wilson(0, n, z).lo < 1e-12 for n in range(1, 64))


def test_expected_tokens_lower_bound_is_never_below_one_token():
    acc = estimate_acceptance([_Round(4, 4), _Round(4, 0), _Round(4, 4)])
    for k in range(1, 9):
        e = acc.expected_tokens(k)
        assert 1.0 <= e.lo <= e.value <= e.hi <= 1.0 + k


def test_costs_with_k_constant_use_the_sample_variances():
    """k never varied: one parameter per line, so n - 1 degrees of freedom; a mean's interval is
    z * s / sqrt(n)."""
    rng = random.Random(1)
    ph = [(0, rng.randint(900, 1100), rng.randint(10, 90), 5, 5) for _ in range(40)]
    c = fit_costs([_Round(4, 2, p) for p in ph], clock="event")
    walls, accepts = [sum(p) for p in ph], [p[2] for p in ph]
    assert not c.identifiable
    assert c.var_round == pytest.approx(statistics.variance(walls), rel=1e-9)
    half = z_of(0.95) * statistics.stdev(accepts) / math.sqrt(len(ph))
    assert c.accept_ns.hi - c.accept_ns.value == pytest.approx(half, rel=1e-9)


def test_speedup_from_the_verify_fit_counts_its_covariance_with_the_round():
    """Rounds that are all verify: the plain step (verify at one row) and the round time are the
    same estimate, so their errors cancel and the speedup is as sure as E(k) alone."""
    rng = random.Random(2)
    rounds = [_Round(4, rng.randint(0, 4), (0, rng.randint(5000, 15000), 0, 0, 0))
              for _ in range(64)]  # fmt: skip
    a = advise(rounds, explore=0)
    assert a is not None and a.plain_step_source == "verify_fit"
    assert tuple(a.estimated_speedup) == pytest.approx(tuple(a.expected_tokens), rel=1e-6)


# --- prometheus model ------------------------------------------------------------------------


def _registry(*families: Family) -> CollectorRegistry:
    reg = CollectorRegistry()
    SpecCollector(families, threading.Lock()).register(reg)
    return reg


def test_a_histogram_count_of_a_million_reads_as_prometheus_client_writes_it():
    f = Family("memra_x_seconds", "x", "histogram", (), (0.001, 1.0))
    f.child(()).observe(5, n=1_000_000)
    reg = _registry(f)
    body = encode(reg, None)[0]
    assert body == generate_latest(reg) and b"memra_x_seconds_count 1e+06" in body


def test_a_bytes_family_has_its_unit_in_openmetrics():
    f = Family("memra_x_bytes", "x", "gauge", ("device",))
    f.child(("0",)).v = 5
    reg = _registry(f)
    body = encode(reg, "application/openmetrics-text;version=1.0.0")[0]
    assert body == om_latest(reg) and b"# UNIT memra_x_bytes bytes\n" in body


def test_a_help_with_a_newline_and_a_backslash_is_escaped_in_text_format():
    f = Family("memra_x", "a\\b\nc", "counter", ())
    f.child(()).v = 1
    reg = _registry(f)
    body = encode(reg, None)[0]
    assert body == generate_latest(reg) and b"# HELP memra_x_total a\\\\b\\nc\n" in body


# --- requests file ---------------------------------------------------------------------------


def _request(tmp_path, *records, trace_id=5):
    ex = RequestsExporter(str(tmp_path / "r.jsonl"))
    ex.export([_session(trace_id), *records])
    ex.shutdown()
    (line,) = (tmp_path / "r.jsonl").read_text().splitlines()
    return json.loads(line)


def test_a_run_of_equal_rounds_counts_every_round_in_the_requests_file(tmp_path):
    runs = [RoundRecord(1, 0, 0, T, -1, -1, 0, 0, None, repeat=3),
            RoundRecord(1, 0, 3, T, 4, 2, 0, 0, None, repeat=2)]  # fmt: skip
    rec = _request(tmp_path, *runs, SessionEndRecord(1, 2000, 5, 1, 8, ""))
    assert rec["phase_ms"]["verify"] == pytest.approx(5 * 200 / 1e6)
    assert (rec["num_spec_steps"], rec["num_draft_tokens"], rec["unknown_rounds"]) == (2, 8, 3)
    assert "rounds_missing" not in rec


def test_an_earlier_agents_rounds_and_profile_are_in_the_record_not_missing(tmp_path):
    prof = SpecFirstTokenProf(prime_ms=3.0)
    prior = PriorRecord(1, (4, 4), (1, 3), (10, 20, 30, 40, 50), 6, prof)
    rec = _request(tmp_path, prior, SessionEndRecord(1, 2000, 7, 1, 9, ""))
    assert "rounds_missing" not in rec  # the earlier agent's rounds were not counted by seen
    assert rec["first_token"]["prime_ms"] == 3.0
    assert (rec["num_spec_steps"], rec["num_spec_tokens"]) == (2, 6)


def test_the_trace_id_is_32_hex_digits_with_its_leading_zeros(tmp_path):
    rec = _request(tmp_path, SessionEndRecord(1, 2000, 0, 0, 0, ""), trace_id=0xAB)
    assert rec["trace_id"] == "0" * 30 + "ab"


# --- spans -----------------------------------------------------------------------------------


def test_a_run_of_equal_rounds_gets_spans_back_to_back_not_stacked():
    out = _spans(_session(), RoundRecord(1, 0, 0, T, -1, -1, 0, 0, None, repeat=3))
    starts = [sp[START] - 10**18 for sp in out if sp[NAME] == "spec.round"]
    maint = [sp[END] - 10**18 for sp in out if sp[NAME] == "spec.maint"]
    assert starts == [1000, 1600, 2200] and maint == [1600, 2200, 2800]


def test_an_exemplar_names_no_round_span_past_the_cap():
    s = _session()
    at = round_span_ids(2)
    assert at is not None
    assert at(s, RoundRecord(1, 0, 1, T, 4, 2, 0, 0, None)) == round_span_id(s.span_id, 1)
    assert at(s, RoundRecord(1, 0, 2, T, 4, 2, 0, 0, None)) == 0


def test_a_round_that_drafted_nothing_still_carries_its_counts():
    """k = 0 (the confidence gate drafted nothing) is known, unlike k = -1: rate 0, one token."""
    (rnd,) = [sp for sp in _spans(_session(), RoundRecord(1, 0, 0, T, 0, 0, 9, 0, None))
              if sp[NAME] == "spec.round"]  # fmt: skip
    a = dict(rnd[ATTRS])
    assert a["memra.spec.k"] == a["memra.spec.j"] == 0
    assert (a["memra.spec.acceptance_rate"], a["memra.spec.tokens"]) == (0.0, 1)


def test_first_burst_span_kept_when_empty_and_a_bucket_past_it_is_not_its_child():
    iv = (("first_burst", 1300, 1300), ("first_draft", 1300, 1400))
    by = {sp[NAME]: sp for sp in _spans(_session(), FirstTokenRecord(1, SpecFirstTokenProf(), iv))}
    assert "spec.first_token.first_burst" in by
    iv = (("first_burst", 1300, 2000), ("first_verify", 1900, 2100))  # ends past the burst
    by = {sp[NAME]: sp for sp in _spans(_session(), FirstTokenRecord(1, SpecFirstTokenProf(), iv))}
    assert by["spec.first_token.first_verify"][PID] == by["spec.first_token"][SID]


def test_an_earlier_agents_draft_length_is_the_session_spans_num_spec_tokens():
    """And its rounds' counts and phase times are the request's too (memra.spec.request.*); the
    session span ends where its end record says."""
    prior = PriorRecord(
        1, (4, 3), (2, 3), (1_000_000, 5_000_000, 200_000, 100_000, 50_000), 6, None
    )
    out = _spans(_session(), prior, SessionEndRecord(1, 2000, 2, 1, 7, ""))
    (sess,) = [sp for sp in out if sp[NAME] == "spec.session"]
    got = {k.removeprefix("memra.spec.request."): v for k, v in sess[ATTRS]}
    assert got["num_spec_tokens"] == 6
    assert (got["num_draft_tokens"], got["num_accepted_draft_tokens"]) == (7, 5)
    assert (got["draft_ms"], got["verify_ms"], got["maint_ms"]) == (1.0, 5.0, 0.05)
    assert (sess[START], sess[END]) == (10**18 + 1000, 10**18 + 2000)
