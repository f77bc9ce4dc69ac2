"""Every ``MEMRA_OBS_*`` knob, in one place, with the parser that reads it.

Argument > environment > default; a bad value is a :class:`ConfigError` at start-up that names
the variable, never a silent fallback. (The seed's trace flags in :mod:`memra_obs.flags` mean
off on junk, by the seed's law; ``OTEL_*`` settings are read where they are used.) Also what
the environment leaves a command to stop on (:func:`stop_signals`: ``nohup`` keeps a hangup's).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

__all__ = [
    "MEMRA_OBS_AGENT", "MEMRA_OBS_MAX_FAMILIES", "MEMRA_OBS_METRICS_ADDR", "MEMRA_OBS_SINKS",
    "MEMRA_OBS_WORKER", "ConfigError", "Settings", "check_flags", "idle_knobs", "parse_addr", "positive",
    "stop_signals", "unknown_knobs", "utf8",
]  # fmt: skip


class ConfigError(ValueError):
    """A knob holds a value the project cannot use; the message names the variable."""


def check_flags(call: str, level: object, prof: object) -> None:
    """``level`` (0, 1, 2) and ``prof`` (a bool) as ``call`` takes them; None: not given."""
    if level is not None and (type(level) is not int or level not in (0, 1, 2)):
        raise ConfigError(f"{call}(level={level!r}): expected 0, 1 or 2")
    if prof is not None and type(prof) is not bool:
        raise ConfigError(f"{call}(prof={prof!r}): expected True or False")


# The variables other modules name; every one is in _TABLE (each documented in Settings).
MEMRA_OBS_SINKS = "MEMRA_OBS_SINKS"
MEMRA_OBS_METRICS_ADDR = "MEMRA_OBS_METRICS_ADDR"
MEMRA_OBS_AGENT = "MEMRA_OBS_AGENT"
MEMRA_OBS_WORKER = "MEMRA_OBS_WORKER"
MEMRA_OBS_MAX_FAMILIES = "MEMRA_OBS_MAX_FAMILIES"
_SINK_NAMES = ("otel", "prometheus", "nvtx")  #: what MEMRA_OBS_SINKS may name (or "all")
#: ``memra_obs.analysis.MIN_ROUNDS`` (this module imports nothing of the package; a test ties them).
_ADVICE_MIN_ROUNDS = 32


def parse_addr(var: str, value: str, check: bool = True) -> tuple[str, int] | None:
    """``host:port`` / ``[v6]:port`` -> (host, port); empty -> None (not served). With
    ``check`` the host must resolve to an address of this machine (binding port 0 on it)."""
    v = value.strip()
    if not v:
        return None
    host, sep, port = v.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host or "/" in host:  # a URL
        raise ConfigError(f"{var}={value!r}: expected host:port (no scheme), e.g. 127.0.0.1:9464")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if len(port) > 5 or (p := int(port)) > 65535:  # not int() of 5,000 digits (it raises)
        raise ConfigError(f"{var}={value!r}: port {port} is out of range 0..65535")
    if not check:
        return host, p
    try:
        infos = bind_order(socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM))
    except socket.gaierror as exc:
        raise ConfigError(f"{var}={value!r}: cannot resolve {host!r} ({exc.strerror})") from None
    first: OSError | None = None
    for family, _, _, _, sockaddr in infos:  # as serve_metrics binds: the first that does
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind(sockaddr)
            return host, p
        except OSError as exc:
            first = first or exc
    why = first.strerror if first else "no address"
    raise ConfigError(f"{var}={value!r}: {host!r} is not an address of this host ({why})")


#: Bind errors that mean "not this host's address": the next of a name's addresses is tried.
NOT_THIS_HOST = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def bind_order(infos: list[Any]) -> list[Any]:
    """``getaddrinfo``'s answers, IPv4 first: ``localhost`` answering ``::1`` first (Docker's
    /etc/hosts) bound to ::1 alone, and scrapers of 127.0.0.1 were refused, unsaid."""
    return sorted(infos, key=lambda i: i[0] != socket.AF_INET)


def _parse_sinks(var: str, value: str) -> frozenset[str]:
    names = {s.strip().lower() for s in value.split(",") if s.strip()}
    if bad := sorted(names - {*_SINK_NAMES, "all"}):
        raise ConfigError(
            f"{var}={value!r}: unknown sink {bad[0]!r}; choose from {', '.join(_SINK_NAMES)}, all"
        )
    return frozenset(_SINK_NAMES if "all" in names else names)


def _parse_clock(var: str, value: str) -> str:
    v = value.strip().lower()
    if v not in ("sync", "event"):
        raise ConfigError(f"{var}={value!r}: expected 'sync' or 'event'")
    return v


_DECIMAL = re.compile(r"([+-]?)([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?").fullmatch


def decimal(value: str, *, otel: bool = False) -> float | None:
    """ASCII digits and one optional point, else None (float() takes "1_024", other scripts'
    digits, "nan", "inf"); ``otel``: a sign and an exponent too (``1e-3``), as the SDKs read."""
    m = _DECIMAL(value.strip())
    return None if m is None or (not otel and (m[1] or m[3])) else float(m[0])


def _number(value: str, integer: bool = False) -> float | None:
    """A knob's number (:func:`decimal`); with ``integer``, digits only."""
    v = value.strip()
    if integer:  # int() raises past 4,300 digits (a traceback): past 30, too large for a knob
        return (int(v) if len(v) <= 30 else math.inf) if v.isascii() and v.isdigit() else None
    return decimal(v)


