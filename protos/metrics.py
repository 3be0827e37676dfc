"""Prometheus ``/metrics`` over HTTP for any kvmesh process (worker, router), one registry
each. Here, in the leaf package, because the worker and the router both serve one and never
import each other.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger("kvmesh.metrics")


class MetricsServer:
    """A registry on ``host:port`` (``/metrics``; 0 picks a free port) from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in [0, 65535], got {port}")
        self._server, self._thread = start_http_server(port, host, registry)
        self.host = host
        self.port = self._server.server_port

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::", "[::]") else self.host
        return f"{host}:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0):
    """Serve ``registry`` on ``http://host:port/metrics``; returns the ``MetricsServer``."""
    srv = MetricsServer(registry, host, port)
    logger.info("metrics on http://%s/metrics", srv.address)
    return srv


__all__ = ["MetricsServer", "serve_metrics"]
