"""Traces of turns in the OpenInference conventions, exported over OTLP/HTTP (OpenTelemetry).

config      TraceConfig / TraceOptions from settings (the standard OTEL_* variables, TRACE_*)
spans       Tracer and the span handles the agent loop calls: turn, model request, tool,
            compaction
attributes  OpenInference attribute names and the flattening of messages into them
export      the SDK pipeline (imported only when tracing is on): batch export, counted losses,
            bounded flush and shutdown
links       TRACE_URL_TEMPLATE

Import from the modules: this package imports nothing, because ``core.settings`` checks
``TRACE_URL_TEMPLATE`` with ``links`` and must not pull the SDK or the providers in.
"""
