"""The Python lines against the seed compiled with rustc: byte for byte, on generated inputs."""

from __future__ import annotations

import io
import struct

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from memra_obs import flags
from memra_obs.legacy import phase_lines
from memra_obs.records import U64_MAX, SpecPhaseNs, SpecRoundProf, SpecRoundsLog, VerifySplit

pytestmark = pytest.mark.rust

u64 = st.one_of(
    st.integers(0, 10**7),
    st.integers(0, 10**13),
    st.integers(0, U64_MAX),
    st.sampled_from([0, 1, 5_000, 125_000, 1_250_000, 2_500_000, 2**53, 2**53 + 1, U64_MAX]),
)
tags = st.text(
    st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="]"),
    min_size=1,
    max_size=12,
)


@given(
    tag=tags,
    tag_v=tags,
    k=st.integers(0, 2**32),
    ns=st.lists(u64, min_size=5, max_size=5),
    rounds=st.one_of(st.integers(0, 70), st.integers(0, U64_MAX)),
    level=st.integers(0, 2),
    split=st.lists(u64, min_size=4, max_size=4),
)
@example(
    tag="glm5-phase",
    tag_v="glm5-phase-v",
    k=4,
    ns=[0, 0, 0, 0, 0],
    rounds=0,
    level=2,
    split=[0, 0, 0, 0],
)
@example(tag="t", tag_v="v", k=4, ns=[U64_MAX] * 5, rounds=1, level=2, split=[U64_MAX] * 4)
@example(
    tag="t",
    tag_v="v",
    k=1,
    ns=[5_000, 15_000, 25_000, 125_000, 1_005_000],
    rounds=1,
    level=1,
    split=[0] * 4,
)
@example(
    tag="t",
    tag_v="v",
    k=1,
    ns=[1_250_000, 3_750_000, 625_000, 1, 0],
    rounds=2,
    level=2,
    split=[5000, 1, 2, 3],
)
def test_phase_lines_match_the_seed(rust_oracle, tag, tag_v, k, ns, rounds, level, split):
    """Level-1 and level-2 lines are the seed's bytes, wrapping u64 sums included."""
    p = SpecPhaseNs(*ns, rounds=rounds)
    want_out, want_err = rust_oracle.ask(
        f"phase {tag} {tag_v} {k} {' '.join(map(str, ns))} {rounds} {level} {' '.join(map(str, split))}"
    )
    assert want_out == ""
    got = phase_lines(p, tag, tag_v, k, level, VerifySplit(*split))
    assert "".join(line + "\n" for line in got) == want_err


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


f32_ms = st.one_of(
    st.floats(0, 1e4, width=32),
    st.floats(0, 3.3999999521443642e38, width=32),
    st.sampled_from([0.0, -0.0, 0.05, 0.15, 0.25, 1.05, 2.5, 3.4028234663852886e38, 1e-45]),
)
rows = st.lists(
    st.builds(
        SpecRoundProf,
        wall_ms=f32_ms,
        draft_ms=f32_ms,
        verify_ms=f32_ms,
        accept_ms=f32_ms,
        rest_ms=f32_ms,
        k=st.integers(0, 2**16 - 1),
        j=st.integers(0, 2**16 - 1),
        ctx=st.integers(0, 2**32 - 1),
        seq_rows=st.integers(0, 2**32 - 1),
    ),
    max_size=70,
)


@given(rows)
@example([])
@example([SpecRoundProf(wall_ms=2.0), SpecRoundProf(wall_ms=3.0), SpecRoundProf(wall_ms=3.0000002)])
@example([SpecRoundProf(wall_ms=-0.0), SpecRoundProf(wall_ms=-0.0)])
@example([SpecRoundProf(wall_ms=-0.0), SpecRoundProf(wall_ms=0.0), SpecRoundProf(wall_ms=-0.0)])
@example([SpecRoundProf(wall_ms=3e38), SpecRoundProf(wall_ms=3e38)])
# 1.5 * med is exact in f64 but rounds up (ties-to-even) in f32: the seed does not count
# the third round as slow.
@example(
    [
        SpecRoundProf(wall_ms=1 + 2**-23),
        SpecRoundProf(wall_ms=1 + 2**-23),
        SpecRoundProf(wall_ms=1.5 + 2**-22),
    ]
)
def test_summary_matches_the_seed(rust_oracle, rs):
    """The summary's f64 folds, sorted-wall mean and f32 threshold give the seed's bytes."""
    log = SpecRoundsLog()
    for r in rs:
        log.push(r)
    req = [f"summary {len(log.rounds)}"] + [
        f"{_bits(r.wall_ms)} {_bits(r.draft_ms)} {_bits(r.verify_ms)} {_bits(r.accept_ms)} "
        f"{_bits(r.rest_ms)} {r.k} {r.j} {r.ctx} {r.seq_rows}"
        for r in log.rounds
    ]
    out, err = rust_oracle.ask("\n".join(req))
    assert err == ""
    assert out == log.summary() + "\n"


opt_flag = st.one_of(
    st.none(),
    st.sampled_from(["1", "2", "0", "3", "", " 1", "1 ", "01", "2\n", "x", "true"]),
    st.text(max_size=4),
)


@given(opt_flag, opt_flag)
def test_flag_resolution_matches_the_seed(rust_oracle, general, alias):
    """Level and the override line agree with spec_trace_level_from for any pair of values."""
    enc = lambda v: "N" if v is None else "S" + v.encode().hex()  # noqa: E731
    out, err = rust_oracle.ask(f"flags {enc(general)} {enc(alias)}")
    buf = io.StringIO()
    assert f"{flags.spec_trace_level_from(general, alias, err=buf)}\n" == out
    assert buf.getvalue() == err
