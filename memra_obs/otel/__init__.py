"""OpenTelemetry spans from the observer's records, built and encoded off the loop.

:func:`build_span_exporter` follows the OTel environment (:mod:`.config`): off, our OTLP writer
(HTTP/protobuf, HTTP/JSON, gRPC), the embedded default (rotated OTLP-JSON lines in
``MEMRA_OBS_SPANS_FILE``), or any SDK exporter by entry point (slow, universal). The encoders
are our own: the SDK's per-span path measured 22.7 µs a span here, too much beside a round; plain
tuples (:mod:`.spans`) written straight to the wire (:mod:`.otlp`) cost a few µs. Nothing here
imports opentelemetry-proto; grpcio only the gRPC sender does (:mod:`.transport`), when chosen.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

from ..environment import ConfigError, Settings
from ..timeline import MAX_OPEN
from ..version import __version__
from .config import (
    INSTANCE,
    OTEL_TRACES_EXPORTER,
    OtlpConfig,
    instance_id,
    resource_attributes,
    traces_exporters,
)
from .exporter import Output, SpanExporter
from .spans import SpanBuilder, burst_span_id, round_span_id

__all__ = ["SpanBuilder", "SpanExporter", "build_span_exporter", "burst_span_id", "round_span_id"]

SCOPE_NAME = "memra_obs"
_FORCED = {"otlp": None, "otlp_proto_http": "http/protobuf", "otlp_proto_grpc": "grpc"}


def build_span_exporter(
    settings: Settings, env: Mapping[str, str] | None = None, max_open: int = MAX_OPEN
) -> SpanExporter | None:
    """The span exporter the environment asks for, or None when spans are off; a value it
    cannot use raises :class:`~memra_obs.environment.ConfigError` and nothing is started."""
    env = os.environ if env is None else env
    names = traces_exporters(env)
    if not names:
        return None
    resource = _resource(env)
    outputs: list[Output] = []
    try:
        for name in names:
            if name != "file" or settings.spans_file:
                outputs.append(_output(name, settings, env, resource))
    except BaseException:
        for o in outputs:
            o.sender.close()
        raise
    if not outputs:
        return None
    return SpanExporter(outputs, round_spans=settings.round_spans, max_open=max_open)


def _resource(env: Mapping[str, str]) -> Any:
    """The SDK's ``Resource.create()`` (``telemetry.sdk.*``, its detectors) with ``env``'s
    ``OTEL_*`` resource: its own ``OTEL_RESOURCE_ATTRIBUTES`` detector reads ``os.environ``
    whatever ``env`` says, so the attributes it added from there are taken back out (a
    ``service.instance.id`` of the process's own, which one of them hid, back in)."""
    from opentelemetry.sdk import resources

    own = resource_attributes(env)
    res = resources.Resource.create(own)
    attrs = dict(res.attributes)
    var = "OTEL_RESOURCE_ATTRIBUTES"
    if env is not os.environ and env.get(var) != os.environ.get(var):
        stray = set(resources.OTELResourceDetector().detect().attributes) - set(own)
        attrs = {k: v for k, v in attrs.items() if k not in stray}
    attrs.setdefault(INSTANCE, instance_id())  # the SDK makes one from 1.43, before it none
    # semconv: an SDK other than the official one names itself ("opentelemetry" is reserved)
    attrs.update({"telemetry.sdk.name": "memra_obs", "telemetry.sdk.version": __version__})
    return resources.Resource(attrs, res.schema_url)


def _output(name: str, settings: Settings, env: Mapping[str, str], res: Any) -> Output:
    from .otlp import INSTANCE, JsonEncoder, ProtoEncoder
    from .transport import FileSender, GrpcSender, HttpSender, SdkSender

    def enc(cls: Any) -> Any:  # the SDK's own service.instance.id: a forked child's is its own
        renew = INSTANCE not in resource_attributes(env)
        attrs = dict(res.attributes)
        return cls(attrs, SCOPE_NAME, __version__, schema_url=res.schema_url, renew_instance=renew)

    if name == "file":  # lines well under the Collector file receivers' 1 MiB line limit
        path, req = settings.spans_file, settings.requests_file
        one = req and os.path.realpath(req) == os.path.realpath(path)  # a link to it too
        stream = os.path.abspath(path).startswith(("/dev/", "/proc/"))  # /dev/stdout for both
        if one and not stream and (not os.path.exists(path) or os.path.isfile(path)):
            # one file of spans and records: the report of it read no span of the mix
            raise ConfigError(f"{settings.named('requests_file')} and {settings.named('spans_file')} "
                              f"name one file ({req!r}): give each its own")  # fmt: skip
        try:  # opened now: else every span is dropped, said once, at the first write
            if path.endswith(os.sep):  # abspath() would drop the slash and create a file
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            sender = FileSender(path, settings.spans_file_max_bytes)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if exc.errno in (errno.EACCES, errno.EROFS):  # the default, in a read-only workdir
                why += (f" ({os.path.abspath(path)}: spans go there when no OTEL_* exporter is "
                        "set; name a file this process can write, or OTEL_TRACES_EXPORTER=none "
                        "for no spans)")  # fmt: skip
            raise ConfigError(f"{settings.named('spans_file')}={path!r}: {why}") from None
        return Output(name, enc(JsonEncoder), sender, max_bytes=256 << 10)
    if name not in _FORCED:
        from importlib.metadata import entry_points

        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        eps = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
        var = f"{OTEL_TRACES_EXPORTER}={name!r}"
        if name not in eps:
            known = ", ".join(sorted({*_FORCED, "file", "none", *eps}))
            raise ConfigError(f"{var}: no such span exporter; known: {known}")
        try:
            exporter = eps[name].load()()
        except Exception as exc:
            raise ConfigError(f"{var}: the exporter failed to start: {exc!r}") from exc
        # A request is one export() call: what it returns is that request's fate, whole.
        scope = InstrumentationScope(SCOPE_NAME, __version__)
        sdk = SdkSender(
            exporter, res, scope, renew_instance=INSTANCE not in resource_attributes(env)
        )
        return Output(name, None, sdk, max_spans=SdkSender.chunk, queue_requests=256)
    cfg = OtlpConfig.from_env(env, protocol=_FORCED[name])
    if cfg.protocol != "grpc":
        json = cfg.protocol == "http/json"
        return Output(name, enc(JsonEncoder if json else ProtoEncoder), HttpSender(cfg, json=json))
    try:
        return Output(name, enc(ProtoEncoder), GrpcSender(cfg))
    except ImportError:
        need = "needs grpcio (pip install 'memra_obs[otlp]')"
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL=grpc {need}") from None
