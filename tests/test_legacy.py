"""Legacy lines: golden round trips, generated round trips, parse errors that say why."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from memra_obs import legacy
from memra_obs.legacy import (
    FirstTokenLine,
    LegacyParseError,
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
    f32,
)

GOLDEN = Path(__file__).parent / "data" / "legacy_lines.txt"


def test_golden_lines_round_trip():
    """format(parse(line)) == line for every stored line."""
    lines = GOLDEN.read_text().splitlines()
    assert len(lines) >= 10
    for line in lines:
        rec = parse_line(line)
        assert rec is not None, line
        assert format_line(rec) == line


def test_a_spec_prof_line_from_before_unattributed_ms_still_parses():
    """Lines written before the profile's last field existed read it as 0.0."""
    new = next(x for x in GOLDEN.read_text().splitlines() if x.startswith("[spec-prof] "))
    old = new.rsplit(" unattributed_ms=", 1)[0]
    rec = parse_line(old)
    assert isinstance(rec, FirstTokenLine) and rec.prof.unattributed_ms == 0.0
    assert rec.prof.prime_ms == parse_line(new).prof.prime_ms  # type: ignore[union-attr]


def test_a_verify_line_from_before_vffn_still_parses():
    """A seed from before lane/glm5-vrest prints no ``(vffn=...)``: its level-2 lines read
    with vffn 0.000 (they were refused, one stderr line each); a cut one is still refused."""
    new = next(x for x in GOLDEN.read_text().splitlines() if " (vffn=" in x)
    old = new.rsplit(" (vffn=", 1)[0]
    rec, full = parse_line(old), parse_line(new)
    assert isinstance(rec, VerifyLine) and isinstance(full, VerifyLine)
    assert rec == full._replace(vffn_ms=0.0)
    for cut in (old[:-1], old + " ", new[:-2]):
        with pytest.raises(LegacyParseError):
            parse_line(cut)


def test_phase_line_known_bytes():
    """A burst's two lines, checked by hand against the seed's format strings."""
    p = SpecPhaseNs(
        draft=1_000_000, verify=2_000_000, accept=300_000, roll=400_000, maint=500_000, rounds=3
    )
    split = VerifySplit(kda=100_000, kda_scan=5_000, mla=200_000, ffn=30_000)
    assert phase_lines(p, "glm5-phase", "glm5-phase-v", 4, 2, split) == [
        "[glm5-phase] rounds=3 k=4 total=4.20ms | draft=1.00 verify=2.00 accept=0.30 roll=0.40 "
        "maint=0.50 | per-round ms: draft=0.333 verify=0.667 accept=0.100 roll=0.133 maint=0.167 "
        "total=1.400",
        "[glm5-phase-v] rounds=3 k=4 | per-round ms: vkda=0.033 (scan=0.002) vmla=0.067 "
        "vrest=0.567 (vffn=0.010)",
    ]
    assert split.peek() == (0, 0, 0, 0), "the level-2 line drains the split"


def test_emit_prints_nothing_for_zero_rounds_and_drains_only_at_level_2():
    """rounds == 0 prints nothing; level 1 leaves the split alone."""
    out = io.StringIO()
    split = VerifySplit(kda=5)
    assert phase_lines(SpecPhaseNs(), "t", "tv", 4, 2, split) == []  # not a failure, said
    legacy.emit(SpecPhaseNs(), "t", "tv", 4, level=2, split=split, out=out)
    assert out.getvalue() == ""
    legacy.emit(SpecPhaseNs(draft=1, rounds=1), "t", "tv", 4, level=1, split=split, out=out)
    assert out.getvalue().count("\n") == 1
    assert split.peek() == (5, 0, 0, 0)


def test_emit_drains_the_threads_verify_split_by_default():
    """The seed's ``emit(p, tag, tag_v, k)``: its level-2 line reports what the loop added to
    ``VERIFY_SPLIT`` (the process's accumulators), and drains them."""
    from memra_obs.records import VERIFY_SPLIT

    VERIFY_SPLIT.drain()
    VERIFY_SPLIT.add(kda=4_000_000, kda_scan=2_000_000, mla=2_000_000, ffn=1_000_000)
    out = io.StringIO()
    legacy.emit(SpecPhaseNs(verify=10_000_000, rounds=2), "t", "tv", 4, level=2, out=out)
    assert out.getvalue().splitlines()[1] == (
        "[tv] rounds=2 k=4 | per-round ms: vkda=2.000 (scan=1.000) vmla=1.000 vrest=2.000 "
        "(vffn=0.500)"
    )
    assert VERIFY_SPLIT.peek() == (0, 0, 0, 0)


