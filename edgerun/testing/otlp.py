"""A small OTLP/HTTP traces receiver for tests and benchmarks: what a Collector would get, decoded.

It speaks the real wire format (``ExportTraceServiceRequest`` protobuf, POSTed to ``/v1/traces``), decoded with
the ``opentelemetry-proto`` messages the exporter itself encodes with, so a test sees exactly what a Jaeger or
Tempo behind a Collector would. ``refuse = True`` answers 503, as a collector that is down behind a proxy does.
Loopback only.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from edgerun.testing.ports import free_port


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    kind: str = "SPAN_KIND_INTERNAL"  # the OTLP enum's name: SPAN_KIND_CLIENT, SPAN_KIND_SERVER, ...


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def span_kind_name(kind: int) -> str:
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    return str(Span.SpanKind.Name(kind))


@dataclass
class OtlpReceiver:
    port: int
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    refuse: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def take(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            resource=resource,
                            kind=span_kind_name(span.kind),
                        )
                    )
        with self.lock:
            self.spans.extend(received)
            self.requests += 1

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """Spans by trace id."""
        with self.lock:
            spans = list(self.spans)
        out: dict[str, list[ReceivedSpan]] = {}
        for span in spans:
            out.setdefault(span.trace_id, []).append(span)
        return out


@contextmanager
def run_otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver(port=free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if receiver.refuse or self.path != "/v1/traces":
                self.send_response(503 if receiver.refuse else 404)
                self.end_headers()
                return
            receiver.take(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", receiver.port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class RemoteReceiver:
    """The handle of a receiver running in a child process: its endpoint and how many spans it took so far."""

    endpoint: str
    conn: Any

    def span_count(self) -> int:
        self.conn.send("count")
        return int(self.conn.recv())


def _serve_in_child(conn: Any) -> None:
    with run_otlp_receiver() as receiver:
        conn.send(receiver.endpoint)
        while conn.recv() == "count":
            conn.send(len(receiver.spans))


@contextmanager
def run_otlp_receiver_process() -> Iterator[RemoteReceiver]:
    """The receiver in a process of its own, so decoding what a node exports costs the node's process nothing
    (a benchmark of the node's CPU then counts what a collector elsewhere would not cost it)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_serve_in_child, args=(theirs,), name="otlp-receiver", daemon=True)
    child.start()
    try:
        if not ours.poll(30.0):
            raise RuntimeError("the OTLP receiver process did not start in 30 s")
        yield RemoteReceiver(endpoint=ours.recv(), conn=ours)
    finally:
        try:
            ours.send("stop")
        except OSError:
            pass
        child.join(10.0)
        if child.is_alive():
            child.kill()
            child.join()
