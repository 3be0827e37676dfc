"""A real ``redis-server`` for integration tests.

Fixtures:

- ``redis_server`` (function scope): a fresh, empty server for one test; the test may stop,
  restart, reconfigure or fill it.
- ``redis_server_module`` (module scope): one server shared by a module's tests, for tests
  that only read and write keys of their own (use a unique model fingerprint per test).

Both yield a :class:`RedisServer`: ``.url``, ``.port``, ``.pid``, ``.client()``, ``.stop()``,
``.start()`` (again on the same port, empty). The server listens on loopback only, with no
persistence (``--save "" --appendonly no``) and its working directory in a temp folder. A
missing ``redis-server`` fails the test; it never skips.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REDIS_MISSING = (
    "redis-server not found: install it with `apt-get install -y redis-server` (or `make setup`)"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on a fixed loopback port."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        """The running server's process id (e.g. to SIGSTOP it), ``None`` when stopped."""
        return self._proc.pid if self._proc is not None else None

    def client(self, **kwargs):
        """A fresh ``redis.Redis`` on this server (bytes responses)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (on the same port as before) and wait until it answers PING."""
        if self._proc is not None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self._dir.name]
        args += ["--daemonize", "no", "--loglevel", "warning"]
        log = Path(self._dir.name) / "redis.log"
        with open(log, "ab") as out:  # a file, not a pipe: a full pipe would stall the server
            self._proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                self._proc = None
                out = log.read_text(errors="replace")
                pytest.fail(f"redis-server on port {self.port} exited at start:\n{out}")
            try:
                with self.client(socket_connect_timeout=0.2) as c:
                    if c.ping():
                        return
            except Exception:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server on port {self.port} did not answer PING in {timeout_s}s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server at once (like a crash: nothing is saved) and wait for it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()


def _start_server() -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(REDIS_MISSING, pytrace=False)
    server = RedisServer(binary)
    server.start()
    return server


@pytest.fixture
def redis_server():
    """A fresh real Redis for this test; stopped afterwards."""
    server = _start_server()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def redis_server_module():
    """One real Redis shared by the tests of a module; stopped after the module."""
    server = _start_server()
    try:
        yield server
    finally:
        server.close()