def test_emit_never_raises():
    """A broken stream or bad record inside emit is reported, not raised."""

    class Broken(io.StringIO):
        def write(self, s):
            raise OSError("EPIPE")

    legacy.emit(SpecPhaseNs(draft=1, rounds=1), "t", "tv", 4, level=1, out=Broken())
    legacy.emit("not a record", "t", "tv", 4, level=1, out=io.StringIO())  # type: ignore[arg-type]


ms64 = st.one_of(
    st.floats(min_value=0, max_value=1e9, allow_nan=False),
    st.floats(min_value=0, max_value=1e-3, allow_nan=False),
    st.floats(min_value=0, max_value=1.7e308, allow_nan=False, allow_infinity=False),
)
counts = st.integers(0, 2**64 - 1)
profs = st.builds(
    SpecFirstTokenProf,
    **{f: ms64 for f in legacy.FIRST_TOKEN_MS_FIELDS},
    draft_kv_mb=ms64,
    first_round_tokens=counts,
    first_burst_rounds=counts,
    first_burst_tokens=counts,
    draft_prime_rows=counts,
    draft_prime_chunks=counts,
    draft_prime_arm=st.sampled_from(["", "eager", "chunked", "v2.1"]),
    free_mb_before=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 2**40)), max_size=8),
    free_mb_after=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 2**40)), max_size=8),
)


@given(profs)
def test_prof_line_round_trips_every_field(prof):
    """Every SpecFirstTokenProf field comes back exactly, and the line re-formats identically."""
    line = prof_line(prof)
    rec = parse_line(line)
    assert isinstance(rec, FirstTokenLine)
    assert rec.prof == prof
    assert format_line(rec) == line
    assert "e-" not in line and "e+" not in line


f32s = st.floats(min_value=0, max_value=3.3999999521443642e38, width=32)
rows = st.builds(
    SpecRoundProf,
    wall_ms=f32s, draft_ms=f32s, verify_ms=f32s, accept_ms=f32s, rest_ms=f32s,
    k=st.integers(0, 65535), j=st.integers(0, 65535),
    ctx=st.integers(0, 2**32 - 1), seq_rows=st.integers(0, 2**32 - 1),
)  # fmt: skip


@given(st.lists(rows, max_size=5), st.integers(0, 10_000))
def test_rounds_lines_round_trip_every_field(rs, start):
    """Each [spec-prof-rounds] row comes back as the same f32/u16/u32 row at its index."""
    lines = prof_rounds_lines(rs, start)
    for i, (line, r) in enumerate(zip(lines, rs, strict=True)):
        rec = parse_line(line)
        assert isinstance(rec, RoundsLine)
        assert rec.row == start + i
        assert rec.prof == r
        assert format_line(rec) == line


@given(f32s)
@example(42.37168502807617)  # 8 digits read back: 9 would too, and are not the shortest
@example(0.5)
def test_rounds_ms_values_are_the_shortest_decimal_that_reads_back(x):
    """README: a row's ms values are the shortest decimal that reads back to the same f32."""
    line = prof_rounds_lines([SpecRoundProf(wall_ms=x)])[0]
    text = line.split(" wall_ms=")[1].split(" ")[0]
    assert f32(float(text)) == x
    digits = len(text.replace(".", "").strip("0"))
    assert not any(f32(float(f"{x:.{d}g}")) == x for d in range(1, digits)), text


@given(st.lists(rows, max_size=70))
def test_summary_line_round_trips(rs):
    """The summary line re-formats to itself."""
    log = SpecRoundsLog()
    for r in rs:
        log.push(r)
    line = legacy.prof_summary_line(log)
    rec = parse_line(line)
    assert isinstance(rec, SummaryLine)
    assert rec.rounds == len(log.rounds)
    assert format_line(rec) == line