def positive(kind: type, top: float = math.inf, least: float = 0.0) -> Callable[[str], Any]:
    """An argparse type for a command's number option, read as the knobs are: ``kind`` in
    (0, top] (with ``least``: in [least, top]), else a usage error that says so."""
    what = "integer" if kind is int else "number"
    if least:
        what = f"{what} from {least:g} to {top:g}"
    else:
        what = f"positive {what}" + (f" up to {top:g}" if top < math.inf else "")

    def parse(value: str) -> Any:
        x = _number(value, kind is int)
        if x is None or not (least <= x <= top if least else 0 < x <= top) or x == math.inf:
            raise argparse.ArgumentTypeError(f"{value!r} is not a {what}")
        return x

    return parse


def _int_in(lo: int, hi: int, rule: str = "", ok: Callable[[int], bool] = lambda n: True
            ) -> Callable[[str, str], int]:  # fmt: skip
    """An integer lo..hi that ``ok`` takes; ``rule``: what a refusal says it expects."""

    def parse(var: str, value: str) -> int:
        n = _number(value, integer=True)
        if n is None or not lo <= n <= hi or not ok(int(n)):
            digits = " (digits 0-9 only)" * (n is None)
            why = rule or f"{'an integer ' * (n is None)}{lo}..{hi}"
            raise ConfigError(f"{var}={value!r}: expected {why}{digits}")
        return int(n)

    return parse


_ring_slots = _int_in(64, 1 << 24, "a power of two 64..16777216 (64, 128, ..., 65536, ...)",
                      lambda n: not n & (n - 1))  # fmt: skip
#: 64 meant MiB: each write rotated, one request kept, none counted lost. A request (a line)
#: is up to ~0.3 MiB (sealed past 256 KiB), so a file within a smaller limit cannot be kept.
_rotate_at = _int_in(0, 1 << 50, f"0 (never rotate) or bytes 1048576..{1 << 50} (1 MiB; 64 MiB "
                     "is 67108864)", lambda n: not 0 < n < 1 << 20)  # fmt: skip


def _positive_ms(var: str, value: str) -> float:
    x = _number(value) or 0.0
    if not 0 < x < 1e6:
        raise ConfigError(f"{var}={value!r}: expected a positive number of milliseconds below 1e6")
    return x


#: 0, or enough rounds for advise() to answer: a window of fewer never publishes a gauge.
_advice_window = _int_in(0, 1 << 20, f"0 (no advice gauges) or {_ADVICE_MIN_ROUNDS}..{1 << 20} "
                         f"(the advisor needs {_ADVICE_MIN_ROUNDS} rounds that drafted)",
                         lambda n: not 0 < n < _ADVICE_MIN_ROUNDS)  # fmt: skip


