"""A span file (OTLP-JSON lines this package wrote) -> the records the spans were built from.

The tree is DESIGN §4's (:mod:`memra_obs.otel.spans`): ``spec.session`` > ``spec.burst`` >
``spec.round`` > five back-to-back phase spans, and ``spec.first_token`` with its buckets.
Phase spans give each round's six boundaries exactly; burst spans carry the burst's phase
totals. Rounds past the span cap (``memra.spec.rounds_unsampled``) have no spans: they are
rebuilt as a log's rounds without rows are, their burst's remainder spread evenly, k and j
unknown (-1), and the page says how many there were.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..legacy import SummaryLine, parse_line
from ..records import (
    FIRST_TOKEN_FIELDS,
    SPEC_PROF_ROUNDS,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundsLog,
    round_prof_from_ns,
)
from ..timeline import BurstRecord, FirstTokenRecord, RoundRecord, SessionEndRecord, SessionRecord
from .inputs import RoundLog, Run

__all__ = ["read_spans"]

A, FT = "memra.spec.", "memra.spec.first_token."
PHASE_SPANS = ("spec.draft", "spec.verify", "spec.accept", "spec.rollback", "spec.maint")
PHASE_ATTRS = tuple(A + p + "_ns" for p in ("draft", "verify", "accept", "rollback", "maint"))
SPLIT_ATTRS = tuple(A + "verify." + p + "_ns" for p in ("kda", "kda_scan", "mla", "ffn"))
#: name, span id, parent id, start, end (epoch ns), attributes
Span = tuple[str, int, int, int, int, dict[str, Any]]


def _value(v: dict[str, Any]) -> Any:
    """An OTLP-JSON AnyValue (64-bit ints arrive as strings)."""
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return tuple(_value(x) for x in v["arrayValue"].get("values", ()))
    return v.get("stringValue", v.get("boolValue"))


def read_spans(lines: Iterable[str], run: Run) -> None:
    """Every ``spec.*`` span of every line, then one session's subtree at a time."""
    kids: dict[int, list[Span]] = {}
    roots: list[tuple[int, Span]] = []
    for n, line in enumerate(lines, 1):
        run.lines = n
        try:
            for rs in json.loads(line)["resourceSpans"] if line.strip() else ():
                for s in (s for ss in rs["scopeSpans"] for s in ss["spans"]):
                    if s["name"].startswith("spec."):
                        at = {a["key"]: _value(a["value"]) for a in s.get("attributes", ())}
                        pid = int(s.get("parentSpanId") or "0", 16)
                        start, end = int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])
                        sp = (s["name"], int(s["spanId"], 16), pid, start, end, at)
                        kids.setdefault(pid, []).append(sp)
                        if sp[0] == "spec.session":
                            roots.append((int(s["traceId"], 16), sp))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            run.refused.append((n, f"not an OTLP-JSON trace request ({exc!r})", line[:160]))
    run.kinds["spans"] = sum(map(len, kids.values()))
    for sid, (tid, sp) in enumerate(roots, 1):
        try:
            _session(sid, tid, sp, kids, run)
        except (TypeError, ValueError, KeyError) as exc:
            run.refused.append((0, f"session span {sp[1]:016x} refused: {exc!r}", ""))
    if run.kinds["sessions_without_log"]:
        run.notes.append(
            f"{run.kinds['sessions_without_log']} profiled sessions have rounds of their first "
            f"{SPEC_PROF_ROUNDS} without spans (or without k, j): their [spec-prof-summary] "
            "cannot be recomputed, and they are left out of the slow-round count."
        )
    if run.unsampled:
        run.notes.append(
            f"{run.unsampled} of {len(run.rounds)} rounds were past the span cap "
            "(MEMRA_OBS_ROUND_SPANS) and have no spans: their phase times are their burst's "
            "remainder spread evenly, their k and j unknown (left out of every token count)."
        )


def _session(sid: int, tid: int, sp: Span, kids: dict[int, list[Span]], run: Run) -> None:
    _, span_id, parent, start, end, at = sp
    fam = at.get(A + "family", "unknown")
    prof = bool(at.get(A + "prof"))
    level = at.get(A + "trace_level", 0)
    run.sessions.append(SessionRecord(sid, fam, f"{fam}-phase", f"{fam}-phase-v",
                        at.get(A + "worker", ""), start, 0, 0, tid, span_id, parent, level, prof))  # fmt: skip
    mine = kids.get(span_id, [])
    rounds: list[RoundRecord] = []
    before = len(run.rounds)
    for b in sorted((k for k in mine if k[0] == "spec.burst"), key=lambda k: k[3]):
        rounds += _burst(sid, b, kids, run)
    logged = min(len(run.rounds) - before, SPEC_PROF_ROUNDS)  # rows the worker's log kept
    for ft in (k for k in mine if k[0] == "spec.first_token"):
        run.first_tokens.append(_first_token(sid, ft, kids))
    if A + "rounds" in at:  # unfinished sessions (process exit) carry no totals
        run.ends.append(SessionEndRecord(sid, end, at[A + "rounds"], at.get(A + "bursts", 0),
                                         at.get(A + "tokens", 0), at.get("error.type", "")))  # fmt: skip
    # The worker's round log, exactly: its rows are round_prof_from_ns of these stamps.
    first = [r for r in rounds if r.index < SPEC_PROF_ROUNDS]
    if not prof or not logged:
        return
    if [r.index for r in first] != list(range(logged)) or any(r.k < 0 for r in first):
        run.kinds["sessions_without_log"] += 1  # the span cap (or a tail's spans) hid rows
        return
    rows = [round_prof_from_ns(r.wall_ns, *r.phase_ns()[:3], r.t_ns_mono[5] - r.t_ns_mono[3],
                               r.k, r.j, r.ctx, r.seq_rows) for r in first]  # fmt: skip
    line = parse_line(f"[spec-prof-summary] {SpecRoundsLog(rounds=rows).summary()}")
    assert isinstance(line, SummaryLine)
    run.logs.append(RoundLog(rows, line))


