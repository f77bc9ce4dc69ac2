"""OpenTelemetry spans from the observer's records, built and encoded off the loop.

    from memra_obs.otel import build_span_exporter
    ex = build_span_exporter(settings)        # a RecordExporter, or None when spans are off

Selection follows the OTel environment (:mod:`memra_obs.otel.config`):
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` -> None; ``otlp`` (or unset
with an OTLP endpoint variable set) -> our OTLP writer over HTTP/protobuf, HTTP/JSON or
gRPC; unset and no endpoint -> OTLP-JSON lines in ``MEMRA_OBS_SPANS_FILE``; any other name
-> the SDK exporter registered under that entry point, fed ReadableSpans (slow, universal).

Modules: :mod:`.spans` (records -> span tuples), :mod:`.otlp_proto` / :mod:`.otlp_json`
(span tuples -> OTLP bytes / text), :mod:`.transport` (HTTP, gRPC, file, SDK),
:mod:`.exporter` (the RecordExporter and its sender threads). grpcio and
opentelemetry-proto are never imported here; the SDK only for ``Resource.create``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from ..environment import ConfigError, Settings
from .config import OTEL_TRACES_EXPORTER, OtlpConfig, resource_attributes, traces_exporters
from .exporter import Output, SpanExporter
from .spans import SpanBuilder, burst_span_id, round_span_id

__all__ = [
    "SCOPE_NAME",
    "Output",
    "SpanBuilder",
    "SpanExporter",
    "build_span_exporter",
    "burst_span_id",
    "make_resource",
    "round_span_id",
]

SCOPE_NAME = "memra_obs"


def _scope_version() -> str:
    from ..version import __version__

    return __version__


def make_resource(env: Mapping[str, str] | None = None) -> Any:
    """The SDK's ``Resource.create`` (telemetry.sdk.*, detectors), with ``OTEL_SERVICE_NAME``
    / ``OTEL_RESOURCE_ATTRIBUTES`` read from ``env`` and ``service.name`` defaulting to
    ``memra-obs``."""
    from opentelemetry.sdk.resources import Resource

    return Resource.create(resource_attributes(os.environ if env is None else env))


def _otlp_output(
    protocol: str | None, env: Mapping[str, str], resource: Any, stop_name: str
) -> Output:
    from .otlp_json import JsonEncoder
    from .otlp_proto import ProtoEncoder
    from .transport import GrpcSender, HttpSender

    cfg = OtlpConfig.from_env(env, protocol=protocol)
    attrs = dict(resource.attributes)
    stop = threading.Event()
    if cfg.protocol == "grpc":
        try:
            sender: Any = GrpcSender(cfg, stop)
        except ImportError:
            raise ConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs grpcio (pip install 'memra_obs[otlp]')"
            ) from None
        enc: Any = ProtoEncoder(
            attrs, SCOPE_NAME, _scope_version(), resource_schema_url=resource.schema_url
        )
    elif cfg.protocol == "http/json":
        sender = HttpSender(cfg, stop, json=True)
        enc = JsonEncoder(
            attrs, SCOPE_NAME, _scope_version(), resource_schema_url=resource.schema_url
        )
    else:
        sender = HttpSender(cfg, stop)
        enc = ProtoEncoder(
            attrs, SCOPE_NAME, _scope_version(), resource_schema_url=resource.schema_url
        )
    return Output(stop_name, enc, sender, stop=stop)


def _file_output(path: str, resource: Any) -> Output:
    from .otlp_json import JsonEncoder
    from .transport import FileSender

    enc = JsonEncoder(
        dict(resource.attributes),
        SCOPE_NAME,
        _scope_version(),
        resource_schema_url=resource.schema_url,
    )
    # Lines stay well under the Collector file receivers' 1 MiB line limit.
    return Output("file", enc, FileSender(path), max_bytes=256 << 10)


def _sdk_output(name: str, resource: Any) -> Output:
    from importlib.metadata import entry_points

    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from .transport import SdkSender

    eps = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    ep = eps.get(name)
    if ep is None:
        known = ", ".join(sorted({"otlp", "otlp_proto_http", "otlp_proto_grpc", "none", *eps}))
        raise ConfigError(f"{OTEL_TRACES_EXPORTER}={name!r}: no such span exporter; known: {known}")
    try:
        exporter = ep.load()()
    except Exception as exc:
        raise ConfigError(
            f"{OTEL_TRACES_EXPORTER}={name!r}: the exporter failed to start: {exc!r}"
        ) from exc
    scope = InstrumentationScope(SCOPE_NAME, _scope_version())
    # The SDK path hands over whole span lists; keep its requests modest.
    return Output(name, None, SdkSender(exporter, resource, scope), max_spans=256)


_FORCED = {"otlp": None, "otlp_proto_http": "http/protobuf", "otlp_proto_grpc": "grpc"}


def build_span_exporter(
    settings: Settings, env: Mapping[str, str] | None = None
) -> SpanExporter | None:
    """The span exporter the environment asks for, or None when spans are off.

    Raises :class:`~memra_obs.environment.ConfigError` (naming the variable) on a value it
    cannot use; nothing is started in that case.
    """
    env = os.environ if env is None else env
    names = traces_exporters(env)
    if not names:
        return None
    resource = make_resource(env)
    outputs: list[Output] = []
    try:
        for name in names:
            if name == "file":
                if not settings.spans_file:
                    continue
                outputs.append(_file_output(settings.spans_file, resource))
            elif name in _FORCED:
                outputs.append(_otlp_output(_FORCED[name], env, resource, name))
            else:
                outputs.append(_sdk_output(name, resource))
    except BaseException:
        for o in outputs:
            o.sender.close()
        raise
    if not outputs:
        return None
    return SpanExporter(outputs, round_spans=settings.round_spans)
