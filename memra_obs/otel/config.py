"""Every ``OTEL_*`` variable the span exporter honors, read at start-up, with the OpenTelemetry
specification's names and meanings (``OTEL_EXPORTER_OTLP_TRACES_*`` wins over
``OTEL_EXPORTER_OTLP_*``; README, "Where spans go"). A value it cannot use is a
:class:`~memra_obs.environment.ConfigError` naming the variable, never a silent fallback. The
timeout is milliseconds, as the specification says (opentelemetry-python reads seconds).
"""

from __future__ import annotations

import os
import re
import ssl
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ..diagnostics import say_once
from ..environment import ConfigError, decimal

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
_OTLP = "OTEL_EXPORTER_OTLP_"
#: ``OTEL_EXPORTER_OTLP_TIMEOUT=0``: no limit, as a timeout of ``2**31 - 1`` ms (about 24.8 days).
NO_LIMIT_S = (2**31 - 1) / 1000.0


def _get(env: Mapping[str, str], x: str) -> tuple[str, str] | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<x>`` else ``OTEL_EXPORTER_OTLP_<x>``: (variable, value)."""
    for var in (f"{_OTLP}TRACES_{x}", _OTLP + x):
        v = env.get(var, "").strip()
        if v:
            return var, v
    return None


def _choice(env: Mapping[str, str], x: str, allowed: tuple[str, ...]) -> str:
    var, v = _get(env, x) or ("", allowed[0])
    if v.lower() not in allowed:
        raise ConfigError(f"{var}={v!r}: expected one of {', '.join(allowed)}")
    return v.lower()


def parse_bool(var: str, value: str | None) -> bool:
    """The specification's booleans: only ``true`` (any case) is true; another value than
    ``false`` is false with a warning (every OTel SDK in the process reads it so)."""
    v = (value or "").strip().lower()
    if v not in ("true", "false", ""):
        say_once(f"bool:{var}", f"{var}={value!r}: not true or false; taken as false")
    return v == "true"


def parse_key_values(var: str, value: str, grpc: bool | None = None) -> list[tuple[str, str]]:
    """The specification's ``key1=value1,key2=value2`` lists, percent-decoded (a header's key too,
    checked sendable over gRPC or HTTP as ``grpc`` says; a resource's keys stay as written, as the
    SDK's detector does). A bad item is named by its place, never a secret's text."""
    out = []
    for n, item in enumerate(value.split(","), 1):
        key, sep, val = item.partition("=")
        if not item.strip():
            continue
        if not sep or not key.strip():
            raise ConfigError(f"{var}: item {n} is not key=value (not shown: it may be secret)")
        key, val = key.strip(), unquote(val.strip())
        if grpc is not None:
            key = unquote(key)
            ok_key, ok_val = _GRPC if grpc else _HTTP
            if not (ok_key(key.lower() if grpc else key) and ok_val(val)):
                why = "cannot be sent as given"
                if _HTTP_KEY(key):
                    raise ConfigError(f"{var}: header {key!r} {why}")
                # a key that is no header name (``Basic dXNl...`` split at its "=") is the secret
                raise ConfigError(f"{var}: header number {n} {why} (not shown: it may be secret)")
        out.append((key, val))
    return out


def shown_url(url: str) -> str:
    """``url`` as messages show it: its ``?query`` may carry an API key, so it is not shown."""
    base, sep, _ = url.partition("?")
    return base + "?<redacted>" if sep else base


def traces_exporters(env: Mapping[str, str]) -> list[str]:
    """Which span exporters to run: ``[]`` (off), or names (``otlp``, ``file``, others)."""
    if parse_bool(OTEL_SDK_DISABLED, env.get(OTEL_SDK_DISABLED)):
        return []
    raw = env.get(OTEL_TRACES_EXPORTER, "").strip()
    if not raw:
        return ["otlp"] if _get(env, "ENDPOINT") else ["file"]
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    if not names:  # "," turned spans off, unsaid
        raise ConfigError(f"{OTEL_TRACES_EXPORTER}={raw!r}: no exporter named (none: off)")
    if "none" in names and len(names) > 1:
        raise ConfigError(f"{OTEL_TRACES_EXPORTER}={raw!r}: 'none' cannot be combined with others")
    if len(set(names)) != len(names):
        raise ConfigError(f"{OTEL_TRACES_EXPORTER}={raw!r}: an exporter is named twice")
    return [] if names == ["none"] else names


INSTANCE = "service.instance.id"
_INSTANCE: list[Any] = [0, ""]  # (pid, its id)


def instance_id() -> str:
    """This process's ``service.instance.id`` where none is set: one a process (a forked
    child's its own), as the SDK makes from 1.43 (before it, none)."""
    if _INSTANCE[0] != os.getpid():
        _INSTANCE[:] = [os.getpid(), str(uuid.uuid4())]
    return str(_INSTANCE[1])