def _nonblank(var: str, value: str) -> str:
    if not value.strip():
        raise ConfigError(f"{var}={value!r}: must not be empty (unset it for the default)")
    return value


#: A worker label's most UTF-8 bytes: each session record carries it, through the agent's ring
#: too, whose largest record (16 slots: 1,792 bytes) holds it beside the family and tags at
#: their caps (56, 64, 64 characters of up to 4 bytes: 834 bytes with the rest). The tail cuts
#: a file name (its default label) to it.
MAX_WORKER = 512


def _worker(var: str, value: str) -> str:
    label = utf8(_nonblank(var, value).strip())  # " w1": a 2nd series
    if (n := len(label.encode())) > MAX_WORKER:  # the ring refused its sessions, unsaid
        raise ConfigError(f"{var}={label[:16]!r}...: {n} bytes long (UTF-8), expected at most "
                          f"{MAX_WORKER} (each session record carries it)")  # fmt: skip
    return label


def stop_signals() -> tuple[int, ...]:
    """What a command stops on, flushing first: Ctrl-C, SIGTERM and a hangup (its terminal or
    ssh session closed), unless it was started ignoring the hangup (``nohup``)."""
    hup = signal.getsignal(signal.SIGHUP) != signal.SIG_IGN
    return (signal.SIGINT, signal.SIGTERM) + (signal.SIGHUP,) * hup


def utf8(value: str) -> str:
    """A label (or a page's text) as valid UTF-8: undecodable bytes of argv, the environment or
    a file name (surrogates) become U+FFFD, else every /metrics scrape (or page) fails to encode."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _readable_file(var: str, value: str) -> str | None:
    path = value.strip()
    if not path:
        return None
    try:
        open(path, "rb").close()
    except OSError as exc:
        raise ConfigError(f"{var}={value!r}: cannot read it ({exc.strerror})") from None
    return path


def _basic_auth_file(var: str, value: str) -> tuple[str, str] | None:
    path = value.strip()
    if not path:
        return None
    try:
        with open(path, encoding="utf-8-sig") as f:  # a BOM (Windows editors) is not the user
            line = f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"{var}={value!r}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:  # its text quotes a byte of the password, and where it is
        raise ConfigError(f"{var}={value!r}: not UTF-8 text (its bytes not shown)") from None
    user, sep, password = line.partition(":")
    if not sep or not user or not password:
        raise ConfigError(
            f"{var}={value!r}: the file must hold one line 'user:password', both non-empty"
        )
    return user, password


@dataclass(frozen=True)
class Settings:
    """The resolved knobs of one observer, each from ``MEMRA_OBS_<FIELD>``; :meth:`resolve`."""

    sinks: frozenset[str] = frozenset()  #: otel, prometheus, nvtx ("all"); none: legacy lines
    metrics_addr: tuple[str, int] | None = ("127.0.0.1", 9464)  #: /metrics (port 0: any free)
    spans_file: str = "memra-obs-spans.jsonl"  #: spans (OTLP-JSON lines) when no OTEL_* exporter
    spans_file_max_bytes: int = 64 << 20  #: then the file becomes <file>.1 (0: no limit)
    agent: str | None = None  #: agent mode: the directory of this host's workers' rings
    clock: str = "sync"  #: "sync": drain at every boundary (the seed's); "event": CUDA events
    round_spans: int = 256  #: spec.round spans per session (0: none); the rest are counted
    queue_size: int = 8192  #: records the in-process queue holds; past it the newest drop
    export_interval_ms: int = 200  #: how often the in-process exporter drains the queue
    worker: str = ""  #: the ``worker`` label (from the environment: RANK, else the pid)
    ring_slots: int = 65536  #: 128-byte slots per ring, a power of two >= 64; then overwritten
    metrics_tls_cert: str | None = None  #: PEM chain and key: /metrics over HTTPS
    metrics_tls_key: str | None = None
    #: (user, password) from a file (``..._BASIC_AUTH_FILE``), so the secret never shows in the
    #: environment; an argument may name a file too.
    metrics_basic_auth: tuple[str, str] | None = field(default=None, repr=False)
    max_devices: int = 64  #: CUDA ordinals published at most (bounds a garbled profile)
    max_families: int = 64  #: families with series on /metrics, and the report's (a log's tags)
    requests_file: str | None = None  #: one JSON line per ended session (the spec-decode record)
    requests_detail: bool = False  #: the requests file's lines carry the per-step lists
    advice_window: int = 2048  #: rounds per family behind the k advisor's gauges (0: none)
    plain_step_ms: float | None = None  #: a measured plain decode step (None: from the verify fit)
    #: field -> ``argument <field>`` for what an argument set: messages name what the user set
    given: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def named(self, name: str) -> str:
        """What a message calls knob ``name``: the argument that set it, else its variable."""
        return f"argument {name}" if name in self.given else _VARS[name]

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Arguments (non-None ``overrides``) > environment > default, validated."""
        env = os.environ if env is None else env
        if unknown := set(overrides) - _VARS.keys():
            raise TypeError(f"unknown setting {sorted(unknown)[0]!r}")
        values: dict[str, Any] = {}
        for name, var, parse in _TABLE:
            if (v := overrides.get(name)) is not None:
                # an argument is checked as the variable would be: a number as its digits, a
                # bool only as requests_detail's 0/1, nothing else but a str
                if isinstance(v, bool) and name == "requests_detail":
                    v = int(v)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    v = str(v) if isinstance(v, int) else format(Decimal(v), "f")  # not 1e-05
                if not isinstance(v, str):
                    raise ConfigError(f"argument {name}={v!r}: expected a str or a number")
                values[name] = parse(f"argument {name}", v)
            elif var in env:
                values[name] = parse(var, env[var])
        values.setdefault("worker", utf8(env.get("RANK", "").strip() or str(os.getpid())))
        st = cls(**values, given=frozenset(k for k, v in overrides.items() if v is not None))
        _check_tls(st)
        return st


