"""A worker's stderr log or a span file -> one run's records. Nothing is re-derived: a log goes
through :func:`memra_obs.legacy.parse_line` (the one grammar) and the tail's Rebuilder, so its
records are those ``memra-obs tail`` publishes; a span file (DESIGN §4's tree) is read back into
the same records, its phase spans giving each round's six boundaries exactly. Rounds past the
span cap have none: they get their burst's remainder spread evenly, k and j unknown."""

from __future__ import annotations

import errno
import functools
import gzip
import itertools
import json
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .. import records
from ..diagnostics import printable
from ..environment import utf8
from ..legacy import (
    KIND,
    AdviceLine,
    CriJoin,
    LegacyParseError,
    RoundsLine,
    SummaryLine,
    parse_line,
    prof_summary_line,
)
from ..tail.passthrough import MAX_LINE
from ..tail.rebuild import Rebuilder
from ..tail.source import CHUNK, GZIP_MAGIC
from ..timeline import PHASES, BurstRecord, FirstTokenRecord, RoundRecord, SessionRecord, each_round

_OVERLONG = f"a line over {MAX_LINE} bytes, not parsed (as the tail reads it)"
LOGGED = records.SPEC_PROF_ROUNDS  # rows a session's round log keeps
ROTATED = ("a rotated span file read without its other half: cat FILE.1 FILE | memra-obs report -; "
           "or records the worker dropped: memra_obs_dropped_total")  # fmt: skip
LOST = "rounds_without_spans"  # rounds a burst span counts that have no round span (dropped)
Progress = Callable[[int, int], None]  # (bytes read, total or 0: unknown)
A, FT = "memra.spec.", "memra.spec.first_token."
SPLIT = tuple(f"{A}verify.{p}_ns" for p in ("kda", "kda_scan", "mla", "ffn"))
Span = tuple[str, int, int, int, int, dict[str, Any]]  # name, id, parent, start, end, attributes
Kids = dict[int, list[Span]]  # spans by parent id


@dataclass
class RoundLog:
    """A session's round log: the rows its summary covers (the first 64 rounds), that summary
    and its line (0: recomputed from a span file, whose session's trace id it keeps)."""

    rows: list[records.SpecRoundProf] = field(default_factory=list)
    summary: SummaryLine | None = None
    lineno: int = 0
    trace_id: int = 0


class Rounds(Sequence[RoundRecord]):
    """A run's rounds as they were rebuilt: a run of equal rounds (a burst's means, ``repeat`` =
    n) stays one record in ``runs``, so a trace-only log costs a record a burst, not a round
    (bursts of thousands of rounds are ~700 bytes a round expanded). Iterating expands them."""

    def __init__(self, runs: Iterable[RoundRecord] = ()) -> None:
        self.runs = list(runs)

    def __len__(self) -> int:  # the rounds, not the records
        return sum(r.repeat for r in self.runs)

    def __iter__(self) -> Iterator[RoundRecord]:
        return (x for r in self.runs for x in each_round(r))

    def __getitem__(self, i: Any) -> Any:
        return list(self)[i]

    def __iadd__(self, rounds: Iterable[RoundRecord]) -> Rounds:
        self.runs += rounds
        return self


@dataclass
class Run:
    """Everything the page shows of one input."""

    name: str
    kind: str = "log"  # or "spans"
    size: int = 0
    lines: int = 0
    kinds: Counter[str] = field(default_factory=Counter)  # lines (spans) by kind
    refused: list[tuple[int, str, str]] = field(default_factory=list)  # line, why, its start
    unplaced: list[tuple[int, str]] = field(default_factory=list)  # valid lines not placed
    sessions: list[SessionRecord] = field(default_factory=list)
    rounds: Rounds = field(default_factory=Rounds)
    bursts: list[BurstRecord] = field(default_factory=list)
    first_tokens: list[FirstTokenRecord] = field(default_factory=list)
    logs: list[RoundLog] = field(default_factory=list)
    unsampled: int = 0  # span files: rounds past the span cap
    clocks: set[str] = field(default_factory=set)  # the phases' clock, as [spec-advice] says
    notes: list[str] = field(default_factory=list)


