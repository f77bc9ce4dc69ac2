"""The one parser of the legacy lines: every reader (the tail, the report, tests) goes
through :func:`parse_line`. A regex per shape, then the record."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from ..records import _FT_FLOAT, _FT_FREE, FIRST_TOKEN_FIELDS, SpecFirstTokenProf, round_prof
from .lines import (
    ADVICE,
    ADVICE_TAG,
    OVERRIDE,
    PHASE,
    PROF,
    PROF_ROUNDS,
    PROF_ROUNDS_TAG,
    PROF_SUMMARY,
    PROF_SUMMARY_TAG,
    PROF_TAG,
    TRACE_TAG,
    VERIFY,
    AdviceLine,
    FirstTokenLine,
    LegacyLine,
    OverrideLine,
    PhaseLine,
    RoundsLine,
    SummaryLine,
    VerifyLine,
)

__all__ = ["MAX_TAG", "CriJoin", "LegacyParseError", "parse_line", "taggable"]


class LegacyParseError(ValueError):
    """A line with a legacy tag but not its shape; ``kind``: the kind it claims (for counts)."""

    def __init__(self, line: str, reason: str, kind: str = PHASE) -> None:
        if len(reason) > 200:  # it quotes a value of the line: a 300 KB one, a 300 KB note
            reason = reason[:197] + "..."
        super().__init__(f"{reason}: {line[:200]!r}")
        self.line, self.reason, self.kind = line, reason, kind


# Possessive where the interpreter has it (3.11+; the shapes never give a digit back): fewer
# steps, same language. Python 3.10's re refuses the syntax.
_P = "+" if sys.version_info >= (3, 11) else ""
_N = rf"(0|[1-9][0-9]*{_P})"
_F = rf"(-?[0-9]+{_P}\.[0-9]+{_P})"
# The seed's {:.1} / {:.2} / {:.3}: exactly that many decimals, so a line cut inside its last
# figure ("total=41.9" of "total=41.947") is refused as truncated, not read as another value.
_F1, _F2, _F3 = (rf"(-?[0-9]+{_P}\.[0-9]{{{n}}})" for n in (1, 2, 3))
#: A tag's most characters (the seed's: a family and ``-phase``/``-phase-v``): a longer one is
#: refused, so no line carries a label of any size onto /metrics.
MAX_TAG = 64
#: Tag prefixes of this parser's own lines: a phase line under one is refused.
RESERVED = ("spec-prof", "spec-trace", "spec-advice")
_RESERVED_HEAD = tuple("[" + r for r in RESERVED)
#: The observer writes no bracket in a tag: a tag reads the same with a collector's prefix
#: before it as without (read so, ``[qwen[mtp_-phase]`` is ``mtp_-phase``). A foreign tag
#: with one reads as it always did, but for a colour code whose ESC a collector cut
#: (``[33m[glm5-phase] ...``: ``glm5-phase`` behind a prefix, not family ``33m[glm5``).
_UNTAGGABLE = re.compile(r"[\[\]\s\x00-\x1f\x7f\ud800-\udfff]")
_TAG_HEAD = re.compile(rf"\[(?![0-9;]*m\[)([^\]\s]{{1,{MAX_TAG}}}{_P})\] ").match
_LONG_TAG = re.compile(rf"\[(?![0-9;]*m\[)[^\]\s]{{{MAX_TAG + 1},}}\] rounds=").match
_PHASE = re.compile(
    rf"rounds={_N} k={_N} total={_F2}ms \| draft={_F2} verify={_F2} accept={_F2} roll={_F2} "
    rf"maint={_F2} \| per-round ms: draft={_F3} verify={_F3} accept={_F3} roll={_F3} "
    rf"maint={_F3} total={_F3}"
).fullmatch
#: A seed from before lane/glm5-vrest prints no ``(vffn=...)``: read as 0.000.
_VERIFY = re.compile(
    rf"rounds={_N} k={_N} \| per-round ms: vkda={_F3} \(scan={_F3}\) vmla={_F3} vrest={_F3}"
    rf"(?: \(vffn={_F3}\))?"
).fullmatch
_SUMMARY = re.compile(
    rf"rounds={_N} k_mean={_F2} j_mean={_F2} accept={_F3} tok_per_round={_F2} "
    rf"wall_ms mean={_F1} min={_F1} med={_F1} max={_F1} slow_rounds\(>1\.5x med\)={_N} "
    rf"draft_mean={_F1} verify_mean={_F1} seq_rows_total={_N} ctx_first={_N} ctx_last={_N}"
).fullmatch
_OVERRIDE = re.compile(
    r"MEMRA_SPEC_TRACE=([12]) overrides MEMRA_GLM5_SPEC_TRACE=([12]) "
    r"\(the general flag wins; unset one to silence this\)"
).fullmatch
_ROW = re.compile(
    rf"row={_N} wall_ms={_F} draft_ms={_F} verify_ms={_F} accept_ms={_F} rest_ms={_F} "
    rf"k={_N} j={_N} ctx={_N} seq_rows={_N}"
).fullmatch
_FREE = re.compile(r"\[((?:[0-9]+:[0-9]+)(?:,[0-9]+:[0-9]+)*)?\]").fullmatch
_FLOAT = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?").fullmatch
_COUNT = re.compile(_N).fullmatch
_FT_NAMES = list(FIRST_TOKEN_FIELDS)
_ROW_HEAD = f"[{PROF_ROUNDS_TAG}] "
_ROW_AT = len(_ROW_HEAD)
_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__
_INF = float("inf")
#: The project's own tags: a line under a damaged one is refused, never passed off as foreign.
_OWN_TAGS = {
    PROF_ROUNDS_TAG: PROF_ROUNDS,
    PROF_SUMMARY_TAG: PROF_SUMMARY,
    PROF_TAG: PROF,
    TRACE_TAG: OVERRIDE,
    ADVICE_TAG: ADVICE,
}
_IV = r"([0-9]+\.[0-9]+|inf) \(([0-9]+\.[0-9]+|inf)\.\.([0-9]+\.[0-9]+|inf)\)"
_ADVICE = re.compile(
    rf"\(estimate\) rounds={_N} clock=([a-z]+) k_now=([0-9]+\.[0-9]+) k_rec={_N} "
    rf"tokens_per_round={_IV} tokens_per_s={_IV} speedup={_IV} "
    r"plain_step_ms=([0-9]+\.[0-9]+) \(([a-z_]+)\)"
).fullmatch
#: Where a legacy line starts behind a log collector's prefix (see _behind_prefix): one of our
#: tags, or a phase tag and its body (no "[" in a tag, at most MAX_TAG: one pass over any line).
_WRAPPED = re.compile(
    r"\[spec-(?:prof-rounds|prof-summary|prof|trace|advice)\] "
    rf"|\[[^\[\]\s]{{1,{MAX_TAG}}}\] rounds="
).search
_CSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]").sub
_MESSAGE = ("log", "message", "MESSAGE", "line")  # a JSON record's line (see _behind_prefix)
_BLOB = re.compile(r'"MESSAGE" ?: ?\[').search
#: A CRI log line's head (/var/log/pods): its time, its stream, and ``P`` (a part: the line goes
#: on in the stream's next line) or ``F`` (the line ends here).
_CRI_HEAD = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[^ ]+ (stdout|stderr) ([PF]) ").match


def taggable(t: str, room: int = MAX_TAG) -> str:
    """``t`` as a tag this parser takes back: a space, a control character, a bracket or a lone
    surrogate (an undecodable byte: no UTF-8 carries it to /metrics) becomes ``_``, one of the
    :data:`RESERVED` prefixes gets an ``x`` before it, and it is cut to ``room`` characters."""
    t = _UNTAGGABLE.sub("_", t)
    return ("x" + t if t.startswith(RESERVED) else t)[:room]


def parse_line(line: str, _glued: bool = False) -> LegacyLine | None:
    """A record for a legacy line, ``None`` for anyone else's line; :class:`LegacyParseError`
    for a line with a legacy tag or shape that is malformed or truncated."""
    if line[:1] != "[":  # the common case for other programs' lines: one slice, one search
        return _behind_prefix(line, line)
    text = line.rstrip("\r\n")
    try:
        if text.startswith(_ROW_HEAD):  # most legacy lines are rows: fullmatch in place
            r = _ROW(text, _ROW_AT)
            if r is None:
                raise LegacyParseError(
                    line, "[spec-prof-rounds] row truncated or malformed", PROF_ROUNDS
                )
            i, w, d, v, a, e, k, j, c, q = r.groups()
            # A bad value is refused by the record, naming the field (said below).
            prof = round_prof(
                float(w), float(d), float(v), float(a), float(e), int(k), int(j), int(c), int(q)
            )
            return _tuple_new(RoundsLine, (int(i), prof))
        m = _TAG_HEAD(text)
        if m is None:
            if text.startswith(_RESERVED_HEAD):  # (another program's "[spec-decode]:" passes)
                raise LegacyParseError(line, "tag without a body", _claimed(text))
            if _LONG_TAG(text):
                raise LegacyParseError(line, f"a tag over {MAX_TAG} characters", _claimed(text))
            return _behind_prefix(line, text[1:])  # "[2026-12-04 23:30:04] [glm5-phase] ..."
        tag, at = m.group(1), m.end()  # the body: text[at:], matched in place (no copy)
        kind = _OWN_TAGS.get(tag)
        if kind is not None:
            return _own(line, kind, text[at:])
        if tag.startswith(RESERVED):
            raise LegacyParseError(line, f"unknown tag [{tag}]", _claimed(text))
        if not text.startswith("rounds=", at):
            return _behind_prefix(line, text[at:])  # another program's tag, kubectl's [pod/p/c]
        if "\ufffd" in tag:  # a byte that is not UTF-8: no family of its own on /metrics
            raise LegacyParseError(line, "invalid UTF-8 in the tag", PHASE)
        if " total=" in text:  # as in the body: the head's one space precedes "rounds="
            p = _PHASE(text, at)
            if p is None:
                raise LegacyParseError(line, "phase line truncated or malformed", PHASE)
            g = p.groups()
            return PhaseLine(tag, int(g[0]), int(g[1]), *_durations(line, g[2:], PHASE))
        if "| per-round ms: vkda=" in text:
            v = _VERIFY(text, at)
            if v is None:
                raise LegacyParseError(line, "verify sub-split line truncated or malformed", VERIFY)
            g = v.groups("0.000")
            return VerifyLine(tag, int(g[0]), int(g[1]), *_durations(line, g[2:], VERIFY))
        raise LegacyParseError(line, "tagged rounds= line of no known shape", PHASE)
    except ValueError as exc:  # (LegacyParseError too) a record (or int()) refused a value
        err = exc if isinstance(exc, LegacyParseError) else LegacyParseError(line, str(exc), _claimed(text))  # fmt: skip
    if not _glued and (rec := _glued_on(text)) is not None:
        return rec
    raise err


def _glued_on(text: str) -> LegacyLine | None:
    """A line cut short (its worker killed mid-write) with the next worker's first line glued
    on (``2>>``): the whole line at its end, as behind any other prefix. Looked for once: a line
    of thousands of tags is one search, not one a tag (a recursion past Python's limit)."""
    if (m := _WRAPPED(text, 1)) is None:
        return None
    try:
        return parse_line(text[m.start() :], True)
    except LegacyParseError:
        return None


def _behind_prefix(line: str, rest: str) -> LegacyLine | None:
    """The legacy line in ``rest`` (of ``line``) behind what a log collector puts first: a
    timestamp, ``kubectl logs --prefix``'s ``[pod/p/c] ``, CRI's ``<time> stderr F ``, a JSON
    record's ``log`` (Docker, Fluent Bit), ``message`` (Vector, stern), ``MESSAGE`` (journald),
    ``line`` (logcli): they read as no line at all. Only a whole, well-formed line is taken."""
    if rest[:1] == "{" and (_WRAPPED(rest) or _BLOB(rest)):  # a JSON record: a field holds it
        try:  # journald's MESSAGE with a \r or an escape code in it is its bytes, as numbers
            rec = json.loads(rest)
            v = next(rec[k] for k in _MESSAGE if k in rec)
            rest = bytes(v).decode("utf-8", "replace") if isinstance(v, list) else str(v)
        except (ValueError, TypeError, RecursionError, StopIteration):  # "[[[..." a mile deep
            return None
    if "\x1b" in rest:  # a coloured line: its escape codes are no part of the legacy line
        rest = _CSI("", rest)
    if (m := _WRAPPED(rest)) is None:
        return None
    try:  # the found line is never searched again: it starts with a tag that claims it
        return parse_line(rest[m.start() :])
    except LegacyParseError:  # a damaged line behind a prefix may be anyone's (a grep of a
        return None  # tag, a log of this tail's own notes): not claimed, not refused


class CriJoin:
    """A CRI log's ``P`` parts joined to their ``F`` line, as the kubelet joins them (CRI-O's
    conmon writes a part at each read of the pipe, containerd past 16 KiB), and so are Docker
    json-file's records whose ``log`` lacks its newline (cut at 16 KiB): alone, a part is a
    damaged line behind a prefix, its round lost unsaid. A call holds a part (per stream, up to
    ``limit`` characters: a longer line reads as nothing, counted in ``overlong`` for its reader
    to say) and returns ``""``; the line that ends it comes back whole (a Docker line as its
    bare text), any other line as it is."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self.limit, self.overlong = limit, 0
        self._held: dict[str, str | None] = {}  # a stream's parts so far; None: past the limit

    def __call__(self, line: str) -> str:
        if m := _CRI_HEAD(line):
            stream, head, body, last = m.group(1), line[: m.end()], line[m.end() :], m.group(2)
        elif line[:8] != '{"log":"' or ('\\n","stream":"' in line and not self._held):
            return line  # not a part (one substring search for a whole Docker record)
        else:
            try:
                rec = json.loads(line)
                stream, head, body = rec["stream"], "", rec["log"]
                last = "F" if body.endswith("\n") else "P"
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
                return line
            if stream not in ("stdout", "stderr"):  # Docker's two: held, other names a part each
                return line
            stream = "docker " + stream
        held = self._held.pop(stream, "")
        if last == "P":
            part = None if held is None else held + body
            self._held[stream] = part if part is None or len(part) <= self.limit else None
            return ""
        if held is None:  # the end of a line past the limit: nobody's legacy line
            self.overlong += 1
            return ""
        return head + held + body if held else line


def _durations(line: str, values: Sequence[str], kind: str) -> tuple[float, ...]:
    """Printed ms values as floats: no clock gives a negative or an infinite one."""
    out = tuple(map(float, values))
    ends = sorted(out)  # both ends in one call (min() and max() each parse their arguments)
    if ends[0] < 0.0 or ends[-1] == _INF:
        raise LegacyParseError(line, "a negative or infinite duration (no clock gives one)", kind)
    return out


def _claimed(text: str) -> str:
    """The kind a damaged tagged line claims to be (for counting it)."""
    for tag, kind in _OWN_TAGS.items():
        if text.startswith("[" + tag):
            return kind
    return VERIFY if "vkda=" in text else PHASE


def _own(line: str, kind: str, body: str) -> LegacyLine:
    """A line under one of the project's tags but a row's (parse_line takes those first)."""
    if kind is PROF:
        return FirstTokenLine(_prof(line, body))
    if kind is PROF_SUMMARY:
        if body == "rounds=0":
            return SummaryLine(0)
        if (m := _SUMMARY(body)) is None:
            raise LegacyParseError(line, "[spec-prof-summary] truncated or malformed", PROF_SUMMARY)
        g = m.groups()
        f = _durations(line, (*g[1:9], g[10], g[11]), PROF_SUMMARY)
        return SummaryLine._make((int(g[0]), *f[:8], int(g[9]), *f[8:], *map(int, g[12:])))
    if kind is ADVICE:
        if (a := _ADVICE(body)) is None:
            raise LegacyParseError(line, "[spec-advice] truncated or malformed", ADVICE)
        g = a.groups()
        v = [float(x) for x in g[4:13]]
        iv = (v[0], v[1], v[2]), (v[3], v[4], v[5]), (v[6], v[7], v[8])
        return AdviceLine(int(g[0]), g[1], float(g[2]), int(g[3]), *iv, float(g[13]), g[14])
    if (o := _OVERRIDE(body)) is None:
        raise LegacyParseError(line, "not the flag-override line", OVERRIDE)
    return OverrideLine(int(o.group(1)), int(o.group(2)))


def _prof(line: str, body: str) -> SpecFirstTokenProf:
    pairs = body.split(" ")
    names = [p.partition("=")[0] for p in pairs]
    if names == _FT_NAMES[:-1]:  # a line from before the last field (unattributed_ms) was
        pairs.append("unattributed_ms=0.0")
        names = _FT_NAMES
    if names != _FT_NAMES:
        missing = [n for n in FIRST_TOKEN_FIELDS if n not in names]
        reason = f"missing {missing[0]}" if missing else "fields out of order or unknown"
        raise LegacyParseError(line, f"[spec-prof] {reason}", PROF)
    kw: dict[str, Any] = {}
    for name, pair in zip(FIRST_TOKEN_FIELDS, pairs, strict=True):
        v = pair.partition("=")[2]
        if name in _FT_FLOAT:
            if not _FLOAT(v):
                raise LegacyParseError(line, f"{name}={v!r} is not a number", PROF)
            kw[name] = float(v)
        elif name in _FT_FREE:
            if _FREE(v) is None:
                raise LegacyParseError(line, f"{name}={v!r} is not [ordinal:free_mb,...]", PROF)
            kw[name] = [tuple(map(int, x.split(":"))) for x in filter(None, v[1:-1].split(","))]
        elif name == "draft_prime_arm":
            kw[name] = v
        else:
            if not _COUNT(v):
                raise LegacyParseError(line, f"{name}={v!r} is not a count", PROF)
            kw[name] = int(v)
    return SpecFirstTokenProf(**kw)  # refuses a bad value, naming the field (parse_line says it)