_TABLE: tuple[tuple[str, str, Callable[[str, str], Any]], ...] = (
    ("sinks", MEMRA_OBS_SINKS, _parse_sinks),
    ("metrics_addr", MEMRA_OBS_METRICS_ADDR, parse_addr),
    ("spans_file", "MEMRA_OBS_SPANS_FILE", lambda n, v: _nonblank(n, v).strip()),
    ("spans_file_max_bytes", "MEMRA_OBS_SPANS_FILE_MAX_BYTES", _rotate_at),
    ("agent", MEMRA_OBS_AGENT, lambda _, v: v.strip() or None),
    ("clock", "MEMRA_OBS_CLOCK", _parse_clock),
    ("round_spans", "MEMRA_OBS_ROUND_SPANS", _int_in(0, 1 << 20)),
    ("queue_size", "MEMRA_OBS_QUEUE_SIZE", _int_in(16, 1 << 24)),
    ("export_interval_ms", "MEMRA_OBS_EXPORT_INTERVAL_MS", _int_in(1, 60_000)),
    ("worker", MEMRA_OBS_WORKER, _worker),
    ("ring_slots", "MEMRA_OBS_RING_SLOTS", _ring_slots),
    ("metrics_tls_cert", "MEMRA_OBS_METRICS_TLS_CERT", _readable_file),
    ("metrics_tls_key", "MEMRA_OBS_METRICS_TLS_KEY", _readable_file),
    ("metrics_basic_auth", "MEMRA_OBS_METRICS_BASIC_AUTH_FILE", _basic_auth_file),
    ("max_devices", "MEMRA_OBS_MAX_DEVICES", _int_in(1, 4096)),
    ("max_families", MEMRA_OBS_MAX_FAMILIES, _int_in(1, 4096)),
    ("requests_file", "MEMRA_OBS_REQUESTS_FILE", lambda _, v: v.strip() or None),
    ("requests_detail", "MEMRA_OBS_REQUESTS_DETAIL", lambda n, v: _int_in(0, 1)(n, v) == 1),
    ("advice_window", "MEMRA_OBS_ADVICE_WINDOW", _advice_window),
    ("plain_step_ms", "MEMRA_OBS_PLAIN_STEP_MS", _positive_ms),
)