def read(path: str, progress: Progress | None = None, max_families: int = 64) -> Run:
    """Read one input (``-``: standard input); a log's families past ``max_families`` are
    refused, as the tail refuses them. Raises OSError when it cannot be opened."""
    with open(0 if path == "-" else path, "rb", closefd=path != "-") as raw:
        run, gz = (
            Run("stdin" if path == "-" else printable(utf8(path))),
            raw.peek(2)[:2] == GZIP_MAGIC,
        )
        f: Any = gzip.open(raw) if gz else raw  # noqa: SIM115  (a banked log, compressed)
        run.size = 0 if path == "-" or gz else os.fstat(raw.fileno()).st_size
        head = [f.readline(MAX_LINE + 1).removeprefix(b"\xef\xbb\xbf")]  # (a BOM)
        while _filled(head) < 2 and head[-1][-1:] == b"\n" and len(head) < 1000:  # (blanks: a
            # collector leaves some; an over-long line's rest is read past in _lines)
            head.append(f.readline(MAX_LINE + 1))
        # The kind is the first non-blank line's, or the second's: `tail -c` cuts the first.
        kinds = [x.lstrip()[:1] == b"{" and b'"resourceSpans"' in x[:65536] for x in head]
        lines = _lines(f, head, run, progress)
        if any(kinds):
            run.kind = "spans"
            _read_spans(lines, run)
        else:
            _read_log(lines, run, max_families)
            record = b'"num_spec_steps"' in head[0] and b'"phase_ms"' in head[0]
            if record and not (run.kinds or run.refused):  # (tagged lines beside it: a log)
                raise OSError(errno.EINVAL, "a requests file (MEMRA_OBS_REQUESTS_FILE's "
                              "records): the report reads a log or a span file")  # fmt: skip
    return run


def _filled(head: list[bytes]) -> int:
    """The lines in ``head`` that are not blank."""
    return sum(not x.isspace() and x != b"" for x in head)


def _lines(f: BinaryIO, head: list[bytes], run: Run, progress: Progress | None) -> Iterator[str]:
    """Lines split on ``\\n`` only (as the tail splits), each decoded whole: bytes that are not
    UTF-8 become U+FFFD, so such a tagged line is refused by the parser, with its reason. A line
    over ``MAX_LINE`` bytes is refused as the tail refuses it and read past in chunks, never
    held whole (a log with a 200 MB line of binary junk took 2.5 GB): an empty line here."""
    done = mark = 0
    rest = iter(functools.partial(f.readline, MAX_LINE + 1), b"")
    for raw in itertools.chain(filter(None, head), rest):
        run.lines, done = run.lines + 1, done + len(raw)
        if len(raw) > MAX_LINE and raw[-1:] != b"\n":
            run.refused.append((run.lines, _OVERLONG, raw[:160].decode("utf-8", "replace")))
            while raw[-1:] != b"\n" and (raw := f.readline(CHUNK)):
                done += len(raw)
            raw = b""
        if progress is not None and done >= mark:
            progress(done, run.size)
            mark = done + (1 << 20)
        yield raw.decode("utf-8", "replace").removesuffix("\n")
    run.size = done


def _read_log(lines: Iterable[str], run: Run, max_families: int) -> None:
    """Every line through the parser and the Rebuilder; line numbers stand in for arrival stamps
    (1 ns apart: bursts lie back to back and no session ends by silence)."""
    rb = Rebuilder("report", rng=random.Random(0), epoch_ns=lambda: 0, mono_ns=lambda: 0,
                   max_families=max_families)  # fmt: skip
    log: RoundLog | None = None  # the round log being read
    cri = CriJoin()  # a pod's log: a line's CRI parts are read as one, as the tail reads them
    for n, line in enumerate(lines, 1):
        try:
            was, line = cri.overlong, cri(line)
            if cri.overlong != was:  # its CRI parts joined past the limit
                run.refused.append((n, _OVERLONG, ""))
                continue
            if (rec := parse_line(line)) is None:
                continue
            if type(rec) is RoundsLine and (p := rec.prof).j > p.k:  # the analysis refuses it
                raise LegacyParseError(line, f"row with k={p.k}, j={p.j}: j must be in 0..k")
        except LegacyParseError as exc:
            run.refused.append((n, exc.reason, line[:160]))
            continue
        run.kinds[KIND[type(rec)]] += 1
        if type(rec) is AdviceLine:
            run.clocks.add(rec.clock)
        # The round logs as the worker kept them: row 0 or a row after a summary opens one, a
        # summary closes it (concurrent sessions interleave: README, "memra-obs report", limits).
        if isinstance(rec, RoundsLine | SummaryLine):
            opens = isinstance(rec, RoundsLine) and rec.row == 0
            if log is None or log.summary is not None or opens:
                run.logs.append(log := RoundLog())
            if isinstance(rec, RoundsLine):
                log.rows.append(rec.prof)
            else:
                log.summary, log.lineno = rec, n
        why = rb.feed(rec, n)  # then what it closed: refused bursts (unplaced)
        run.unplaced += [(n, w) for w in (why, *rb.problems) if w]
        rb.problems.clear()
    rb.close()
    run.unplaced += [(0, w) for w in rb.problems]
    into: dict[type, list[Any]] = {SessionRecord: run.sessions, BurstRecord: run.bursts,
                                   FirstTokenRecord: run.first_tokens, RoundRecord: run.rounds.runs}  # fmt: skip
    for r in rb.take():
        into.get(type(r), []).append(r)  # a run of rounds stays one record (Rounds)


