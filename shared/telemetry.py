"""OpenTelemetry tracing setup: one TracerProvider per process, named after its service."""
from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

log = logging.getLogger(__name__)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the global TracerProvider with service.name `kvmesh-<service>`.

    Spans go to OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, and
    nowhere otherwise. OpenTelemetry lets a process set its provider only once, so a second
    call returns the provider already installed (whatever its service name).
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    name = service_name if service_name.startswith("kvmesh-") else f"kvmesh-{service_name}"
    # process.pid tells replicas of one service apart in a trace (which decode worker served, which died).
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name, "process.pid": os.getpid()}))
    if any(os.environ.get(v) for v in _ENDPOINT_VARS):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads the endpoint itself
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:  # lost a race with another installer
        log.warning("a TracerProvider was already installed; %s spans go there", name)
        return trace.get_tracer_provider()  # type: ignore[return-value]
    return provider


def attach_memory_exporter(provider: TracerProvider | None = None) -> InMemorySpanExporter:
    """For tests: records every finished span in memory (synchronously, no batching delay)."""
    provider = provider or setup_tracing("test")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
