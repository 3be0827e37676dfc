"""Deadlines and liveness with a real ``kvmesh worker`` process behind an in-process
router: a Generate with no deadline of its own ends at the server's default one (worker and
router); a worker dropped as dead has its streams cut at once with UNAVAILABLE (one that
leaves by itself finishes them); and a worker host frozen with SIGSTOP makes the streams
through the router and from a direct SDK client end with UNAVAILABLE (keepalive), instead
of hanging."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

import pytest
from helpers import free_port, register_worker, wait_until

from kvmesh.cluster import Client
from kvmesh.cluster.client import DeadlineExceeded, KvmeshError, Unavailable
from kvmesh.protos.security import ClusterIdentity
from kvmesh.router.core import RouterCore
from kvmesh.router.service import RouterServer

WORKER_DEADLINE_S = 6  # --request-timeout of the deadline test's own worker
LONG = dict(temperature=0.0, max_tokens=4000, ignore_eos=True)  # minutes on this CPU
PROMPT = [1, 504, 3458, 282, 260, 1345, 30]
BOUND_S = 60  # generous: a hang is what these tests catch, not a latency


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    path.write_text(os.urandom(32).hex() + "\n")
    return path


@contextlib.contextmanager
def worker_process(secret_file, request_timeout: float | None = None):
    """A ``kvmesh worker`` process of its own (so that it can be frozen); without a
    ``request_timeout``, the default one (an hour): only the test that is about the
    deadline gets a short one, the others must see UNAVAILABLE, never DEADLINE_EXCEEDED."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvmesh.cluster.cli", "worker",
        "--host", "127.0.0.1", "--port", str(port),
        "--cluster-secret-file", str(secret_file),
        "--kv-cache-memory", "64MiB", "--grace-period", "0",
    ]  # fmt: skip
    if request_timeout is not None:
        cmd += ["--request-timeout", str(request_timeout)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        with Client(address, timeout=5, retries=0) as c:

            def serving() -> bool:
                assert proc.poll() is None, f"kvmesh worker exited with {proc.returncode}"
                try:
                    return c.health() == "SERVING"
                except KvmeshError:
                    return False

            assert wait_until(serving, timeout=300), "the worker did not start in 300 s"
            info = c.model_info()
        yield proc, address, info
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a frozen process cannot die of SIGTERM
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def worker(smol_src, secret_file):
    """The worker of every test but the worker-deadline one, with the default deadline."""
    with worker_process(secret_file) as w:
        yield w


def start_router(worker, secret_file, **kw) -> tuple[RouterServer, RouterCore]:
    _, address, info = worker
    core = RouterCore(report_timeout_s=3600.0)  # no Ray shell: it must not expire
    srv = RouterServer(core, identity=ClusterIdentity.from_file(secret_file), **kw)
    srv.start_in_thread()
    register(srv, address, info)
    return srv, core


def register(srv: RouterServer, address: str, info) -> None:
    register_worker(
        srv,
        worker_id=info.worker_id,
        address=address,
        model_fp=info.fingerprint,
        block_size=info.block_size,
        name="liveness-worker",
    )


@pytest.fixture(scope="module")
def router(worker, secret_file):
    """Keepalive pings every second: a frozen worker fails its calls within seconds."""
    srv, core = start_router(worker, secret_file, keepalive_s=1.0, keepalive_timeout_s=1.0)
    yield srv, core
    srv.stop_in_thread(grace=0)


class Stream:
    """One streaming generate on a thread of its own: ``first`` is set at its first chunk,
    ``error`` holds how it ended (None: finished normally)."""

    def __init__(self, client: Client, **kw) -> None:
        self.first = threading.Event()
        self.error: BaseException | None = None
        self.chunks = 0
        self.finish_reason = None
        self.thread = threading.Thread(target=self._run, args=(client, kw), daemon=True)
        self.thread.start()

    def _run(self, client: Client, kw) -> None:
        try:
            for chunk in client.generate(PROMPT, **kw):
                self.chunks += 1
                self.finish_reason = chunk.finish_reason
                self.first.set()
        except BaseException as e:  # handed to the test
            self.error = e
        finally:
            self.first.set()

    def ended(self, timeout: float = BOUND_S) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def test_a_generate_without_a_deadline_ends_at_the_workers_default(smol_src, secret_file):
    with (
        worker_process(secret_file, request_timeout=WORKER_DEADLINE_S) as (_, address, _),
        Client(address, retries=0) as c,  # no timeout of its own
    ):
        s = Stream(c, **LONG)
        assert s.ended(WORKER_DEADLINE_S + BOUND_S)
    assert isinstance(s.error, DeadlineExceeded), s.error
    assert s.chunks > 0  # it did run until then


def test_a_generate_without_a_deadline_ends_at_the_routers_default(worker, secret_file):
    srv, _ = start_router(worker, secret_file, default_deadline_s=2.0)
    try:
        with Client(srv.address, retries=0) as c:
            s = Stream(c, **LONG)
            assert s.ended()
        assert isinstance(s.error, DeadlineExceeded), s.error
    finally:
        srv.stop_in_thread(grace=0)


def test_a_worker_dropped_as_dead_has_its_streams_cut_at_once(worker, router):
    srv, core = router
    _, address, info = worker
    with Client(srv.address, retries=0) as c:
        s = Stream(c, **LONG)
        assert s.first.wait(BOUND_S) and s.error is None
        srv.call(core.remove_worker, info.worker_id, "test: declared dead", dead=True)
        assert s.ended()
    assert isinstance(s.error, Unavailable) and "dead" in s.error.details, s.error
    # the control: a worker that leaves by itself (draining) finishes what it runs
    register(srv, address, info)
    with Client(srv.address, retries=0) as c:
        s = Stream(c, temperature=0.0, max_tokens=24, ignore_eos=True)
        assert s.first.wait(BOUND_S) and s.error is None
        srv.call(core.remove_worker, info.worker_id, "test: leaving")
        assert s.ended()
    assert s.error is None and s.finish_reason == "length"
    register(srv, address, info)


def test_a_frozen_worker_host_ends_its_streams_with_unavailable(worker, router):
    proc, address, _ = worker
    srv, _ = router
    with (
        Client(srv.address, retries=0) as via_router,
        Client(address, retries=0, keepalive_s=1.0, keepalive_timeout_s=1.0) as direct,
    ):
        streams = [Stream(via_router, **LONG), Stream(direct, **LONG)]
        for s in streams:
            assert s.first.wait(BOUND_S) and s.error is None
        os.kill(proc.pid, signal.SIGSTOP)  # the host stops answering; its sockets stay open
        try:
            for s in streams:
                assert s.ended(), "a stream to a frozen worker hangs"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    for s in streams:
        assert isinstance(s.error, Unavailable), s.error
