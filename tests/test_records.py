"""The seed's records: fields, defaults, storage widths, and clear errors naming the field."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memra_obs import SPEC_PROF_ROUNDS
from memra_obs.records import (
    FIRST_TOKEN_MS_FIELDS,
    U64_MAX,
    SeqRows,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
    f32,
    round_prof,
)

SEED_FIRST_TOKEN_FIELDS = [
    "cache_alloc_ms", "prime_ms", "capture_ms", "anchor_ms", "draft_alloc_ms", "draft_prime_ms",
    "first_draft_ms", "first_verify_ms", "first_accept_ms", "first_roll_ms", "first_maint_ms",
    "first_round_tokens", "first_burst_ms", "first_burst_hook_ms", "first_burst_rounds",
    "first_burst_tokens", "sink_alloc_ms", "prime_tap_dtoh_ms", "draft_prime_h2d_ms",
    "draft_prime_feat_ms", "draft_prime_kv_ms", "draft_prime_rows", "draft_prime_chunks",
    "draft_prime_arm", "draft_kv_mb", "free_mb_before", "free_mb_after",
]  # fmt: skip


def test_first_token_prof_has_every_seed_field_in_order_with_defaults():
    """Same names, same order, Default: 0.0 / 0 / "" / empty lists; the project's one
    addition (unattributed_ms: what no bucket covers) comes after the seed's fields."""
    p = SpecFirstTokenProf()
    assert [f.name for f in dataclasses.fields(p)] == [*SEED_FIRST_TOKEN_FIELDS, "unattributed_ms"]
    for name in SEED_FIRST_TOKEN_FIELDS:
        v = getattr(p, name)
        assert v in (0.0, 0, "", []), name
    assert SpecFirstTokenProf() == p


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("prime_ms", float("nan"), ValueError),
        ("prime_ms", float("inf"), ValueError),
        ("prime_ms", -1.0, ValueError),
        ("prime_ms", "3", TypeError),
        ("first_burst_rounds", 1.5, TypeError),
        ("first_burst_rounds", -1, ValueError),
        ("first_burst_rounds", True, TypeError),
        ("draft_prime_arm", "two words", ValueError),
        ("free_mb_before", [(0,)], TypeError),
        ("free_mb_after", [(0, -5)], ValueError),
    ],
)
def test_first_token_prof_refuses_bad_values_naming_the_field(field, value, kind):
    """A bad value fails where it is set, and the message names the field."""
    p = SpecFirstTokenProf()
    with pytest.raises(kind, match=field):
        setattr(p, field, value)
    with pytest.raises(kind, match=field):
        SpecFirstTokenProf(**{field: value})


def test_numpy_bool_is_refused_as_a_count_whatever_the_numpy():
    """numpy < 2.3 (the newest Python 3.10 gets is 2.2) gives ``np.True_`` an ``__index__``
    (deprecated): it was taken as the count 1 where a Python ``True`` is refused."""
    np = pytest.importorskip("numpy")
    old_np_bool = type("bool", (), {"__index__": lambda self: 1})()  # numpy 2.2's, as seen
    for v in (old_np_bool, np.True_):
        with pytest.raises(TypeError, match="draft_prime_chunks must be an int, got bool"):
            SpecFirstTokenProf(draft_prime_chunks=v)
        with pytest.raises(TypeError, match=r"SpecRoundProf\.k must be an int"):
            SpecRoundProf(k=v)


def test_first_token_prof_unknown_field_is_an_error():
    """A misspelt field is not silently created."""
    with pytest.raises(AttributeError, match="prime_msec"):
        SpecFirstTokenProf().prime_msec = 1.0  # type: ignore[attr-defined]


def test_first_token_total_is_creation_plus_the_first_burst_each_once():
    """``total_ms()``: the creation buckets, the first burst and ``unattributed_ms``, each added
    once; the round-1 buckets and the prime's splits sit inside them and are left out (a bucket
    subtracted passed: the loops' totals hold ~0 in the small ones)."""
    parts = ("cache_alloc_ms", "sink_alloc_ms", "prime_ms", "capture_ms", "anchor_ms",
             "draft_alloc_ms", "first_burst_ms", "unattributed_ms")  # fmt: skip
    inside = [f for f in FIRST_TOKEN_MS_FIELDS if f not in parts]
    assert len(inside) == 11
    prof = SpecFirstTokenProf(
        **{f: 2.0**i for i, f in enumerate(parts)}, **dict.fromkeys(inside, 1e3)
    )
    assert prof.total_ms() == 255.0


def test_round_prof_keeps_the_seeds_storage():
    """ms fields are rounded to f32; k/j are u16, ctx/seq_rows u32."""
    r = SpecRoundProf(wall_ms=0.1, k=65535, j=0, ctx=2**32 - 1, seq_rows=7)
    assert r.wall_ms == f32(0.1) != 0.1
    for field, value in [("k", 65536), ("j", -1), ("ctx", 2**32), ("seq_rows", 2**40)]:
        with pytest.raises(ValueError, match=field):
            SpecRoundProf(**{field: value})
    with pytest.raises(ValueError, match="wall_ms"):
        SpecRoundProf(wall_ms=1e39)
    with pytest.raises(TypeError, match="k"):
        SpecRoundProf(k=1.0)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):  # immutable
        r.k = 1  # type: ignore[misc]