def resource_attributes(env: Mapping[str, str]) -> dict[str, Any]:
    """``OTEL_RESOURCE_ATTRIBUTES``; ``service.name``: OTEL_SERVICE_NAME, theirs or memra-obs."""
    var = "OTEL_RESOURCE_ATTRIBUTES"
    attrs: dict[str, Any] = dict(parse_key_values(var, env.get(var, "")))
    svc = env.get("OTEL_SERVICE_NAME", "").strip()
    attrs["service.name"] = svc or attrs.get("service.name") or "memra-obs"
    return attrs


def traces_sampler(env: Mapping[str, str]) -> Callable[[int], bool] | None:
    """``OTEL_TRACES_SAMPLER`` (and ``_ARG``): whether the SDK's sampler of that name samples
    a session's trace id (under the caller's current span); None for the default,
    parentbased_always_on. An unknown name or a bad ratio is warned of and the default taken,
    as the specification asks."""
    var, name = "OTEL_TRACES_SAMPLER", env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if name in ("", "parentbased_always_on"):
        return None
    from opentelemetry.sdk.trace import sampling as sm

    if name in ("traceidratio", "parentbased_traceidratio"):  # not "my_traceidratio"
        raw = env.get(var + "_ARG", "").strip() or "1"
        rate = decimal(raw, otel=True)
        if rate is None or not 0.0 <= rate <= 1.0:
            say_once(f"{var}_ARG", f"{var}_ARG={raw!r}: not a ratio in 0..1; taken as 1")
            rate = 1.0
        ratio = sm.ParentBasedTraceIdRatio if name[0] == "p" else sm.TraceIdRatioBased
        sampler: sm.Sampler = ratio(rate)
    else:
        fixed = {"always_on": sm.ALWAYS_ON, "always_off": sm.ALWAYS_OFF,
                 "parentbased_always_off": sm.DEFAULT_OFF}  # fmt: skip
        if name not in fixed:
            known = "always_on, always_off, traceidratio, parentbased_always_on/_off/_traceidratio"
            say_once(var, f"{var}={name!r}: not one of {known}; parentbased_always_on taken")
            return None
        sampler = fixed[name]
    return lambda tid: sampler.should_sample(None, tid, "spec.session").decision.is_sampled()


def _file(env: Mapping[str, str], x: str) -> str | None:
    var, path = _get(env, x) or ("", None)
    if path is not None and not os.path.isfile(path):
        raise ConfigError(f"{var}={path!r}: no such file")
    if path is not None and x == "CERTIFICATE":  # else an ssl.SSLError when HTTPS starts
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(path)
        except OSError as exc:  # ssl.SSLError, or a file it may not read
            raise ConfigError(f"{var}={path!r}: not readable PEM CA certificates ({exc})") from None
    return path