def _value(v: dict[str, Any]) -> Any:
    """An OTLP-JSON AnyValue (64-bit ints arrive as strings)."""
    ((kind, x),) = v.items()
    if kind == "arrayValue":
        return tuple(_value(e) for e in x.get("values", ()))
    return int(x) if kind == "intValue" else float(x) if kind == "doubleValue" else x


def _read_spans(lines: Iterable[str], run: Run) -> None:
    """Every ``spec.*`` span of every line, then one ``spec.session`` subtree at a time."""
    kids, roots = Kids(), list[tuple[int, Span]]()
    for n, line in enumerate(lines, 1):
        spans, tops = list[Span](), list[tuple[int, Span]]()  # a refused line adds none
        try:
            reqs = json.loads(line)["resourceSpans"] if line.strip() else ()
            for s in (s for rs in reqs for ss in rs["scopeSpans"] for s in ss["spans"]):
                if not s["name"].startswith("spec."):
                    continue
                at = {a["key"]: _value(a["value"]) for a in s.get("attributes", ())}
                sp = (s["name"], int(s["spanId"], 16), int(s.get("parentSpanId") or "0", 16),
                      int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]), at)  # fmt: skip
                if not 0 <= sp[3] < 1 << 63 or not 0 <= sp[4] < 1 << 63:  # past int64: no array
                    raise ValueError(f"{sp[0]} {s['spanId']}: a time past 2^63 ns")
                spans.append(sp)
                tops += [(int(s["traceId"], 16), sp)] if sp[0] == "spec.session" else []
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            run.refused.append((n, f"not an OTLP-JSON trace request ({exc!r})", line[:160]))
            continue
        for sp in spans:
            kids.setdefault(sp[2], []).append(sp)
        roots += tops
    run.kinds["spans"] = sum(map(len, kids.values()))
    parts, errors = ("sessions", "rounds", "bursts", "first_tokens", "refused"), Counter[str]()
    for sid, (tid, sp) in enumerate(roots, 1):
        lists = [run.rounds.runs if p == "rounds" else getattr(run, p) for p in parts]
        marks, unsampled, gone = [len(x) for x in lists], run.unsampled, run.kinds[LOST]
        try:
            _session(sid, tid, sp, kids, run)
        except (TypeError, ValueError, KeyError) as exc:  # a refused session adds nothing
            for x, m in zip(lists, marks, strict=True):
                del x[m:]
            run.unsampled, run.kinds[LOST] = unsampled, gone
            run.refused.append(
                (0, f"session span {sp[1]:016x} of trace {tid:032x} refused: {exc!r}", "")
            )
        else:
            errors.update([str(sp[5]["error.type"])] if "error.type" in sp[5] else ())
    todo = [sp[1] for _, sp in roots]
    reached = set(todo)  # sessions and the spans under them (their own parents end too)
    while todo:
        for k in kids.get(todo.pop(), ()):
            if k[1] not in reached:
                reached.add(k[1])
                todo.append(k[1])
    _span_notes(run, run.kinds["spans"] - len(reached), errors)