@given(
    st.lists(st.integers(0, 10**15), min_size=5, max_size=5),
    st.integers(1, 10**6),
    st.integers(0, 64),
    st.lists(st.integers(0, 10**12), min_size=4, max_size=4),
)
def test_phase_and_verify_lines_round_trip(ns, rounds, k, split):
    """Seed-format lines parse to records that format back to the same bytes."""
    lines = phase_lines(
        SpecPhaseNs(*ns, rounds=rounds), "glm5-phase", "glm5-phase-v", k, 2, VerifySplit(*split)
    )
    p, v = (parse_line(x) for x in lines)
    assert isinstance(p, PhaseLine) and p.rounds == rounds and p.k == k
    assert isinstance(v, VerifyLine)
    assert [format_line(p), format_line(v)] == lines


@pytest.mark.parametrize(
    "line",
    [
        "hello world",
        "[INFO] server started",
        "[glm5] loaded 61 layers",
        "",
        "[x]",
        "[pod/w-0/worker] [glm5] loaded",
        # another program's [spec-...] tag, no space after it: refused as a phase line
        "[spec-decode]: acceptance rate 0.71",
        "[spec-decode]",
        "[spec-tokens]\tfoo",
        '{"log":"hello\\n","stream":"stderr"}',
        # what a prefix search claimed: a damaged line behind anything is nobody's in particular
        "INFO [glm5-phase] rounds=1",
        "+ grep -c '[spec-prof] ' worker.log",
        "2026-12-04 INFO [scheduler] rounds=3 of batching done",
        "[memra-obs] tail: w.log:1: malformed prof_rounds line: [spec-prof-rounds] row=0 wall",
        "x[spec-x] " * 2000,  # each unknown tag searched again: a RecursionError
        "prompt=" + "[" * 70_000,  # each "[" scanned to the end: 13 s a 64 KiB line
        # json's RecursionError: the tail stopped, /metrics with it (past 3.13's C recursion
        # limit of 10,000: 5,000 deep there is a plain JSONDecodeError, never the error's path)
        '{"log":' + "[" * 100_000,
    ],
)
def test_other_programs_lines_are_not_ours(line):
    """Untagged or foreign-tagged lines parse to None."""
    assert parse_line(line) is None


def test_a_line_behind_a_log_collectors_prefix_is_ours():
    """What collectors put first -- a timestamp, ``kubectl logs --prefix``, the CRI log format
    of /var/log/pods, Docker's json-file, terminal colours -- is read past (each golden line
    behind each). A pod's logs read through them gave an empty report, said nowhere."""
    import json

    for line in GOLDEN.read_text().splitlines():
        want = parse_line(line)
        for wrapped in (
            f"2026-12-04T23:30:04.123456Z {line}",
            f"2026-12-04T23:30:04.123456789Z stderr F {line}",
            f"[pod/worker-0/spec] {line}",
            f"[2026-12-04 23:30:04] {line}",
            f"[2026-12-04T23:30:04Z INFO  worker] {line}",  # Rust's env_logger
            json.dumps({"log": line + "\n", "stream": "stderr", "time": "2026-12-04T23:30:04Z"}),
            f"\x1b[33m{line}\x1b[0m",  # coloured whole (a wrapper's logger): silently dropped
            f"\x1b[36mworker-1  |\x1b[0m \x1b[1m{line}\x1b[0m",  # docker compose, bold
        ):
            assert parse_line(wrapped) == want, wrapped