def _burst(sid: int, b: Span, kids: dict[int, list[Span]], run: Run) -> list[RoundRecord]:
    """A burst span and its round spans; rounds past the cap from the burst's totals."""
    at = b[5]
    idx = at.get(A + "burst", 0)
    rounds: list[RoundRecord] = []
    for r in sorted((k for k in kids.get(b[1], ()) if k[0] == "spec.round"), key=lambda k: k[3]):
        ph = {k[0]: k for k in kids.get(r[1], ())}
        if not all(p in ph for p in PHASE_SPANS):
            run.refused.append((0, f"spec.round span {r[1]:016x} lacks a phase span", ""))
            continue
        ra, va = r[5], ph["spec.verify"][5]
        split = tuple(va[a] for a in SPLIT_ATTRS) if SPLIT_ATTRS[0] in va else None
        t = (ph["spec.draft"][3], *(ph[p][4] for p in PHASE_SPANS))
        kj = (
            ra.get(A + "k", -1),
            ra.get(A + "j", -1),
            ra.get(A + "ctx", 0),
            ra.get(A + "seq_rows", 0),
        )
        rounds.append(RoundRecord._make((sid, idx, ra.get(A + "round", 0), t, *kj, split, 1)))
    n = at.get(A + "rounds", len(rounds))
    own = [sum(r.phase_ns()[i] for r in rounds) for i in range(5)]
    tot = [at[a] for a in PHASE_ATTRS] if PHASE_ATTRS[0] in at else own  # unfinished: its rounds
    split = tuple(at[a] for a in SPLIT_ATTRS) if SPLIT_ATTRS[0] in at else None
    first = at.get(A + "first_round", rounds[0].index if rounds else 0)
    run.rounds += rounds
    u = at.get(A + "rounds_unsampled", 0)
    t0 = rounds[-1].t_ns_mono[5] if rounds else b[3]
    per = [max(x - y, 0) // max(u, 1) for x, y in zip(tot, own, strict=True)]
    each = None if split is None else tuple(x // max(n, 1) for x in split)
    for i in range(u):  # past the span cap: the burst's remainder, evenly
        ts = [t0]
        for d in per:
            ts.append(ts[-1] + d)
        run.rounds.append(
            RoundRecord._make((sid, idx, first + n - u + i, tuple(ts), -1, -1, 0, 0, each, 1))
        )
        t0 = ts[-1]
    run.unsampled += u
    phases = SpecPhaseNs(*tot, n)  # type: ignore[call-arg]
    run.bursts.append(BurstRecord._make((sid, idx, at.get(A + "k", 0), b[3], b[4], phases, split,
                                         at.get(A + "tokens", 0), at.get(A + "hook_ns", 0), first)))  # fmt: skip
    return rounds


def _first_token(sid: int, ft: Span, kids: dict[int, list[Span]]) -> FirstTokenRecord:
    """Every SpecFirstTokenProf field from the span's attributes (the checking constructor
    refuses a bad one); the buckets' spans give the intervals, in the order they ran."""
    at = ft[5]
    kw: dict[str, Any] = {n: at[FT + n] for n in FIRST_TOKEN_FIELDS if FT + n in at}
    for name in ("free_mb_before", "free_mb_after"):
        kw[name] = list(zip(at.get(FT + name + "_devices", ()), kw.get(name, ()), strict=True))
    iv: list[tuple[str, int, int]] = []
    fb: list[tuple[str, int, int]] = []
    for k in kids.get(ft[1], ()):
        if k[0] == "spec.first_token.first_burst":
            fb.append(("first_burst", k[3], k[4]))
            iv += [(c[0][17:], c[3], c[4]) for c in kids.get(k[1], ())]
        else:
            iv.append((k[0][17:], k[3], k[4]))
    return FirstTokenRecord(
        sid, SpecFirstTokenProf(**kw), tuple(sorted(iv, key=lambda x: x[1]) + fb)
    )