def _span_notes(run: Run, lost: int, errors: Counter[str]) -> None:
    """What a span file could not carry, and how many of its sessions ended in an error."""
    if errors:  # an A/B whose B ran out of memory more often compares shorter sessions
        said = ", ".join(f"{e} x{n}" for e, n in errors.most_common())
        run.notes.append(f"{errors.total()} of {len(run.sessions)} sessions ended in an error "
                         f"({said}): their rounds up to it are counted.")  # fmt: skip
    if lost:
        run.notes.append(f"{lost} spec.* spans are under no spec.session of this input ({ROTATED}); "
                         "they are left out.")  # fmt: skip
    if hidden := run.kinds["sessions_without_log"]:
        run.notes.append(f"{hidden} profiled sessions have rounds of their first {LOGGED} without "
                         "spans (or without k, j): their [spec-prof-summary] cannot be recomputed, "
                         "and they are left out of the slow-round count.")  # fmt: skip
    if short := run.kinds.pop("short_sessions", 0):
        run.notes.append(f"{short} sessions lack {run.kinds.pop('bursts_before')} of the bursts "
                         f"their spec.session spans count: {ROTATED}; their rounds are missing.")  # fmt: skip
    if gone := run.kinds.pop(LOST, 0):
        run.notes.append(f"{gone} rounds their spec.burst spans count have no spec.round span ({ROTATED}): "
                         "they carry their burst's remainder spread evenly, their k and j unknown.")  # fmt: skip
    if run.unsampled:
        run.notes.append(f"{run.unsampled} of {len(run.rounds)} rounds were past the span cap "
                         "(MEMRA_OBS_ROUND_SPANS) and have no spans: their phase times are their burst's"
                         " remainder spread evenly, their k and j unknown (left out of every token count).")  # fmt: skip


def _session(sid: int, tid: int, sp: Span, kids: Kids, run: Run) -> None:
    at, fam, before = sp[5], sp[5].get(A + "family", "unknown"), len(run.rounds.runs)
    if type(fam) is not str:  # an int among strings failed sorting them: no page at all
        raise ValueError(f"{A}family {fam!r} is not a string")
    run.sessions.append(SessionRecord(sid, fam, f"{fam}-phase", f"{fam}-phase-v",
                        at.get(A + "worker", ""), sp[3], 0, 0, tid, sp[1], sp[2],
                        at.get(A + "trace_level", 0), bool(at.get(A + "prof"))))  # fmt: skip
    if type(clock := at.get(A + "advice.clock")) is str:  # (with the profile on)
        run.clocks.add(clock)
    mine = sorted(kids.get(sp[1], []), key=lambda k: k[3])
    rounds = [r for b in mine if b[0] == "spec.burst" for r in _burst(sid, tid, b, kids, run)]
    run.first_tokens += [_first_token(sid, ft, kids) for ft in mine if ft[0] == "spec.first_token"]
    said, shown = at.get(A + "bursts", 0), sum(b[0] == "spec.burst" for b in mine)
    if type(said) is int and (short := said - at.get(A + "bursts_unsampled", 0) - shown) > 0:
        run.kinds.update(short_sessions=1, bursts_before=short)  # the rest are in FILE.1
    # The worker's round log, exactly: its rows are round_prof_from_ns of these stamps.
    logged = min(sum(r.repeat for r in run.rounds.runs[before:]), LOGGED)
    first = [r for r in rounds if r.index < LOGGED]
    if not at.get(A + "prof") or not logged:
        return
    if [r.index for r in first] != list(range(logged)) or any(r.k < 0 for r in first):
        run.kinds["sessions_without_log"] += 1  # the span cap (or a tail's spans) hid rows
        return
    rows = [records.round_prof_from_ns(r.wall_ns, *r.phase_ns()[:3], r.t_ns_mono[5] - r.t_ns_mono[3],
                               r.k, r.j, r.ctx, r.seq_rows) for r in first]  # fmt: skip
    line = parse_line(prof_summary_line(records.SpecRoundsLog(rounds=rows)))
    assert isinstance(line, SummaryLine)
    run.logs.append(RoundLog(rows, line, trace_id=tid))


#: The most k, j, ctx and seq_rows a worker writes (a round past the 64 rows is checked by none).
_TOPS = (records.U16_MAX, records.U16_MAX, records.U32_MAX, records.U32_MAX)
#: Rounds one burst span may claim (~9 h of 2 ms rounds): its rounds are expanded in memory.
MAX_ROUNDS = 1 << 24