def test_a_tag_reads_the_same_behind_a_prefix_and_a_cut_colour_code_is_a_prefix(caplog):
    """A family with a bracket (``"qwen[mtp]"``) was printed as ``qwen[mtp_-phase``: read so
    direct, but ``mtp_-phase`` behind a CRI or kubectl prefix (two families for one worker). A
    colour code whose ESC a collector cut (``[33m[glm5-phase] ...``) minted family ``33m[glm5``.
    A bracket is no tag character: the family is ``qwen_mtp_`` everywhere, the code a prefix."""
    from memra_obs.testing import capture

    with capture(level=1, prof=False) as cap, cap.observer.session("qwen[mtp]") as s:
        b = s.burst(4)
        b.begin_round()
        for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
            end()
        b.end_round(k=4, j=2)
        b.end()
    (line,) = cap.lines
    assert cap.sessions[0].family == "qwen_mtp_" and "bracket" in caplog.text
    for wrapped in (line, f"2026-12-07T01:02:03Z stderr F {line}", f"[pod/w-0/main] {line}"):
        assert parse_line(wrapped).tag == "qwen_mtp_-phase", wrapped
    golden = GOLDEN.read_text().splitlines()[0]
    want = parse_line(golden)
    for cut in (f"[33m{golden}", f"[1;33m{golden}"):
        assert parse_line(cut) == want, cut
    old = golden.replace("[glm5-phase]", "[qwen[mtp_-phase]")  # a log of before: read as then
    assert parse_line(old).tag == "qwen[mtp_-phase"


def test_a_line_in_a_json_record_is_ours_whatever_its_field():
    """A JSON record a line keeps the line under ``log`` (Docker's json-file, Fluent Bit's CRI
    parser: not its first field), ``message`` (Vector's file sink, ``stern -o json``),
    ``MESSAGE`` (``journalctl -o json``) or ``line`` (``logcli -o jsonl``). Only ``{"log":``
    was read: the others were a tail of 0 legacy lines, a report of "no tagged line"."""
    import json

    t = "2026-12-04T23:30:04.123456789Z"
    for line in GOLDEN.read_text().splitlines():
        want = parse_line(line)
        for rec in (
            {"time": t, "stream": "stderr", "_p": "F", "log": line},
            {"file": "/var/log/w.err", "host": "h", "message": line, "timestamp": t},
            {"__CURSOR": "s=1;i=2", "_PID": "42", "MESSAGE": line, "_SYSTEMD_UNIT": "w.service"},
            {"labels": {"app": "worker"}, "line": line, "timestamp": t},
        ):
            assert parse_line(json.dumps(rec)) == want, rec
    deep = '{"log":' + "[" * 100_000 + '"[glm5-phase] rounds=1"'  # json's RecursionError
    assert parse_line(deep) is None and parse_line('{"msg":"[spec-prof] x"}') is None


def test_a_journald_message_held_as_bytes_is_ours():
    """``journalctl -o json`` gives a MESSAGE holding a control character (a progress bar's
    ``\\r`` before the line, a colour's escape) as its bytes, a list of numbers: those lines
    (every line after a tqdm update, every coloured one) were nobody's, a tail of 0 rounds."""
    import json

    for line in GOLDEN.read_text().splitlines():
        want = parse_line(line)
        for msg in (f" 40%|####      | 4/10\r{line}", f"\x1b[33m{line}\x1b[0m"):
            for rec in (
                {"__CURSOR": "s=1", "MESSAGE": list(msg.encode()), "_PID": "42"},
                {"MESSAGE": list(f"{msg}\n".encode())},
            ):
                assert parse_line(json.dumps(rec)) == want, rec
                assert parse_line(json.dumps(rec, indent=None, separators=(" , ", " : "))) == want
    for bad in ([-1], [256], ["a"], [[91]]):  # not bytes: nobody's line, never a raise
        assert parse_line(json.dumps({"MESSAGE": bad, "x": "[glm5-phase] rounds=1"})) is None


def test_cri_parts_past_the_limit_are_read_as_nothing():
    """``CriJoin(limit)``: a line whose ``P`` parts pass the limit holds no more than that and
    is read as nothing, its ``F`` end included; the stream's next line and the other stream's
    parts are joined as ever."""
    from memra_obs.legacy import CriJoin

    t = "2026-12-04T23:30:04.000000000Z"
    join = CriJoin(limit=20)
    assert join(f"{t} stdout P [glm5-") == ""
    assert join(f"{t} stderr P 0123456789ab") == join(f"{t} stderr P cdef012345") == ""
    assert join(f"{t} stderr F 6789") == ""  # 30 characters: past the limit
    assert join(f"{t} stderr P ab") == "" and join(f"{t} stderr F cd") == f"{t} stderr F abcd"
    assert join(f"{t} stdout F phase]") == f"{t} stdout F [glm5-phase]"


