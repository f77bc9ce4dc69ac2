"""The ring file's layout (README, "Ring format") and the codec of its records. A slot is
``seq | meta | payload``: ``seq`` its absolute position + 1, ``meta`` ``rec << 16 | kind << 8 |
span``, ``rec`` numbering records so that losses count in records whatever their size. The
session table keeps each open session's SessionRecord for an agent that lost or never saw it.
Little-endian throughout; nothing here touches a file."""

from __future__ import annotations

import io
import struct
from typing import Any

from ..records import FIRST_TOKEN_FIELDS, FIRST_TOKEN_MS_FIELDS, SpecFirstTokenProf, SpecPhaseNs
from ..timeline import BurstRecord, FirstTokenRecord, RoundRecord, SessionEndRecord, SessionRecord

MAGIC, VERSION = b"MEMRAOBS", 2
HEADER, SLOT, SLOT_HDR = 4096, 128, 16
PAYLOAD = SLOT - SLOT_HDR
#: Largest record, in slots (a first-token profile with 16 devices' free memory takes 10).
MAXSPAN = 16
#: Ring sizes this version writes and reads (slots: MEMRA_OBS_RING_SLOTS's range).
MIN_SLOTS, MAX_SLOTS, MAX_TABLE = 4 * MAXSPAN, 1 << 24, 1 << 16
TABLE_ENTRY, TABLE_HDR = 256, 24
KIND_CONT, KIND_SESSION, KIND_ROUND, KIND_ROUND_SPLIT = 0, 1, 2, 3
KIND_BURST, KIND_BURST_SPLIT, KIND_FIRST_TOKEN, KIND_SESSION_END = 4, 5, 6, 7

#: magic, version, slot size, slots, maxspan, table entries, entry size, data offset, writer
#: pid, created (epoch ns), worker label (u8 length + 63 bytes).
IDENT = struct.Struct("<8sIIIIIIIIQB63s")
#: The writer's line at 192: positions published (``head``), records published (``rec_next``);
#: its stats at 256: records refused, sessions not in the table, closed flag, and at 280 the
#: loop's rounds dropped for misuse (zero in older writers: spare space); all as one.
OFF_HEAD, HEAD, OFF_WSTAT, WSTAT = 192, struct.Struct("<QQ"), 256, struct.Struct("<QQI")
OFF_ROUNDS, STATE = 280, struct.Struct("<QQ48xQQI4xQ")
#: The reader's line: the cursor (next position, next record), lost, agent pid.
OFF_READER, READER = 320, struct.Struct("<QQQQ")
U64, SLOT_HEAD = struct.Struct("<Q"), struct.Struct("<QQ")
#: A round, slot header included (the writer packs it in one go): seq, meta, session, burst,
#: index, t0..t5, k, j, ctx, seq_rows (+ the level-2 split).
ROUND, ROUND_SPLIT = struct.Struct("<QQQII6QIIII"), struct.Struct("<QQQII6QIIII4Q")
#: Table entry: seq (its SessionRecord's position + 1; 0 = free), session id, payload length.
TABLE_ENTRY_HEAD = struct.Struct("<QQQ")