def _burst(sid: int, tid: int, b: Span, kids: Kids, run: Run) -> list[RoundRecord]:
    """A burst span and its round spans (returned); rounds past the cap and refused round spans
    (no phase span, j outside 0..k) get its totals' remainder, spread evenly."""
    at, idx, rounds, bad = b[5], b[5].get(A + "burst", 0), list[RoundRecord](), list[Span]()
    for r in sorted((k for k in kids.get(b[1], ()) if k[0] == "spec.round"), key=lambda k: k[3]):
        ph, ra = {k[0][5:]: k for k in kids.get(r[1], ())}, r[5]
        kj = [ra.get(A + f, d) for f, d in (("k", -1), ("j", -1), ("ctx", 0), ("seq_rows", 0))]
        why = "lacks a phase span" if not all(p in ph for p in PHASES) else ""
        if not all(type(x) is int and -1 <= x <= t for x, t in zip(kj, _TOPS, strict=True)):
            why = f"has counts no worker writes (k, j, ctx, seq_rows = {kj!r})"
        elif kj[0] >= 0 and not 0 <= kj[1] <= kj[0]:
            why = f"has k={kj[0]}, j={kj[1]}: j must be in 0..k"
        t = (ph["draft"][3], *(ph[p][4] for p in PHASES)) if not why else ()
        if any(x > y for x, y in itertools.pairwise(t)):
            why = "has phase spans that end before they start or out of order"
        if why:
            run.refused.append((0, f"spec.round span {r[1]:016x} of trace {tid:032x} {why}", ""))
            bad.append(r)
            continue
        split = tuple(ph["verify"][5][a] for a in SPLIT) if SPLIT[0] in ph["verify"][5] else None
        rounds.append(RoundRecord._make((sid, idx, ra.get(A + "round", 0), t, *kj, split, 1)))
    n, u = at.get(A + "rounds", len(rounds) + len(bad)), at.get(A + "rounds_unsampled", 0)
    ints = [n, u, at.get(A + "first_round", 0), *(r.index for r in rounds)]
    ints += [r[5].get(A + "round", 0) for r in bad]
    if not (all(type(x) is int and 0 <= x < 1 << 32 for x in ints) and u <= n <= MAX_ROUNDS):
        raise ValueError(f"spec.burst {b[1]:016x}: rounds={n}, rounds_unsampled={u} or a round "
                         "index that is not a count")  # fmt: skip
    run.unsampled += u
    # rounds the burst counts that have no span, nor past the cap: records the worker dropped
    gone = max(n - u - len(rounds) - len(bad), 0)
    run.kinds[LOST] += gone
    u += gone  # both kinds: the burst's remainder, spread evenly
    own = [sum(r.phase_ns()[i] for r in rounds) for i in range(5)]
    tot = [at[f"{A}{p}_ns"] for p in PHASES] if f"{A}draft_ns" in at else own  # unfinished: own
    split = tuple(at[a] for a in SPLIT) if SPLIT[0] in at else None
    first = at.get(A + "first_round", rounds[0].index if rounds else 0)
    per = [max(x - y, 0) // max(u + len(bad), 1) for x, y in zip(tot, own, strict=True)]
    each = None if split is None else tuple(x // max(n, 1) for x in split)
    ts = itertools.accumulate(per, initial=rounds[-1].t_ns_mono[5] if rounds else b[3])
    rest = RoundRecord._make((sid, idx, first + n - u, (*ts,), -1, -1, 0, 0, each, u))
    run.rounds += [*rounds, rest] if u else rounds  # past the span cap (or dropped): one run
    for r in bad:  # a refused round span: the remainder's mean, at its own index
        bounds = (*itertools.accumulate(per, initial=r[3]),)
        run.rounds += [rest._replace(index=r[5].get(A + "round", 0), t_ns_mono=bounds, repeat=1)]
    phases = records.SpecPhaseNs(*tot, n)  # type: ignore[call-arg]
    run.bursts.append(BurstRecord(sid, idx, at.get(A + "k", 0), b[3], b[4], phases, split,
                                  at.get(A + "tokens", 0), at.get(A + "hook_ns", 0), first))  # fmt: skip
    return rounds


def _first_token(sid: int, ft: Span, kids: Kids) -> FirstTokenRecord:
    """Every SpecFirstTokenProf field from the span's attributes (the checking constructor
    refuses a bad one); the buckets' spans give the intervals, in the order they ran."""
    at, iv, fb = ft[5], list[tuple[str, int, int]](), list[tuple[str, int, int]]()
    kw: dict[str, Any] = {n: at[FT + n] for n in records.FIRST_TOKEN_FIELDS if FT + n in at}
    for name in ("free_mb_before", "free_mb_after"):
        kw[name] = list(zip(at.get(FT + name + "_devices", ()), kw.get(name, ()), strict=True))
    for k in kids.get(ft[1], ()):  # spec.first_token.<bucket>; round 1's under first_burst
        (fb if k[0].endswith(".first_burst") else iv).append((k[0][17:], k[3], k[4]))
        iv += [(c[0][17:], c[3], c[4]) for c in kids.get(k[1], ())]
    iv.sort(key=lambda x: x[1])
    return FirstTokenRecord(sid, records.SpecFirstTokenProf(**kw), (*iv, *fb))