def test_a_row_is_a_round_for_the_analysis_in_ns():
    """``phase_ns()`` of a logged row (what ``advise(rows)`` fits): draft, verify, accept in
    ns in the order of PHASES, the row's rest (rollback + maint) as the rollback, maint 0."""
    from memra_obs.analysis import fit_costs

    r = SpecRoundProf(wall_ms=9.0, draft_ms=1.25, verify_ms=6.5, accept_ms=0.5, rest_ms=0.75)
    assert r.phase_ns() == (1_250_000, 6_500_000, 500_000, 750_000, 0)
    rows = [SpecRoundProf(1.0, 0.25 * k, 2.0 + 0.5 * k, 0.5, 0.75, k, 0) for k in (1, 2, 3, 4)]
    c = fit_costs(rows, clock="host")
    assert (c.draft_per_token_ns.value, c.verify_per_row_ns.value) == pytest.approx((25e4, 5e5))
    assert (c.rollback_ns.value, c.maint_ns.value) == pytest.approx((75e4, 0))


@pytest.mark.parametrize("at", range(5))
@pytest.mark.parametrize(
    ("value", "kind"),
    [(float("nan"), ValueError), (float("inf"), ValueError), (-1.0, ValueError),
     (1e39, ValueError), (True, TypeError), ("3", TypeError)],
)  # fmt: skip
def test_round_prof_refuses_what_the_constructor_refuses_naming_the_field(at, value, kind):
    """The fast path lets no NaN, bool or str through: each fails as the constructor does."""
    args = [1.5, 0.5, 0.25, 0.125, 0.625]
    args[at] = value
    with pytest.raises(kind, match=SpecRoundProf._fields[at]):
        round_prof(*args, 4, 3, 100, 0)  # type: ignore[arg-type]
    assert round_prof(1, 0.5, 0, 0, 0, 4, 3, 100, 0) == SpecRoundProf(1.0, 0.5, 0, 0, 0, 4, 3, 100)


def test_rounds_log_caps_and_hands_out_fresh_rows_once():
    """push stops at SPEC_PROF_ROUNDS; fresh returns each row exactly once."""
    log = SpecRoundsLog()
    for i in range(3):
        log.push(SpecRoundProf(ctx=i))
    assert [r.ctx for r in log.fresh()] == [0, 1, 2]
    assert log.fresh() == []
    for i in range(100):
        log.push(SpecRoundProf(ctx=3 + i))
    assert len(log.rounds) == SPEC_PROF_ROUNDS == 64
    assert not log.wants_more()
    assert len(log.fresh()) == 61
    assert log.summary().startswith("rounds=64 ")
    assert SpecRoundsLog().summary() == "rounds=0"


def test_summary_known_values():
    """A hand-checked summary: means, acceptance, tokens per round, slow count."""
    log = SpecRoundsLog()
    for wall, k, j, ctx in [
        (4.0, 4, 3, 100),
        (4.0, 4, 4, 104),
        (10.0, 4, 1, 109),
        (5.0, 2, 2, 111),
    ]:
        log.push(
            SpecRoundProf(wall_ms=wall, draft_ms=1.0, verify_ms=2.5, k=k, j=j, ctx=ctx, seq_rows=1)
        )
    assert log.summary() == (
        "rounds=4 k_mean=3.50 j_mean=2.50 accept=0.714 tok_per_round=3.50 "
        "wall_ms mean=5.8 min=4.0 med=5.0 max=10.0 slow_rounds(>1.5x med)=1 "
        "draft_mean=1.0 verify_mean=2.5 seq_rows_total=4 ctx_first=100 ctx_last=111"
    )
    assert log.slow_rounds() == 1


def test_phase_ns_add_wraps_like_u64():
    """Counters are u64 and fold with wrapping adds (the seed's release build)."""
    a = SpecPhaseNs(draft=U64_MAX, rounds=1)
    a.add(SpecPhaseNs(draft=2, verify=5, rounds=1))
    assert (a.draft, a.verify, a.rounds) == (1, 5, 2)
    assert SpecPhaseNs(draft=U64_MAX, verify=1).total() == 0
    with pytest.raises(ValueError, match="verify"):
        SpecPhaseNs(verify=-1)


def test_verify_split_drains_atomically_under_threads():
    """Adds from many threads never tear; drain reads and zeroes all four at once."""
    s = VerifySplit()
    seen = [0, 0, 0, 0]
    stop = threading.Event()

    def drainer():
        while not stop.is_set():
            for i, v in enumerate(s.drain()):
                seen[i] += v

    def adder():
        for _ in range(20_000):
            s.add(kda=1, kda_scan=2, mla=3, ffn=4)

    d = threading.Thread(target=drainer)
    d.start()
    workers = [threading.Thread(target=adder) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    d.join()
    for i, v in enumerate(s.drain()):
        seen[i] += v
    assert seen == [80_000, 160_000, 240_000, 320_000]
    assert s.drain() == (0, 0, 0, 0)


def test_seq_rows_take_zeroes():
    """SeqRows.take returns what was added since the last take."""
    c = SeqRows()
    c.add(3)
    c.add(4)
    assert c.take() == 7
    assert c.take() == 0


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=0, max_value=3.4e38))
def test_f32_is_round_to_nearest(x):
    """f32() agrees with a pack/unpack round trip and is idempotent."""
    y = f32(x)
    assert f32(y) == y
    assert abs(y - x) <= abs(x) * 2**-24 + 1.5e-45