_VARS = {name: var for name, var, _ in _TABLE}
#: Names of the prefix that are not knobs: the compose replay's mount, the test scripts' own.
_NOT_KNOBS = frozenset(("MEMRA_OBS_SPANS_DIR", "MEMRA_OBS_REQUIRE_PEERS", "MEMRA_OBS_PEERS_CACHE",
                        "MEMRA_OBS_REQUIRE_ORACLE"))  # fmt: skip
#: Knobs that only their sink reads: set with that sink off, they silently did nothing.
_SINK_OF = {
    "metrics_addr": "prometheus", "metrics_tls_cert": "prometheus",
    "metrics_tls_key": "prometheus", "metrics_basic_auth": "prometheus",
    "spans_file": "otel", "spans_file_max_bytes": "otel", "round_spans": "otel",
}  # fmt: skip


def unknown_knobs(env: Mapping[str, str]) -> list[str]:
    """A note per ``MEMRA_OBS_*`` name in ``env`` that no knob reads, with the knob it is
    likely a misspelling of: ``MEMRA_OBS_SINK=prometheus`` otherwise publishes nothing, unsaid."""
    import difflib

    known = list(_VARS.values())
    notes = []
    for var in sorted(v for v in env if v.startswith("MEMRA_OBS_")):
        if var not in known and var not in _NOT_KNOBS:
            near = difflib.get_close_matches(var, known, n=1, cutoff=0.8)
            hint = f"did you mean {near[0]}?" if near else "the knobs: README, Knobs"
            notes.append(f"{var} is not a memra_obs knob ({hint}); ignored")
    return notes


#: Knobs the agent reads, not its workers: their records go to the ring, the agent publishes.
_AGENTS = (*_SINK_OF, "advice_window", "max_families")


def idle_knobs(st: Settings, env: Mapping[str, str]) -> list[str]:
    """A note per knob ``env`` sets (not empty: off) for a sink ``st`` leaves off
    (``MEMRA_OBS_METRICS_ADDR`` alone published nothing and said nothing), or in agent mode
    for the agent (a worker's ``MEMRA_OBS_ADVICE_WINDOW`` changed nothing, unsaid)."""
    if st.agent:
        return [f"{_VARS[n]} is set, but in agent mode ({st.named('agent')}) the agent "
                "publishes: it does nothing here (set it on memra-obs agent)" for n in _AGENTS
                if n not in st.given and env.get(_VARS[n], "").strip()]  # fmt: skip
    on = ",".join(sorted(st.sinks)) or "none"
    idle = [(n, sink) for n, sink in _SINK_OF.items() if sink not in st.sinks]
    return [f"{_VARS[n]} is set, but {st.named('sinks')} ({on}) has no {sink}: it does "
            f"nothing (add {sink} there)" for n, sink in idle
            if n not in st.given and env.get(_VARS[n], "").strip()]  # fmt: skip


def _check_tls(st: Settings) -> None:
    """Both or neither, and a certificate chain with its key, both PEM."""
    cert, key = st.metrics_tls_cert, st.metrics_tls_key
    pair = ("metrics_tls_cert", "metrics_tls_key")
    c, k = map(st.named, pair)
    if bool(cert) != bool(key):  # half a pair an argument set: the other is an argument too
        by_arg = bool(st.given.intersection(pair))
        c, k = (f"argument {x}" if by_arg else _VARS[x] for x in pair)
        raise ConfigError(f"{c} and {k} go together: set both (HTTPS) or neither")
    if cert and key:
        import ssl

        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, b"")  # no prompt
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"{c}={cert!r} / {k}={key!r}: not a PEM certificate chain and its unencrypted "
                f"private key ({exc})"
            ) from None
