"""A component's Prometheus endpoint: its own registry, RPC error replies by code, trace spans
timed, and nothing served unless enabled."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from backstop import BACKSTOP, PATIENT
from tandem.common.config.logs import MetricsConfig
from tandem.common.errors import RequestFailed
from tandem.common.messages import AckLease, GetBufferStats, ReleaseLease
from tandem.common.metrics import MetricsEndpoint, served_endpoints
from tandem.common.rpc import RpcClient, RpcServer
from tandem.common.trace import Tracer

ON = MetricsConfig(enabled=True, port=0)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=BACKSTOP) as reply:
        return reply.read().decode()


async def test_rpc_error_replies_are_counted_by_code(tmp_path, zmq_sockets_closed):
    server = RpcServer("tcp://127.0.0.1:0", name="buffer", transport=PATIENT)

    @server.handler(AckLease)
    async def on_ack(msg, ctx):
        raise RequestFailed("unknown_lease", f"no lease {msg.lease_id}")

    @server.handler(GetBufferStats)
    async def on_stats(msg, ctx):
        raise ValueError("boom")

    endpoint = MetricsEndpoint(ON, "buffer", run_dir=tmp_path)
    endpoint.rpc_errors(server)
    client = RpcClient(await server.start(), peer="buffer", transport=PATIENT)
    try:
        url = endpoint.start()
        assert served_endpoints(tmp_path) == [("buffer", url)]
        for msg in (AckLease(lease_id="a"), AckLease(lease_id="b"), GetBufferStats(),
                    ReleaseLease(lease_id="x")):
            with pytest.raises(RequestFailed):
                await client.call(msg)
        text = await asyncio.to_thread(scrape, url)
    finally:
        endpoint.close()
        await client.close()
        await server.close()
    assert 'tandem_buffer_rpc_errors{code="unknown_lease"} 2.0' in text
    assert 'tandem_buffer_rpc_errors{code="internal"} 1.0' in text
    assert 'tandem_buffer_rpc_errors{code="unsupported"} 1.0' in text


def test_spans_are_timed_with_tokens_and_sync_bytes(tmp_path):
    tracer = Tracer(None, "trainer")  # no trace file: the metrics still see every span
    endpoint = MetricsEndpoint(ON, "trainer")
    endpoint.observe_spans(tracer)
    tracer.record("train", 10.0, 12.5, step=0, tokens=300)
    tracer.record("sync", 13.0, 13.25, version=1, method="checkpoint", bytes=4096)
    # an asynchronous plan's version: the copy on the step's path (no bytes), then the file
    # written and announced behind the next step, which moved the bytes
    tracer.record("sync", 15.0, 15.01, version=2, method="checkpoint", behind=True)
    tracer.record("publish", 15.01, 15.5, version=2, method="checkpoint", bytes=1024)
    tracer.record("wait", 14.0, 14.5, what="sample")
    tracer.event("buffer_fill", ready=3)  # an instant, not a duration: not timed
    try:
        text = scrape(endpoint.start())
    finally:
        endpoint.close()
    assert 'tandem_trainer_span_seconds_sum{kind="train",what=""} 2.5' in text
    assert 'tandem_trainer_span_seconds_sum{kind="sync",what="checkpoint"} 0.25' in text
    assert 'tandem_trainer_span_seconds_count{kind="wait",what="sample"} 1.0' in text
    assert "tandem_trainer_tokens_total 300.0" in text
    assert "tandem_trainer_weight_sync_bytes_total 5120.0" in text
    assert 'tandem_trainer_span_seconds_count{kind="publish",what="checkpoint"} 1.0' in text
    assert "buffer_fill" not in text


def test_disabled_by_default_serves_nothing_but_still_counts(tmp_path):
    endpoint = MetricsEndpoint(MetricsConfig(), "master", run_dir=tmp_path)
    steps = endpoint.counter("things", "things counted")
    steps.inc(2)
    assert endpoint.start() is None and endpoint.url is None
    assert not (tmp_path / "metrics").exists()
    assert endpoint.registry.get_sample_value("tandem_master_things_total") == 2.0


def test_explorer_ports_follow_the_base():
    config = MetricsConfig(enabled=True, port=9500)
    assert [MetricsEndpoint(config, c).port for c in ("master", "buffer", "trainer", "reward")] \
        == [9500, 9501, 9502, 9503]
    assert MetricsEndpoint(config, "explorer", "explorer-2", index=2).port == 9506
    with pytest.raises(ValueError, match="logging.metrics.port: 65533 leaves no room"):
        MetricsConfig(port=65533)


def test_close_releases_the_port_without_waiting_for_the_serving_loop(tmp_path):
    """A component's stop is not held by /metrics: prometheus_client's serving loop notices a
    shutdown only at its next poll (0.5 s), once per component on the way out of every run.
    The loop is held here (socketserver's `service_actions` hook, run on each pass) until
    close() has returned; a close() that waits for it never returns."""
    import socket
    import threading

    endpoint = MetricsEndpoint(ON, "master", run_dir=tmp_path)
    url = endpoint.start()
    server = endpoint._server
    passing, release = threading.Event(), threading.Event()

    def held() -> None:
        passing.set()
        release.wait(2 * BACKSTOP)  # past closer.join's bound: only the test lets it go

    server.service_actions = held
    assert passing.wait(BACKSTOP)
    closer = threading.Thread(target=endpoint.close, daemon=True)
    closer.start()
    closer.join(BACKSTOP)
    try:
        assert not closer.is_alive(), "close() waited for the serving loop"
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as s:  # the port is free again at once
            s.bind(("127.0.0.1", port))
    finally:
        release.set()
