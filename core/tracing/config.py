"""What tracing is configured to do, from settings: the standard ``OTEL_*`` variables and ours.

Read through ``Settings`` rather than left to the SDK's own environment look-ups, so a ``.env``
file configures tracing like everything else and tests build any configuration without touching
the process environment. Tracing is on only when an OTLP endpoint is given and
``OTEL_SDK_DISABLED`` is not true; otherwise ``TraceConfig.from_settings`` is ``None`` and no
OpenTelemetry SDK code is even imported.

Endpoints follow the OTLP exporter specification: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is
used as given; ``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL to which ``v1/traces`` is added.
Header values are secrets more often than not (a collector's API key), so an error about them
names the variable and the entry's position, never its text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

from core.errors import ConfigError
from core.settings import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_QUEUE_BYTES, Settings

# The specification's default is 10 s. A shorter one gives up on a hanging collector sooner
# (its queue drains, shutdown is bounded); OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT overrides it.
DEFAULT_EXPORT_TIMEOUT_SECONDS = 5.0
# OTel's default of 128 attributes a span would cut a long conversation's input messages (each
# message is a few attributes); the oldest would be dropped silently.
DEFAULT_MAX_SPAN_ATTRIBUTES = 4096
# The longest text attribute, in characters (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT overrides): a tool
# result reaches the model cut at core.tools.outcome.RESULT_CAP, so it is exported whole too;
# a longer message (a pasted log) is cut in the trace, not in the conversation.
DEFAULT_MAX_ATTRIBUTE_CHARS = 20_000


def _pairs(value: str | None, variable: str) -> dict[str, str]:
    """``key=value,key2=value2`` (values URL-encoded), as the OTel variables are written."""
    pairs: dict[str, str] = {}
    for position, entry in enumerate((value or "").split(","), start=1):
        if not entry.strip():
            continue
        key, sep, item = entry.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{variable}: entry {position} is not key=value")
        pairs[unquote(key).strip()] = unquote(item).strip()
    return pairs


@dataclass(frozen=True)
class TraceOptions:
    """What spans may carry: message and tool content, user ids; and the reply's trace link."""

    content: bool = True
    user_ids: bool = False
    url_template: str | None = None
    # The characters of input messages one model request's span carries at most, the newest
    # kept: a long conversation's span must fit in one request to the collector with room for
    # others beside it (half of TRACE_BATCH_BYTES).
    input_chars: int = DEFAULT_MAX_BATCH_BYTES // 2

    @classmethod
    def from_settings(cls, settings: Settings) -> TraceOptions:
        return cls(
            settings.trace_content,
            settings.trace_user_ids,
            settings.trace_url_template,
            input_chars=settings.trace_batch_bytes // 2,
        )


@dataclass(frozen=True)
class TraceConfig:
    endpoint: str  # the full OTLP/HTTP traces URL
    headers: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float = DEFAULT_EXPORT_TIMEOUT_SECONDS
    service_name: str = "slack-agent"
    resource_attributes: dict[str, str] = field(default_factory=dict)
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    schedule_delay_millis: float = 5000
    max_span_attributes: int = DEFAULT_MAX_SPAN_ATTRIBUTES
    max_attribute_chars: int = DEFAULT_MAX_ATTRIBUTE_CHARS
    max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    options: TraceOptions = field(default_factory=TraceOptions)

    @classmethod
    def from_settings(cls, settings: Settings) -> TraceConfig | None:
        """The configuration, or ``None`` when tracing is off (no endpoint, or disabled)."""
        if settings.otel_sdk_disabled:
            return None
        endpoint = settings.otel_exporter_otlp_traces_endpoint
        if not endpoint and settings.otel_exporter_otlp_endpoint:
            endpoint = settings.otel_exporter_otlp_endpoint.rstrip("/") + "/v1/traces"
        if not endpoint:
            return None
        if not endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"OTEL_EXPORTER_OTLP_ENDPOINT: {endpoint!r} is not an http(s) URL "
                "(traces are exported over OTLP/HTTP)"
            )
        headers = _pairs(settings.otel_exporter_otlp_headers, "OTEL_EXPORTER_OTLP_HEADERS")
        headers.update(
            _pairs(settings.otel_exporter_otlp_traces_headers, "OTEL_EXPORTER_OTLP_TRACES_HEADERS")
        )
        # Milliseconds, as the OpenTelemetry specification says (the Python SDK's own
        # reading of these variables takes seconds; ours follows the specification).
        millis = settings.otel_exporter_otlp_traces_timeout or settings.otel_exporter_otlp_timeout
        timeout = millis / 1000 if millis else DEFAULT_EXPORT_TIMEOUT_SECONDS
        return cls(
            endpoint=endpoint,
            headers=headers,
            timeout_seconds=timeout,
            service_name=settings.otel_service_name,
            resource_attributes=_pairs(
                settings.otel_resource_attributes, "OTEL_RESOURCE_ATTRIBUTES"
            ),
            max_queue_size=settings.otel_bsp_max_queue_size,
            max_export_batch_size=settings.otel_bsp_max_export_batch_size,
            schedule_delay_millis=settings.otel_bsp_schedule_delay,
            max_attribute_chars=(
                settings.otel_span_attribute_value_length_limit
                or settings.otel_attribute_value_length_limit
                or DEFAULT_MAX_ATTRIBUTE_CHARS
            ),
            max_queue_bytes=settings.trace_queue_bytes,
            max_batch_bytes=settings.trace_batch_bytes,
            options=TraceOptions.from_settings(settings),
        )
