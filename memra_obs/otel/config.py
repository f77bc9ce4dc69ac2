"""Every ``OTEL_*`` variable the span exporter honors, read in one place, at start-up.

Names and meanings are the OpenTelemetry specification's (SDK environment variables and the
OTLP exporter's), so a deployment configures memra_obs the way it configures any other
OTel component. Signal-specific ``OTEL_EXPORTER_OTLP_TRACES_*`` wins over the general
``OTEL_EXPORTER_OTLP_*``. A value the project cannot use is a
:class:`~memra_obs.environment.ConfigError` naming the variable — never a silent fallback.

One deliberate choice: ``OTEL_EXPORTER_OTLP_TIMEOUT`` is milliseconds, as the specification
says (opentelemetry-python's own exporters read it as seconds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from ..environment import ConfigError

__all__ = [
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_EXPORTER",
    "OtlpConfig",
    "parse_bool",
    "parse_key_values",
    "resource_attributes",
    "traces_exporters",
]

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
"""``true``: no spans at all (``false`` or unset: on)."""

OTEL_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
"""Comma list of exporters: ``otlp`` (protocol from ``OTEL_EXPORTER_OTLP_PROTOCOL``),
``otlp_proto_http``, ``otlp_proto_grpc``, ``none``, or any name registered under the
``opentelemetry_traces_exporter`` entry point (``console``, ``zipkin``, ...; the slow path).
Unset: ``otlp`` when an OTLP endpoint variable is set, else the embedded file default."""

OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
"""``service.name`` of the resource (default ``memra-obs``)."""

OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
"""``key=value,...`` resource attributes (values percent-decoded)."""

OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Base URL; HTTP appends ``/v1/traces``. ``_TRACES_ENDPOINT`` is used as given.
Defaults: ``http://localhost:4318/v1/traces`` (HTTP), ``http://localhost:4317`` (gRPC)."""

OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
"""``http/protobuf`` (default), ``http/json`` or ``grpc`` (needs grpcio)."""

OTEL_EXPORTER_OTLP_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
"""``key=value,...`` sent with every export (values percent-decoded)."""

OTEL_EXPORTER_OTLP_TIMEOUT = "OTEL_EXPORTER_OTLP_TIMEOUT"
"""Per-export timeout in milliseconds (default 10000)."""

OTEL_EXPORTER_OTLP_COMPRESSION = "OTEL_EXPORTER_OTLP_COMPRESSION"
"""``gzip`` or ``none`` (default)."""

OTEL_EXPORTER_OTLP_CERTIFICATE = "OTEL_EXPORTER_OTLP_CERTIFICATE"
"""PEM file of the CA(s) that sign the collector's certificate (TLS)."""

OTEL_EXPORTER_OTLP_CLIENT_KEY = "OTEL_EXPORTER_OTLP_CLIENT_KEY"
"""PEM file of the client's private key (mTLS)."""

OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE = "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
"""PEM file of the client's certificate chain (mTLS)."""

OTEL_EXPORTER_OTLP_INSECURE = "OTEL_EXPORTER_OTLP_INSECURE"
"""gRPC only, for an endpoint given without a scheme: ``true`` = plaintext (default
``false``: TLS)."""

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")
PROTOCOLS = ("http/protobuf", "http/json", "grpc")


def _get(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<X>`` else ``OTEL_EXPORTER_OTLP_<X>``: (variable, value)."""
    specific = name.replace("OTEL_EXPORTER_OTLP_", "OTEL_EXPORTER_OTLP_TRACES_", 1)
    for var in (specific, name):
        v = env.get(var)
        if v is not None and v.strip() != "":
            return var, v.strip()
    return None


def parse_bool(var: str, value: str | None, default: bool = False) -> bool:
    if value is None:
        return default
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False if v else default
    raise ConfigError(f"{var}={value!r}: expected true or false")


def parse_key_values(var: str, value: str) -> list[tuple[str, str]]:
    """The spec's ``key1=value1,key2=value2`` lists (headers, resource attributes)."""
    out: list[tuple[str, str]] = []
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"{var}={value!r}: expected key=value pairs separated by commas, got {item!r}"
            )
        out.append((unquote(key.strip()), unquote(val.strip())))
    return out


def traces_exporters(env: Mapping[str, str]) -> list[str]:
    """Which span exporters to run: ``[]`` (off), or names (``otlp``, ``file``, others)."""
    if parse_bool(OTEL_SDK_DISABLED, env.get(OTEL_SDK_DISABLED)):
        return []
    raw = env.get(OTEL_TRACES_EXPORTER, "").strip()
    if not raw:
        if _get(env, OTEL_EXPORTER_OTLP_ENDPOINT) is not None:
            return ["otlp"]
        return ["file"]
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    if "none" in names:
        if len(names) > 1:
            raise ConfigError(
                f"{OTEL_TRACES_EXPORTER}={raw!r}: 'none' cannot be combined with other exporters"
            )
        return []
    if len(set(names)) != len(names):
        raise ConfigError(f"{OTEL_TRACES_EXPORTER}={raw!r}: an exporter is named twice")
    return names