def test_docker_parts_are_held_for_its_two_streams_only():
    """A Docker json-file part was held under any ``stream`` name: records naming 1,000
    streams held 1 MiB each (1 GB in ``tail``, until each one's end that never comes).
    Docker writes ``stdout`` and ``stderr``; a record naming another is not a part."""
    import json

    from memra_obs.legacy import CriJoin

    def docker(log: str, stream: str) -> str:
        return json.dumps({"log": log, "stream": stream}, separators=(",", ":"))

    join = CriJoin()
    for i in range(1000):
        rec = docker("A" * 1000, f"s{i}")
        assert join(rec) == rec
    assert join._held == {}
    assert join(docker("[glm5-", "stderr")) == ""
    assert join(docker("phase]\n", "stderr")) == "[glm5-phase]\n"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (
            "[glm5-phase] rounds=6 k=4 total=30.86ms | draft=9.73 verify=16.71 accept=2.32 roll=0.99",
            "phase line",
        ),
        (
            "[glm5-phase-v] rounds=6 k=4 | per-round ms: vkda=0.893 (scan=0.357) vmla=0.552",
            "verify",
        ),
        ("[spec-prof] cache_alloc_ms=0.1 prime_ms=1.0", "missing"),
        ("[spec-prof-rounds] row=0 wall_ms=9.0 draft_ms=5.3", "row"),
        (
            "[spec-prof-rounds] row=0 wall_ms=9.0 draft_ms=5.3 verify_ms=2.9 accept_ms=0.3 rest_ms=0.3 k=70000 j=4 ctx=1 seq_rows=0",
            "k",
        ),
        ("[spec-prof-summary] rounds=3 k_mean=", "summary"),
        ("[spec-trace] MEMRA_SPEC_TRACE=1 overrides", "override"),
        ("[spec-prof]", "tag without a body"),
        ("[spec-tracer]:", "tag without a body"),
        ("[gl\ufffdm5-phase] rounds=6 k=4 total=1.00ms | draft=", "invalid UTF-8 in the tag"),
        ("[glm5-phase] rounds=3 k=4 garbage", "no known shape"),
        ("[spec-advice-x] rounds=3 k=4 garbage", "unknown tag"),  # each reserved prefix
        ("[spec-tracer] rounds=3 k=4 garbage", "unknown tag"),
        ("[spec-profile] rounds=3 k=4 garbage", "unknown tag"),
        (
            prof_line(SpecFirstTokenProf()).replace(
                "first_burst_ms=0.0", "first_burst_ms=2" + "0" * 320 + ".0"
            ),
            "finite",
        ),
    ],
)
def test_malformed_tagged_lines_say_why(line, why):
    """Truncated or malformed tagged lines raise LegacyParseError with a reason."""
    with pytest.raises(LegacyParseError, match=why) as e:
        parse_line(line)
    assert e.value.line == line


def test_a_tag_is_at_most_64_characters():
    """The seed's tags (a family and ``-phase``/``-phase-v``) parse up to 64 characters; a
    longer one is refused with its kind, not made a label of any size (a 900 KB tag made a
    140 MB /metrics), and behind a prefix it is nobody's. One pass, however long."""
    import time

    MAX_TAG = 64  # (memra_obs.legacy.parse.MAX_TAG)
    phase, verify = (x for x in GOLDEN.read_text().splitlines()[:2])
    for line, kind in ((phase, "phase"), (verify, "verify")):
        body = line.split("] ", 1)[1]
        rec = parse_line(f"[{'f' * MAX_TAG}] {body}")
        assert rec is not None and getattr(rec, "tag", "") == "f" * MAX_TAG
        for n in (MAX_TAG + 1, 900_000):
            t0 = time.perf_counter()
            with pytest.raises(LegacyParseError, match="a tag over 64 characters") as e:
                parse_line(f"[{'f' * (n - 6)}-phase] {body}")
            assert e.value.kind == kind and time.perf_counter() - t0 < 0.5
            assert parse_line(f"2026-12-04T23:30:04Z [{'f' * n}] {body}") is None


