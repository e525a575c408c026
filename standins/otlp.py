"""A stand-in OpenTelemetry collector: a real OTLP/HTTP receiver on 127.0.0.1.

It takes ``POST /v1/traces`` as an exporter sends it (protobuf, optionally gzip), decodes it with
the OpenTelemetry protobuf package (``ExportTraceServiceRequest``), and keeps every span as
plain values (``ReceivedSpan``) for tests, the demo and the benchmark to look at. It is not a
collector: nothing is forwarded or stored.

Faults, set at any time with ``mode``: ``accept`` (200), ``refuse`` (500, which OTLP exporters
do not retry), ``hang`` (take the request and answer nothing until ``release`` or ``stop``:
a collector that stopped responding).
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from standins.server import LocalServer

Mode = Literal["accept", "refuse", "hang"]
KIND = "openinference.span.kind"
PROTOBUF = "application/x-protobuf"


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, which)


def _attributes(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        out[pair.key] = _value(pair.value)
    return out


@dataclass(frozen=True)
class ReceivedEvent:
    name: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived. Ids are lowercase hex; ``kind`` is the OpenInference span kind
    attribute (``AGENT``, ``LLM``, ...); ``status`` is ``unset``, ``ok`` or ``error``."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    kind: str | None
    attributes: dict[str, Any]
    status: str
    status_message: str
    scope: str
    resource: dict[str, Any] = field(default_factory=dict)
    events: list[ReceivedEvent] = field(default_factory=list)


_STATUS = {0: "unset", 1: "ok", 2: "error"}


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(body)
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = _attributes(span.attributes)
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex() or None,
                        kind=attributes.get(KIND),
                        attributes=attributes,
                        status=_STATUS.get(span.status.code, "unset"),
                        status_message=span.status.message,
                        scope=scope_spans.scope.name,
                        resource=resource,
                        events=[
                            ReceivedEvent(event.name, _attributes(event.attributes))
                            for event in span.events
                        ],
                    )
                )
    return spans


class OtlpReceiver(LocalServer):
    """``async with OtlpReceiver() as collector:`` then point an exporter at ``endpoint``."""

    shutdown_timeout = 0.5

    def __init__(self, mode: Mode = "accept") -> None:
        self.mode: Mode = mode
        self.spans: list[ReceivedSpan] = []
        self.requests = 0  # every POST, whatever the mode did with it
        self.body_bytes: list[int] = []  # each POST's size as sent (before decompressing)
        self.hanging = 0  # requests held right now
        super().__init__()
        self._release = asyncio.Event()
        self._changed = asyncio.Condition()

    @property
    def endpoint(self) -> str:
        """The full traces URL (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""
        return self.url + "/v1/traces"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/traces", self._traces)

    def release(self) -> None:
        """Let every held request go (answered 200, its spans kept); later ones hang again
        while the mode is ``hang``."""
        self._release.set()
        self._release = asyncio.Event()

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        by_trace: dict[str, list[ReceivedSpan]] = {}
        for span in self.spans:
            by_trace.setdefault(span.trace_id, []).append(span)
        return by_trace

    def named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.name == name]

    async def wait_for(self, *, spans: int = 0, hanging: int = 0, requests: int = 0) -> None:
        """Until at least that many spans were kept, requests are held, requests arrived.
        No timeout of its own: wrap it in ``asyncio.timeout`` where a test needs one."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: (
                    len(self.spans) >= spans
                    and self.hanging >= hanging
                    and self.requests >= requests
                )
            )

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.body_bytes.append(len(body))
        encoding = request.headers.get("content-encoding", "").lower()
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        self.requests += 1
        await self._notify()
        if self.mode == "refuse":
            return web.Response(status=500, text="refused by the stand-in collector")
        if self.mode == "hang":
            released = self._release
            self.hanging += 1
            await self._notify()
            try:
                await released.wait()
            finally:
                self.hanging -= 1
        self.spans.extend(decode(body))
        await self._notify()
        answer = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type=PROTOBUF)
