"""Getting spans to the collector without ever making a turn wait for it, and counting losses.

The SDK's ``BatchSpanProcessor`` already keeps export off the caller's path: ending a span
appends it to a bounded in-memory queue, and a background thread sends batches over OTLP/HTTP.
What it does not do is say what it lost: a full queue drops the oldest span with a log line
and nothing to count. So it is wrapped:

- ``CountingProcessor`` admits a span only while fewer than ``max_queue_size`` admitted spans,
  and fewer than ``max_queue_bytes`` of their estimated encoded size (``span_bytes``), have yet
  to reach the exporter; past either it drops the span itself (``queue_full``), so the SDK's
  queue never overflows, a slow collector holds a bounded amount of memory (spans of a long
  conversation are large: counted in spans alone, 2,048 of them could hold a gigabyte) and
  every loss is one we counted. The check is a lock, a pass over the span's attributes and a
  few integer operations: the cost a turn pays per span whatever the collector does.
- ``CountingExporter`` releases spans as the batch thread hands them over, sends them in
  requests of at most ``max_batch_bytes`` (a collector refuses a larger request whole), drops a
  span that alone exceeds it (``too_large``) and counts those of a request that failed
  (``export_failed``: refused, timed out, unreachable, after the exporter's own retries within
  its timeout).
- ``shutdown`` waits at most the time given; spans still queued then are counted as
  ``shutdown`` and abandoned (the batch thread is a daemon: it cannot hold the process up).

Flushing and shutting down block on the network, so they run in a thread with a deadline
rather than trusting the SDK's timeouts, which in this version are not all honoured.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from core.metrics import TRACE_SPANS_DROPPED
from core.tracing.config import TraceConfig

log = logging.getLogger(__name__)


# What a span costs on the wire besides its attributes' keys and values (ids, times, kind,
# status, the protobuf framing of each field), rounded up: the estimate must not fall short of
# the encoded size, or a request sized by it could pass a collector's limit.
_SPAN_OVERHEAD_BYTES = 160
_FIELD_OVERHEAD_BYTES = 8  # a key-value pair's tags and lengths
_NUMBER_BYTES = 10  # the longest varint; a double is 8


def _value_bytes(value: object) -> int:
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8"))
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, (tuple, list)):
        return sum(_value_bytes(item) + _FIELD_OVERHEAD_BYTES for item in value)
    return _NUMBER_BYTES


def _attributes_bytes(attributes: Mapping[str, object] | None) -> int:
    if not attributes:
        return 0
    return sum(
        len(key) + _value_bytes(value) + _FIELD_OVERHEAD_BYTES for key, value in attributes.items()
    )


def span_bytes(span: ReadableSpan) -> int:
    """An upper estimate of ``span``'s size in an OTLP request. A finished span's attributes
    are frozen, so the processor (admitting) and the exporter (releasing) get the same figure."""
    size = _SPAN_OVERHEAD_BYTES + len(span.name.encode("utf-8"))
    size += len((span.status.description or "").encode("utf-8"))
    size += _attributes_bytes(span.attributes)
    for event in span.events:
        size += _SPAN_OVERHEAD_BYTES + len(event.name) + _attributes_bytes(event.attributes)
    for link in span.links:
        size += _SPAN_OVERHEAD_BYTES + _attributes_bytes(link.attributes)
    return size


class _Admission:
    """How many admitted spans, and how many of their bytes, have not yet been handed to the
    exporter (shared, locked)."""

    def __init__(self, capacity: int, capacity_bytes: int) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.pending = 0
        self.pending_bytes = 0
        self.closed = False
        self.lock = threading.Lock()

    def admit(self, size: int) -> bool:
        with self.lock:
            if self.closed:
                TRACE_SPANS_DROPPED.labels("shutdown").inc()
                return False
            if self.pending >= self.capacity or self.pending_bytes + size > self.capacity_bytes:
                TRACE_SPANS_DROPPED.labels("queue_full").inc()
                return False
            self.pending += 1
            self.pending_bytes += size
            return True

    def release(self, count: int, size: int) -> bool:
        """``False`` once closed: the spans were already counted as lost at shutdown."""
        with self.lock:
            if self.closed:
                return False
            self.pending = max(0, self.pending - count)
            self.pending_bytes = max(0, self.pending_bytes - size)
            return True

    def close(self) -> int:
        with self.lock:
            self.closed = True
            lost, self.pending, self.pending_bytes = self.pending, 0, 0
            return lost


def _requests(
    spans: Sequence[ReadableSpan], sizes: Sequence[int], limit: int
) -> Iterator[list[ReadableSpan]]:
    """``spans`` in order, cut into runs whose estimated sizes add up to at most ``limit``
    (a span over it alone is left out: the caller counts it)."""
    run: list[ReadableSpan] = []
    total = 0
    for span, size in zip(spans, sizes, strict=True):
        if size > limit:
            continue
        if run and total + size > limit:
            yield run
            run, total = [], 0
        run.append(span)
        total += size
    if run:
        yield run


class CountingExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, admission: _Admission, *, max_batch_bytes: int) -> None:
        self.inner = inner
        self.admission = admission
        self.max_batch_bytes = max_batch_bytes
        self._shut = False
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        sizes = [span_bytes(span) for span in spans]
        counted = self.admission.release(len(spans), sum(sizes))
        if not counted:  # after a shutdown that gave up: counted as lost, never sent
            return SpanExportResult.FAILURE
        result = SpanExportResult.SUCCESS
        too_large = sum(1 for size in sizes if size > self.max_batch_bytes)
        if too_large:
            TRACE_SPANS_DROPPED.labels("too_large").inc(too_large)
            log.warning(
                "tracing: %d spans larger than TRACE_BATCH_BYTES (%d) were dropped",
                too_large,
                self.max_batch_bytes,
            )
            result = SpanExportResult.FAILURE
        for run in _requests(spans, sizes, self.max_batch_bytes):
            if self._send(run) is not SpanExportResult.SUCCESS:
                result = SpanExportResult.FAILURE
        return result

    def _send(self, spans: list[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # the SDK would log and swallow it; count it first
            log.exception("trace export raised")
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            TRACE_SPANS_DROPPED.labels("export_failed").inc(len(spans))
        return result

    def shutdown(self) -> None:
        """Once (the processor may call it early, to stop a stuck export's retries)."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _within(seconds: float, work: Callable[[], object], what: str) -> bool:
    """Run blocking ``work`` in a daemon thread; ``False`` if it is not done in time."""
    done = threading.Event()

    def run() -> None:
        try:
            work()
        except Exception:
            log.exception("tracing: %s failed", what)
        finally:
            done.set()

    threading.Thread(target=run, name=f"tracing-{what}", daemon=True).start()
    finished = done.wait(seconds)
    if not finished:
        log.warning("tracing: %s did not finish within %.1fs; giving up on it", what, seconds)
    return finished


class CountingProcessor(SpanProcessor):
    """A ``BatchSpanProcessor`` whose every lost span is counted (see the module)."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int,
        max_queue_bytes: int,
        max_export_batch_size: int,
        max_batch_bytes: int,
        schedule_delay_millis: float,
        shutdown_seconds: float = 5.0,
    ) -> None:
        self._admission = _Admission(max_queue_size, max_queue_bytes)
        self._exporter = CountingExporter(
            exporter, self._admission, max_batch_bytes=max_batch_bytes
        )
        self._batch = BatchSpanProcessor(
            self._exporter,
            max_queue_size=max_queue_size,
            max_export_batch_size=max_export_batch_size,
            schedule_delay_millis=schedule_delay_millis,
        )
        self._shutdown_seconds = shutdown_seconds
        self._stopped = False

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None or not context.trace_flags.sampled:
            return
        if self._admission.admit(span_bytes(span)):
            self._batch.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return _within(timeout_millis / 1000, self._batch.force_flush, "flush")

    def shutdown_within(self, seconds: float) -> None:
        """Export what is queued for at most ``seconds``; count the rest as lost."""
        if self._stopped:
            return
        self._stopped = True
        finished = _within(seconds, self._batch.shutdown, "shutdown")
        lost = self._admission.close()
        if not finished:  # an export is stuck: stop its retries; the queue is never sent
            _within(seconds, self._exporter.shutdown, "exporter shutdown")
        if lost:
            TRACE_SPANS_DROPPED.labels("shutdown").inc(lost)
            log.warning("tracing: %d spans were not exported before shutdown", lost)

    def shutdown(self) -> None:
        self.shutdown_within(self._shutdown_seconds)


def build_provider(config: TraceConfig) -> tuple[TracerProvider, CountingProcessor]:
    """The SDK tracer provider for ``config`` and its processor (the caller shuts it down).

    Nothing here is set as OpenTelemetry's global provider: the application hands this one
    to ``core.tracing.Tracer``, and other libraries' instrumentation is not enrolled by it.
    """
    resource = Resource({"service.name": config.service_name, **config.resource_attributes})
    provider = TracerProvider(
        resource=resource,
        span_limits=SpanLimits(
            max_span_attributes=config.max_span_attributes,
            max_attribute_length=config.max_attribute_chars,
            max_span_attribute_length=config.max_attribute_chars,
        ),
        shutdown_on_exit=True,  # bounded (shutdown_within), so safe at exit
    )
    exporter = OTLPSpanExporter(
        endpoint=config.endpoint, headers=config.headers, timeout=config.timeout_seconds
    )
    processor = CountingProcessor(
        exporter,
        max_queue_size=config.max_queue_size,
        max_queue_bytes=config.max_queue_bytes,
        max_export_batch_size=config.max_export_batch_size,
        max_batch_bytes=config.max_batch_bytes,
        schedule_delay_millis=config.schedule_delay_millis,
        shutdown_seconds=config.timeout_seconds,
    )
    provider.add_span_processor(processor)
    return provider, processor