def resource_attributes(
    env: Mapping[str, str], default_service: str = "memra-obs"
) -> dict[str, Any]:
    """Resource attributes from ``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME`` (the
    latter wins), with ``service.name`` defaulting to ``default_service``."""
    attrs: dict[str, Any] = {}
    raw = env.get(OTEL_RESOURCE_ATTRIBUTES)
    if raw:
        attrs.update(parse_key_values(OTEL_RESOURCE_ATTRIBUTES, raw))
    svc = env.get(OTEL_SERVICE_NAME, "").strip()
    if svc:
        attrs["service.name"] = svc
    elif not attrs.get("service.name"):
        attrs["service.name"] = default_service
    return attrs


def _file(env: Mapping[str, str], name: str) -> str | None:
    got = _get(env, name)
    if got is None:
        return None
    var, path = got
    if not os.path.isfile(path):
        raise ConfigError(f"{var}={path!r}: no such file")
    return path


@dataclass(frozen=True)
class OtlpConfig:
    """Where and how OTLP spans are sent. Build with :meth:`from_env`."""

    protocol: str = "http/protobuf"
    #: HTTP: the full URL (``.../v1/traces``). gRPC: ``host:port``.
    endpoint: str = "http://localhost:4318/v1/traces"
    #: gRPC: TLS on (HTTP decides by the URL's scheme).
    secure: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0
    compression: str = "none"
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, protocol: str | None = None
    ) -> OtlpConfig:
        """Read the OTLP variables; ``protocol`` forces one (``otlp_proto_grpc`` etc.)."""
        env = os.environ if env is None else env
        if protocol is None:
            got = _get(env, OTEL_EXPORTER_OTLP_PROTOCOL)
            protocol = "http/protobuf"
            if got is not None:
                var, protocol = got[0], got[1].lower()
                if protocol not in PROTOCOLS:
                    raise ConfigError(f"{var}={got[1]!r}: expected one of {', '.join(PROTOCOLS)}")
        timeout_s = 10.0
        got = _get(env, OTEL_EXPORTER_OTLP_TIMEOUT)
        if got is not None:
            try:
                ms = float(got[1])
            except ValueError:
                raise ConfigError(
                    f"{got[0]}={got[1]!r}: expected a number of milliseconds"
                ) from None
            if not 0 < ms < 1e9:
                raise ConfigError(
                    f"{got[0]}={got[1]!r}: expected a positive number of milliseconds"
                )
            timeout_s = ms / 1000.0
        compression = "none"
        got = _get(env, OTEL_EXPORTER_OTLP_COMPRESSION)
        if got is not None:
            compression = got[1].lower()
            if compression not in ("gzip", "none"):
                raise ConfigError(f"{got[0]}={got[1]!r}: expected gzip or none")
        headers: tuple[tuple[str, str], ...] = ()
        got = _get(env, OTEL_EXPORTER_OTLP_HEADERS)
        if got is not None:
            headers = tuple(parse_key_values(got[0], got[1]))
        endpoint, secure = _endpoint(env, protocol)
        return cls(
            protocol=protocol,
            endpoint=endpoint,
            secure=secure,
            headers=headers,
            timeout_s=timeout_s,
            compression=compression,
            certificate=_file(env, OTEL_EXPORTER_OTLP_CERTIFICATE),
            client_key=_file(env, OTEL_EXPORTER_OTLP_CLIENT_KEY),
            client_certificate=_file(env, OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE),
        )


def _endpoint(env: Mapping[str, str], protocol: str) -> tuple[str, bool]:
    specific = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    general = env.get(OTEL_EXPORTER_OTLP_ENDPOINT, "").strip()
    if protocol == "grpc":
        var, url = (
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", specific)
            if specific
            else (OTEL_EXPORTER_OTLP_ENDPOINT, general or "http://localhost:4317")
        )
        if "://" not in url:  # host:port, TLS unless told otherwise
            insecure = _get(env, OTEL_EXPORTER_OTLP_INSECURE)
            secure = not parse_bool(insecure[0], insecure[1]) if insecure else True
            target = url.rstrip("/")
        else:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise ConfigError(f"{var}={url!r}: expected http(s)://host:port or host:port")
            secure, target = u.scheme == "https", u.netloc
        if not target or ":" not in target.rsplit("]", 1)[-1]:
            target += ":443" if secure else ":4317"
        return target, secure
    if specific:
        var, url = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", specific
    elif general:
        var, url = OTEL_EXPORTER_OTLP_ENDPOINT, general.rstrip("/") + "/v1/traces"
    else:
        var, url = "(default)", "http://localhost:4318/v1/traces"
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"{var}={url!r}: expected an http:// or https:// URL")
    try:
        u.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ConfigError(f"{var}={url!r}: bad port") from None
    return url, u.scheme == "https"
