"""OTLP end to end: the official OTLP/HTTP exporter behind a default BatchSpanProcessor,
and the environment-only setup, into a receiver on 127.0.0.1 that decodes each request
with opentelemetry-proto."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="opentelemetry-proto is in the test extra",
)
otlp_http = pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    reason="opentelemetry-exporter-otlp-proto-http is in the test extra",
)

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

import ppetrace  # noqa: E402


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver:
    """An OTLP/HTTP traces endpoint: decodes every request and keeps its spans."""

    def __init__(self) -> None:
        self.spans: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, request: Any) -> None:
        with self.lock:
            for rs in request.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans[int.from_bytes(s.span_id, "big")] = {
                            "name": s.name,
                            "trace_id": int.from_bytes(s.trace_id, "big"),
                            "parent_id": int.from_bytes(s.parent_span_id or b"\0", "big"),
                            "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
                            "resource": resource,
                        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_every_span_of_a_trainer_run_arrives_over_otlp(receiver: Receiver) -> None:
    reference = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(otlp_http.OTLPSpanExporter(endpoint=receiver.url))
    )
    provider.add_span_processor(SimpleSpanProcessor(reference))
    ppetrace.configure(tracer_provider=provider, service_name="otlp-run", rank=2)
    try:
        model = torch.nn.Linear(4, 1)
        data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(3)]
        trainer = ppetrace.Trainer(max_epochs=2, progress=False)
        trainer.fit(
            model,
            data,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=torch.nn.functional.mse_loss,
        )
        ppetrace.flush()
    finally:
        ppetrace.configure()
        provider.shutdown()
    sent = {s.context.span_id: s for s in reference.get_finished_spans()}
    assert len(sent) > 50 and set(receiver.spans) == set(sent)
    for span_id, got in receiver.spans.items():
        want = sent[span_id]
        assert got["name"] == want.name
        assert got["trace_id"] == want.context.trace_id
        assert got["parent_id"] == (want.parent.span_id if want.parent else 0)
        for key in ("ppetrace.step", "ppetrace.epoch", "thread.id"):
            assert got["attributes"].get(key) == (want.attributes or {}).get(key)
        assert got["resource"]["service.name"] == "otlp-run"
        assert got["resource"]["ppetrace.rank"] == 2
    steps = [s for s in receiver.spans.values() if s["name"] == "trainer.step"]
    assert len(steps) == 6 and {s["attributes"]["ppetrace.epoch"] for s in steps} == {0, 1}


def test_the_environment_alone_sets_up_otlp(receiver: Receiver) -> None:
    script = textwrap.dedent(
        """
        import ppetrace
        with ppetrace.trace("env.root"):
            for i in range(5):
                with ppetrace.trace("env.child", {"i": i}):
                    pass
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=receiver.url,
        OTEL_SERVICE_NAME="from-env",
        RANK="3",
    )
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    spans = list(receiver.spans.values())
    (root,) = [s for s in spans if s["name"] == "env.root"]
    children = [s for s in spans if s["name"] == "env.child"]
    assert sorted(s["attributes"]["i"] for s in children) == list(range(5))
    root_id = next(k for k, s in receiver.spans.items() if s is root)
    assert all(s["parent_id"] == root_id and s["trace_id"] == root["trace_id"] for s in children)
    assert root["resource"]["service.name"] == "from-env"
    assert root["resource"]["ppetrace.rank"] == 3