iv3 = st.tuples(
    st.floats(0, 1e6, allow_nan=False), st.floats(0, 1e6, allow_nan=False),
    st.one_of(st.floats(0, 1e6, allow_nan=False), st.just(float("inf"))),
)  # fmt: skip


@given(
    st.integers(0, 10**6), st.sampled_from(["sync", "event", "host"]), st.floats(0, 64),
    st.integers(1, 64), iv3, iv3, iv3, st.floats(0, 1e4), st.sampled_from(["verify_fit", "measured"]),
)  # fmt: skip
def test_advice_lines_round_trip(n, clock, k_now, k_rec, tpr, tps, sp, step, src):
    """A [spec-advice] line re-formats to itself, whatever its figures (inf included)."""
    from memra_obs.legacy import AdviceLine

    line = AdviceLine(n, clock, k_now, k_rec, tpr, tps, sp, step, src).line()
    rec = parse_line(line)
    assert isinstance(rec, AdviceLine) and (rec.rounds, rec.clock, rec.k_rec) == (n, clock, k_rec)
    assert format_line(rec) == line


def test_the_advice_line_states_the_advices_figures_in_their_units():
    """``advice_line(advise(...))``: k_now the mean k to 2 decimals, each figure with its
    interval in order, plain_step_ms the plain step in ms (the Advice holds ns)."""
    import random

    from analysis_sim import COSTS, CURVES, rounds

    from memra_obs.analysis import advise
    from memra_obs.legacy import AdviceLine, advice_line

    rng = random.Random(7)
    rs = rounds(CURVES["decaying"], 400, rng, lambda r: r.randint(2, 5), COSTS["launch-bound"])
    a = advise(rs, clock="event")
    assert a is not None and round(a.current_k, 1) != round(a.current_k, 2)
    rec = parse_line(advice_line(a))
    assert isinstance(rec, AdviceLine)
    assert (rec.rounds, rec.clock, rec.k_rec) == (400, "event", a.recommended_k)
    assert rec.k_now == round(a.current_k, 2)
    assert rec.plain_step_ms == round(a.plain_step_ns / 1e6, 3) and rec.plain_step_ms > 1.0
    assert rec.plain_source == a.plain_step_source
    for got, iv, digits in ((rec.tokens_per_round, a.expected_tokens, 3),
                            (rec.tokens_per_s, a.tokens_per_s, 1),
                            (rec.speedup, a.estimated_speedup, 3)):  # fmt: skip
        assert got == tuple(round(x, digits) for x in iv) and got[1] < got[0] < got[2]


def test_the_advice_is_printed_with_the_summary():
    """A profiled session of 64 rounds prints [spec-advice] right after its summary, over the
    same rows, labelled an estimate, with the clock that timed it; the line parses back."""
    from memra_obs.legacy import AdviceLine
    from memra_obs.testing import capture

    cap = capture(level=0, prof=True, memory=lambda: [(0, 1)])
    with cap as c, c.observer.session("glm5") as s, s.burst(4) as b:
        for i in range(64):
            b.begin_round()
            b.end_draft()
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=2 + i % 4, j=i % 3)
    cap = c
    i = next(n for n, x in enumerate(cap.lines) if x.startswith("[spec-prof-summary]"))
    advice = parse_line(cap.lines[i + 1])
    assert isinstance(advice, AdviceLine) and advice.rounds == 64 and advice.clock == "host"
    assert cap.lines[i + 1].startswith("[spec-advice] (estimate) ")


class _Writes(io.StringIO):
    """A text stream that keeps what each ``write()`` was handed (what a pipe would see)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def _rank_rows(rank: int, n: int = 64) -> list[str]:
    """A burst's 64 profile rows (~9.6 KB), each naming ``rank`` in its figures."""
    row = SpecRoundProf(9.058983 + rank, 5.395236, 2.963387, 0.371972, 0.328388, 4, 4)
    return prof_rounds_lines([row._replace(ctx=rank, seq_rows=i) for i in range(n)])