class Geometry:
    """Offsets of one ring, from its slot count and table size (the table starts at HEADER)."""

    __slots__ = ("data_off", "mask", "size", "slots", "table_entries")

    def __init__(self, slots: int, table_entries: int) -> None:
        if not MIN_SLOTS <= slots <= MAX_SLOTS or slots & (slots - 1) or table_entries > MAX_TABLE:
            raise ValueError(f"ring of {slots} slots and {table_entries} sessions: expected a "
                             f"power of two in {MIN_SLOTS}..{MAX_SLOTS} and at most {MAX_TABLE}")  # fmt: skip
        self.slots, self.mask, self.table_entries = slots, slots - 1, table_entries
        # Page-aligned slots: the hot writes never share a page with the table.
        self.data_off = -(-(HEADER + table_entries * TABLE_ENTRY) // 4096) * 4096
        self.size = self.data_off + slots * SLOT


# -- codec: payloads are what follows the slot headers, joined over a record's slots -------

_SESSION, _BURST, _END = struct.Struct("<8QBBB"), struct.Struct("<QIIQQ6QQQQ"), struct.Struct("<5Q")
_SPLIT, _STR, _PAIR = struct.Struct("<4Q"), struct.Struct("<H"), struct.Struct("<QQ")
_ROUND_BODY = struct.Struct("<QII6QIIII")
#: Every other field of SpecFirstTokenProf is a count (u64).
_NOT = {*FIRST_TOKEN_MS_FIELDS, "draft_prime_arm", "draft_kv_mb", "free_mb_before", "free_mb_after"}
_FT_COUNT_FIELDS = tuple(f for f in FIRST_TOKEN_FIELDS if f not in _NOT)
_FT_MS = struct.Struct(f"<{len(FIRST_TOKEN_MS_FIELDS)}d")
_FT_COUNTS = struct.Struct(f"<{len(_FT_COUNT_FIELDS)}Qd")


def _s(text: str, cap: int = 0xFFFF) -> bytes:
    """``text`` as u16 length + UTF-8 (an unencodable character as ``?``), cut to ``cap``
    bytes at a character boundary."""
    b = text.encode("utf-8", "replace")
    if len(b) > cap:
        b = b[: max(0, cap)].decode("utf-8", "ignore").encode()
    return _STR.pack(len(b)) + b


def _take(f: io.BytesIO, s: struct.Struct) -> tuple[Any, ...]:
    """The next ``s`` in ``f``; running off the payload's end raises (a damaged record)."""
    return s.unpack(f.read(s.size))


def _text(f: io.BytesIO) -> str:
    (n,) = _take(f, _STR)
    return _take(f, struct.Struct(f"{n}s"))[0].decode("utf-8")


def encode(r: Any, in_table: bool = False) -> tuple[int, bytes]:
    """``(kind, payload)`` of a record; raises on a value the format cannot hold (the writer
    counts those as refused). ``in_table``: the writer's table will show this session's end."""
    t = type(r)
    if t is RoundRecord:
        sid, burst, index, ts, k, j, ctx, seq_rows, split, _ = r
        body = _ROUND_BODY.pack(sid, burst, index, *ts, k, j, ctx, seq_rows)
        if split is None:
            return KIND_ROUND, body
        return KIND_ROUND_SPLIT, body + _SPLIT.pack(*split)
    if t is BurstRecord:
        p, split = r.phases, r.split_ns
        body = _BURST.pack(r.session, r.index, r.k, r.start_ns_mono, r.end_ns_mono, p.draft,
                           p.verify, p.accept, p.roll, p.maint, p.rounds, r.tokens, r.hook_ns,
                           r.first_round)  # fmt: skip
        if split is None:
            return KIND_BURST, body
        return KIND_BURST_SPLIT, body + _SPLIT.pack(*split)
    if t is SessionRecord:
        c = r.caller_trace_id  # after the strings, only when there is one (a session stays 1 slot)
        return KIND_SESSION, _SESSION.pack(
            r.session, r.start_ns_mono, r.anchor_ns_mono, r.anchor_ns_epoch, r.trace_id >> 64,
            r.trace_id & (1 << 64) - 1, r.span_id, r.parent_span_id, r.level, r.prof, in_table,
        ) + b"".join(_s(x) for x in (r.family, r.tag, r.tag_v, r.worker, r.clock)) + (
            _PAIR.pack(c >> 64, c & (1 << 64) - 1) if c else b"")  # fmt: skip
    if t is FirstTokenRecord:
        p = r.prof
        out = [U64.pack(r.session), _FT_MS.pack(*(getattr(p, f) for f in FIRST_TOKEN_MS_FIELDS)),
               _FT_COUNTS.pack(*(getattr(p, f) for f in _FT_COUNT_FIELDS), p.draft_kv_mb),
               _s(p.draft_prime_arm)]  # fmt: skip
        for pairs in (p.free_mb_before, p.free_mb_after):
            out += [_STR.pack(len(pairs)), *(_PAIR.pack(o, mb) for o, mb in pairs)]
        out += [_STR.pack(len(r.intervals)), *(_s(n) + _PAIR.pack(a, b) for n, a, b in r.intervals)]
        return KIND_FIRST_TOKEN, b"".join(out)
    if t is SessionEndRecord:
        # A long error (an exception's message) is cut to fit, never the whole end refused.
        advice = _s(r.advice)
        room = MAXSPAN * PAYLOAD - _END.size - _STR.size - len(advice)
        return KIND_SESSION_END, _END.pack(r.session, r.end_ns_mono, r.rounds, r.bursts,
                                           r.tokens) + _s(r.error, room) + advice  # fmt: skip
    raise TypeError(f"{t.__name__} does not travel through the ring")


def decode(kind: int, payload: bytes) -> Any:
    """The record of ``kind`` in ``payload`` (a SessionRecord comes back as ``(record,
    in_table)``); raises on an unknown kind or a payload that does not parse."""
    f = io.BytesIO(payload)
    if kind in (KIND_ROUND, KIND_ROUND_SPLIT):
        sid, burst, index, *ts, k, j, ctx, seq = _take(f, _ROUND_BODY)
        split = _take(f, _SPLIT) if kind == KIND_ROUND_SPLIT else None
        return RoundRecord(sid, burst, index, tuple(ts), k, j, ctx, seq, split)
    if kind in (KIND_BURST, KIND_BURST_SPLIT):
        sid, index, k, start, end, *phases, tokens, hook, first = _take(f, _BURST)
        split = _take(f, _SPLIT) if kind == KIND_BURST_SPLIT else None
        phases_ns = SpecPhaseNs(*phases)
        return BurstRecord(sid, index, k, start, end, phases_ns, split, tokens, hook, first)
    if kind == KIND_SESSION:
        sid, start, am, ae, thi, tlo, span, parent, level, prof, in_table = _take(f, _SESSION)
        family, tag, tag_v, worker, clock = (_text(f) for _ in range(5))
        chi, clo = _take(f, _PAIR) if len(payload) - f.tell() >= _PAIR.size else (0, 0)
        rec = SessionRecord(sid, family, tag, tag_v, worker, start, am, ae, thi << 64 | tlo, span,
                            parent, level, bool(prof), clock, chi << 64 | clo)  # fmt: skip
        return rec, bool(in_table)
    if kind == KIND_FIRST_TOKEN:
        (sid,) = _take(f, U64)
        kw: dict[str, Any] = dict(zip(FIRST_TOKEN_MS_FIELDS, _take(f, _FT_MS), strict=True))
        *counts, kw["draft_kv_mb"] = _take(f, _FT_COUNTS)
        kw.update(zip(_FT_COUNT_FIELDS, counts, strict=True), draft_prime_arm=_text(f))
        for name in ("free_mb_before", "free_mb_after"):
            kw[name] = [_take(f, _PAIR) for _ in range(_take(f, _STR)[0])]
        ivs = tuple((_text(f), *_take(f, _PAIR)) for _ in range(_take(f, _STR)[0]))
        return FirstTokenRecord(sid, SpecFirstTokenProf(**kw), ivs)
    if kind == KIND_SESSION_END:
        sid, end, rounds, bursts, tokens = _take(f, _END)
        return SessionEndRecord(sid, end, rounds, bursts, tokens, _text(f), _text(f))
    raise ValueError(f"no record kind {kind}")
