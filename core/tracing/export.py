"""Getting spans to the collector without ever making a turn wait for it, and counting losses.

The SDK's ``BatchSpanProcessor`` already keeps export off the caller's path: ending a span
appends it to a bounded in-memory queue, and a background thread sends batches over OTLP/HTTP.
What it does not do is say what it lost: a full queue drops the oldest span with a log line
and nothing to count. So it is wrapped:

- ``CountingProcessor`` admits a span only while fewer than ``max_queue_size`` admitted spans
  have yet to reach the exporter; past that it drops the span itself (``queue_full``), so the
  SDK's queue never overflows and every loss is one we counted. The check is a lock and two
  integer operations: the cost a turn pays per span whatever the collector does.
- ``CountingExporter`` releases spans as the batch thread hands them over and counts those of
  a batch that failed (``export_failed``: refused, timed out, unreachable, after the
  exporter's own retries within its timeout).
- ``shutdown`` waits at most the time given; spans still queued then are counted as
  ``shutdown`` and abandoned (the batch thread is a daemon: it cannot hold the process up).

Flushing and shutting down block on the network, so they run in a thread with a deadline
rather than trusting the SDK's timeouts, which in this version are not all honoured.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from core.metrics import TRACE_SPANS_DROPPED
from core.tracing.config import TraceConfig

log = logging.getLogger(__name__)


class _Admission:
    """How many admitted spans have not yet been handed to the exporter (shared, locked)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pending = 0
        self.closed = False
        self.lock = threading.Lock()

    def admit(self) -> bool:
        with self.lock:
            if self.closed:
                TRACE_SPANS_DROPPED.labels("shutdown").inc()
                return False
            if self.pending >= self.capacity:
                TRACE_SPANS_DROPPED.labels("queue_full").inc()
                return False
            self.pending += 1
            return True

    def release(self, count: int) -> bool:
        """``False`` once closed: the spans were already counted as lost at shutdown."""
        with self.lock:
            if self.closed:
                return False
            self.pending = max(0, self.pending - count)
            return True

    def close(self) -> int:
        with self.lock:
            self.closed = True
            lost, self.pending = self.pending, 0
            return lost


class CountingExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, admission: _Admission) -> None:
        self.inner = inner
        self.admission = admission
        self._shut = False
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        counted = self.admission.release(len(spans))
        if not counted:  # after a shutdown that gave up: counted as lost, never sent
            return SpanExportResult.FAILURE
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
        max_export_batch_size: int,
        schedule_delay_millis: float,
        shutdown_seconds: float = 5.0,
    ) -> None:
        self._admission = _Admission(max_queue_size)
        self._exporter = CountingExporter(exporter, self._admission)
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
        if self._admission.admit():
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
        span_limits=SpanLimits(max_span_attributes=config.max_span_attributes),
        shutdown_on_exit=True,  # bounded (shutdown_within), so safe at exit
    )
    exporter = OTLPSpanExporter(
        endpoint=config.endpoint, headers=config.headers, timeout=config.timeout_seconds
    )
    processor = CountingProcessor(
        exporter,
        max_queue_size=config.max_queue_size,
        max_export_batch_size=config.max_export_batch_size,
        schedule_delay_millis=config.schedule_delay_millis,
        shutdown_seconds=config.timeout_seconds,
    )
    provider.add_span_processor(processor)
    return provider, processor