@dataclass(frozen=True)
class OtlpConfig:
    """Where and how OTLP spans are sent. Build with :meth:`from_env`."""

    protocol: str  #: http/protobuf, http/json or grpc
    endpoint: str  #: HTTP: the full URL (``.../v1/traces``). gRPC: ``host:port``.
    secure: bool  #: gRPC: TLS on (HTTP decides by the URL's scheme).
    #: Not in the repr: credentials (a traceback that shows locals would print them).
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    timeout_s: float  #: What one export may take, its retries included.
    compression: str  #: none or gzip
    certificate: str | None  #: PEM files
    client_key: str | None
    client_certificate: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, protocol: str | None = None) -> OtlpConfig:
        """Read the OTLP variables; ``protocol`` forces one (``otlp_proto_grpc`` etc.)."""
        protocol = protocol or _choice(env, "PROTOCOL", ("http/protobuf", "http/json", "grpc"))
        var, ms = _get(env, "TIMEOUT") or ("", "10000")  # 10 s
        n = decimal(ms, otel=True)  # not "١٢" or "1_000"
        if n is None or n < 0:
            raise ConfigError(f"{var}={ms!r}: expected a number of milliseconds >= 0")
        if 0 < n < 100:  # seconds meant for opentelemetry-python, which shares this variable
            say_once(var, f"{var}={ms!r}: {ms} ms, the specification's unit (opentelemetry-python "
                     f"reads it as seconds: {n * 1000:g} here for {ms} s)")  # fmt: skip
        # 0 is the specification's "no limit", its "very long time" 2**31-1 ms: so is more
        timeout_s = min(n / 1000.0, NO_LIMIT_S) or NO_LIMIT_S
        hvar, raw = _get(env, "HEADERS") or ("", "")
        # Checked here, else every request fails in the sender (which lowercases gRPC keys).
        headers = tuple(parse_key_values(hvar, raw, grpc=protocol == "grpc"))
        compression = _choice(env, "COMPRESSION", ("none", "gzip"))
        pems = [_file(env, x) for x in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")]
        k, c = (_get(env, x) or (_OTLP + x,) for x in ("CLIENT_KEY", "CLIENT_CERTIFICATE"))
        if bool(pems[1]) != bool(pems[2]):  # a lone one: gRPC's C core aborts the process
            raise ConfigError(f"{k[0]} and {c[0]} go together (mTLS): set both or neither")
        try:  # else an ssl.SSLError when HTTPS starts (an encrypted key: a prompt on the tty)
            if pems[1] and pems[2]:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(pems[2], pems[1], b"")
        except OSError as exc:
            why = "not a readable PEM certificate and its unencrypted private key"
            raise ConfigError(f"{c[0]} / {k[0]}: {why} ({exc})") from None
        return cls(protocol, *_endpoint(env, protocol), headers, timeout_s, compression, *pems)


_HTTP_KEY = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+").fullmatch  # RFC 9110's token
#: Sendable headers: (key, value) checks. HTTP values go as Latin-1; gRPC's keys are lowercased
#: and a ``-bin`` key's value is bytes, not text.
_HTTP = _HTTP_KEY, re.compile(r"[\t\x20-\x7e\x80-\xff]*").fullmatch
_GRPC_KEY = re.compile(r"(?!grpc-)[0-9a-z_.-]+(?<!-bin)").fullmatch
_GRPC = _GRPC_KEY, re.compile(r"[\x20-\x7e]*").fullmatch


def _endpoint(env: Mapping[str, str], protocol: str) -> tuple[str, bool]:
    """(endpoint, secure): HTTP's full URL, or gRPC's ``host:port`` with TLS on or off."""
    var, url = _get(env, "ENDPOINT") or ("(default)", "")
    given = url  # quoted as written: the general endpoint gets /v1/traces added below

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{var}={shown_url(given)!r}: {why}")

    authority = re.split(r"[/?#]", url.split("://", 1)[-1], maxsplit=1)[0]
    if "@" in authority and not url.startswith("unix"):  # http.client would drop it, unsaid
        raise ConfigError(f"{var}: user:password@ in the URL is never sent (not shown); put "
                          f"credentials in {_OTLP}HEADERS (authorization=Basic%20...)")  # fmt: skip
    if protocol == "grpc":
        url = url or "http://localhost:4317"
        if "://" not in url or url.startswith("unix://"):  # host:port, TLS unless told otherwise
            insecure = _get(env, "INSECURE")
            secure, target = not (insecure and parse_bool(*insecure)), url.rstrip("/")
        else:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise bad("expected http(s)://host:port or host:port")
            secure, target = u.scheme == "https", u.netloc
        if target.startswith(("unix:", "unix-abstract:")):  # grpcio's socket targets
            return target, secure
        if ":" not in target.rsplit("]", 1)[-1]:
            target += ":443" if secure else ":4317"
        host, port = target.rsplit(":", 1)
        if not host.strip("[]/"):  # "/" or "///" would be ":443": nowhere, every span dropped
            raise bad("no host")
        if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):  # gRPC would wrap it
            raise bad("bad port")
        return target, secure
    if var == _OTLP + "ENDPOINT":  # the general endpoint: the signal's path appended
        u = urlsplit(url)  # to the path, before any ?query
        url = urlunsplit(u._replace(path=u.path.rstrip("/") + "/v1/traces"))
    url = url or "http://localhost:4318/v1/traces"
    u = urlsplit(url)
    try:
        u.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise bad("bad port") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise bad("expected an http:// or https:// URL")
    if re.search(r"[^\x21-\x7e]", u.path + u.query):  # http.client refuses it at every send,
        # its error quoting the request line, ?api_key= and all
        raise bad("a space, control or non-ASCII character in its path or query: percent-encode it")
    return url, u.scheme == "https"
