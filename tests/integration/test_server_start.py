"""A server whose start fails (one of its ports is taken) leaves nothing behind: the error
names the port, every other port it had bound is free again, and none of its threads run.
The worker (gRPC, data plane, HTTP API, metrics) and the router (gRPC, HTTP API, metrics)."""

from __future__ import annotations

import socket
import threading

import pytest
from helpers import TEST_IDENTITY, free_port, wait_until

from kvmesh.router.core import RouterCore
from kvmesh.router.service import RouterServer
from kvmesh.worker.async_engine import AsyncEngine
from kvmesh.worker.engine import LLMEngine
from kvmesh.worker.server import WorkerServer

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engine(smol_src):
    aeng = AsyncEngine(LLMEngine(MODEL, kv_cache_memory="32MiB"))
    assert aeng.engine.metrics is not None  # else no metrics port would be served
    yield aeng
    aeng.shutdown()


def held(port: int) -> socket.socket:
    """A listening socket on a loopback port: a server that tries to bind it fails."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def started_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The failed server's threads still alive: kvmesh's own (its loop, the metrics server,
    the data plane) and any that would keep the process from exiting. (grpc.aio's poller
    is one per process, started by the first server, and stays.)"""
    return [
        t
        for t in threading.enumerate()
        if t not in before and t.is_alive() and (t.name.startswith("kvmesh-") or not t.daemon)
    ]


def assert_nothing_left(ports: dict[str, int], taken: str, before: set[threading.Thread]):
    for name, port in ports.items():
        if name != taken:
            assert is_free(port), f"the {name} port {port} is still bound after a failed start"
    assert wait_until(lambda: not started_threads(before), timeout=10), (
        f"threads still running after a failed start: {started_threads(before)}"
    )


@pytest.mark.parametrize("taken", ["grpc", "data plane", "http", "metrics"])
def test_a_worker_that_cannot_start_leaves_no_port_bound_and_no_thread(engine, taken):
    ports = {name: free_port() for name in ("grpc", "data plane", "http", "metrics")}
    srv = WorkerServer(
        engine,
        port=ports["grpc"],
        data_plane_port=ports["data plane"],
        http_port=ports["http"],
        metrics_port=ports["metrics"],
        identity=TEST_IDENTITY,  # the data plane runs only with the cluster secret
    )
    assert srv.data_plane_enabled
    before = set(threading.enumerate())
    with held(ports[taken]), pytest.raises(OSError, match=f":{ports[taken]}\\b"):
        srv.start_in_thread()
    assert_nothing_left(ports, taken, before)
    assert srv.data_plane is None and srv.metrics_server is None
    srv.stop_in_thread(grace=0)  # a no-op: nothing to stop


@pytest.mark.parametrize("taken", ["grpc", "http", "metrics"])
def test_a_router_that_cannot_start_leaves_no_port_bound_and_no_thread(taken):
    ports = {name: free_port() for name in ("grpc", "http", "metrics")}
    srv = RouterServer(
        RouterCore(), port=ports["grpc"], http_port=ports["http"], metrics_port=ports["metrics"]
    )
    before = set(threading.enumerate())
    with held(ports[taken]), pytest.raises(OSError, match=f":{ports[taken]}\\b"):
        srv.start_in_thread()
    assert_nothing_left(ports, taken, before)
    assert srv.metrics_server is None


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_message_mb=0),
        dict(metrics_port=65536),
        dict(prometheus_sd_file="/no/such/folder/targets.json"),
    ],
)
def test_a_router_refused_at_construction_leaves_no_callback_on_the_core(bad):
    core = RouterCore()
    with pytest.raises(ValueError, match=next(iter(bad))):
        RouterServer(core, **bad)
    assert core.on_dead == []


def test_a_router_serves_as_soon_as_a_worker_registers_not_at_its_next_housekeeping():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from helpers import register_worker

    srv = RouterServer(RouterCore(report_timeout_s=3600.0), housekeeping_s=3600.0)
    srv.start_in_thread()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def status():
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status

            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING  # no worker yet
            register_worker(
                srv, worker_id="w0", address="127.0.0.1:1", model_fp="ab", block_size=16
            )
            # housekeeping would take an hour: only the registration can have turned it
            assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 5)
    finally:
        srv.stop_in_thread(grace=0)