def test_each_write_is_whole_lines_within_pipe_buf_bytes():
    """A pipe write over PIPE_BUF (4096) is not atomic: ranks sharing one stderr pipe tore each
    other's lines (a burst's 64 rows went out as one ~9.6 KB write). Every write is whole lines
    of at most 4096 UTF-8 bytes, a longer line alone; a few short lines stay one write."""
    from memra_obs.linewriter import LineWriter

    wide = "[spec-advice] " + "µ" * 2100  # 2114 characters, 4214 bytes: alone
    cases = [_rank_rows(0), ["a" * 5000, "b", "c" * 4095, "d" * 4094, wide, "µ" * 2000, "e"]]
    for lines in cases:
        out = _Writes()
        LineWriter(out).write_lines(lines)
        assert out.getvalue() == "\n".join(lines) + "\n"
        for s in out.calls:
            assert s.endswith("\n") and (len(s.encode()) <= 4096 or s.count("\n") == 1)
    assert [len(s.encode()) for s in out.calls] == [5001, 2, 4096, 4095, 4215, 4003]
    out = _Writes()
    LineWriter(out).write_lines(_rank_rows(1, 3))
    assert len(out.calls) == 1


def test_ranks_sharing_a_pipe_with_a_slow_reader_never_tear_a_line():
    """Eight forked ranks write bursts of 64 rows to one pipe that a slow reader drains: every
    line read is one a rank wrote, whole (one write over PIPE_BUF came out interleaved)."""
    import os
    import time

    from memra_obs.linewriter import LineWriter

    ranks, bursts = 8, 12
    r, w = os.pipe()
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:  # a rank
            try:
                os.close(r)
                out = LineWriter(os.fdopen(w, "w", encoding="utf-8"))
                for _ in range(bursts):
                    out.write_lines(_rank_rows(rank))
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(w)
    got, deadline = b"", time.monotonic() + 20
    while (chunk := os.read(r, 4000)) and time.monotonic() < deadline:
        got += chunk
        time.sleep(0.0005)  # the slow reader: the pipe fills, ranks wait, then race to write
    os.close(r)
    for pid in pids:
        os.waitpid(pid, 0)
    lines = got.decode(errors="replace").splitlines()
    want = {x for rank in range(ranks) for x in _rank_rows(rank)}
    torn = [x for x in lines if x not in want]
    assert not torn and len(lines) == ranks * bursts * 64, torn[:2]


def test_a_line_cut_short_with_the_next_line_glued_on_reads_as_that_line():
    """A worker killed mid-line, the next one appending its first line right behind it (``2>>``):
    the whole line at the end was refused with the cut one, and the lines after it went
    unplaced (a phase line's 6 rounds counted 0). It reads now as behind any prefix; a cut line
    alone, or glued to another cut one, is still refused. (Cut inside its tag, ``[gl[glm5-phase]
    ...`` reads as a log of before read: a tag with a bracket, family ``gl[glm5``.)"""
    lines = GOLDEN.read_text().splitlines()
    for cut in lines:
        for line in lines:
            want = parse_line(line)
            for n in (cut.index("]") + 1, len(cut) // 2, len(cut) - 1):
                assert parse_line(cut[:n] + line) == want, cut[:n] + line
            with pytest.raises(LegacyParseError):
                parse_line(cut[: len(cut) // 2] + line[: len(line) // 2])
    for line in ("[a] rounds=x" * 50_000, "2026-12-07 " + "[a] rounds=x" * 50_000):
        try:  # once, not once a tag: past Python's recursion limit, and quadratic
            parse_line(line)
        except LegacyParseError:
            pass


def test_a_phase_line_cut_inside_its_last_figure_is_refused():
    """The seed prints exactly {:.2}/{:.3} decimals: ``total=41.9`` of ``total=41.947`` (a line
    cut short) was read as another value."""
    from memra_obs.legacy import LegacyParseError, phase_lines
    from memra_obs.records import SpecPhaseNs

    ns = SpecPhaseNs(123456789, 2345678, 34567, 4567, 567, rounds=3)
    line = phase_lines(ns, "t", "v", 4)[0]
    assert line.endswith("total=41.947") and parse_line(line) is not None
    for cut in (1, 2):
        with pytest.raises(LegacyParseError):
            parse_line(line[:-cut])
    with pytest.raises(LegacyParseError):
        parse_line(line.replace("roll=", "roll=0").replace("roll=00.", "roll=0.0"))
