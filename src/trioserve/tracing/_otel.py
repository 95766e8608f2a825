"""Traces as OpenTelemetry spans, exported over OTLP/HTTP (protobuf) by the SDK's batch
span processor, whose own thread does the exporting: the event loop only builds spans.

Imported only in opentelemetry mode (the extra ``trioserve[tracing]``). Spans follow
Triton's: a request's root span ``InferRequest``; under it a span named after the model
(``REQUEST_START``, ``QUEUE_START``, ``REQUEST_END`` as events) and under that a
``compute`` span (the ``COMPUTE_*`` events); an ensemble step's or a BLS request's model
span sits under its parent's model span. A generation is vLLM's ``llm_request`` span
with its ``gen_ai.*`` attributes. A client's W3C ``traceparent`` (and ``tracestate``)
makes the root span a child of the client's span.

Span times are the wall clock: trio's clock plus the offset between the two, read
once, so the intervals between events are exactly the trace's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ._config import TraceConfig
from ._trace import COMPUTE_START, GenerationRecord, Trace, now_ns

_CARRIED = ("traceparent", "tracestate")


class OtelExporter:
    """The ``TraceSink`` of opentelemetry mode."""

    def __init__(self, config: TraceConfig) -> None:
        self._provider = TracerProvider(resource=Resource.create(dict(config.resource)))
        self._provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=config.url),
                max_queue_size=config.bsp_max_queue_size,
                schedule_delay_millis=config.bsp_schedule_delay_ms,
                max_export_batch_size=config.bsp_max_export_batch_size,
            )
        )
        self._tracer = self._provider.get_tracer("trioserve")
        self._propagator = TraceContextTextMapPropagator()
        self._offset: int | None = None  # wall clock - trio's clock, in ns

    def context(self, headers: Mapping[Any, Any]) -> Mapping[str, str] | None:
        """The W3C trace context among a request's headers (HTTP: bytes; gRPC: str)."""
        carried = {}
        for name in _CARRIED:
            value = headers.get(name)
            if value is None:
                value = headers.get(name.encode())
            if value is not None:
                carried[name] = value.decode("latin-1") if isinstance(value, bytes) else value
        return carried if "traceparent" in carried else None

    def collect(self, trace: Trace) -> None:
        if self._offset is None:
            self._offset = time.time_ns() - now_ns()
        parent = Context() if trace.context is None else self._propagator.extract(trace.context)
        if trace.generation is not None:
            self._generation(trace, trace.generation, parent)
            return
        start, end = trace.timestamps[0][1], trace.timestamps[-1][1]
        root = self._tracer.start_span(
            "InferRequest", parent, kind=otel.SpanKind.SERVER, start_time=self._wall(start)
        )
        self._model_span(trace, otel.set_span_in_context(root))
        root.end(self._wall(end))

    def _model_span(self, trace: Trace, parent: Context) -> None:
        stamps = trace.timestamps
        span = self._tracer.start_span(
            trace.model_name,
            parent,
            start_time=self._wall(stamps[0][1]),
            attributes={
                "triton.model_name": trace.model_name,
                "triton.model_version": trace.model_version,
                "triton.trace_id": trace.id,
                "triton.trace_parent_id": trace.parent_id,
                "triton.request_id": trace.request_id,
            },
        )
        compute = [(n, ns) for n, ns in stamps if n.startswith("COMPUTE_")]
        for name, ns in stamps:
            if not name.startswith("COMPUTE_"):
                span.add_event(name, timestamp=self._wall(ns))
        inside = otel.set_span_in_context(span)
        if compute and compute[0][0] == COMPUTE_START:
            compute_span = self._tracer.start_span(
                "compute", inside, start_time=self._wall(compute[0][1])
            )
            for name, ns in compute:
                compute_span.add_event(name, timestamp=self._wall(ns))
            compute_span.end(self._wall(compute[-1][1]))
        for child in trace.children:
            self._model_span(child, inside)
        span.end(self._wall(stamps[-1][1]))

    def _generation(self, trace: Trace, record: GenerationRecord, parent: Context) -> None:
        sampling = record.sampling
        attributes: dict[str, Any] = {
            "gen_ai.response.model": trace.model_name,
            "gen_ai.request.id": record.request_id,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.n": sampling.n,
            "gen_ai.usage.prompt_tokens": record.prompt_tokens,
            "gen_ai.usage.completion_tokens": record.completion_tokens,
            "gen_ai.usage.num_sequences": sampling.n,
            "gen_ai.latency.e2e": record.end - record.arrival,
            "gen_ai.response.finish_reasons": (record.finish_reason,),
        }
        scheduled = record.scheduled
        if scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = scheduled - record.queued
            if record.first_token is not None and record.last_token is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = record.first_token - scheduled
                attributes["gen_ai.latency.time_in_model_decode"] = (
                    record.last_token - record.first_token
                )
                attributes["gen_ai.latency.time_in_model_inference"] = record.last_token - scheduled
        if record.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = record.first_token - record.arrival
        span = self._tracer.start_span(
            "llm_request",
            parent,
            kind=otel.SpanKind.SERVER,
            start_time=self._wall(trace.timestamps[0][1]),
            attributes=attributes,
        )
        for name, ns in trace.timestamps:
            span.add_event(name, timestamp=self._wall(ns))
        span.end(self._wall(trace.timestamps[-1][1]))

    def _wall(self, ns: int) -> int:
        assert self._offset is not None
        return ns + self._offset

    def shutdown(self) -> None:
        """Export what is queued, then stop (in a worker thread)."""
        self._provider.shutdown()
