"""Prometheus ``/metrics`` over HTTP for any kvmesh process (worker, router), one registry
each. Here, in the leaf package, because the worker and the router both serve one and never
import each other.

Always the text format (0.0.4), whatever the scraper's Accept header asks: prometheus-client
0.26's OpenMetrics writer escapes the ':' of ``kvmesh:`` names into '_', so a Prometheus that
negotiates OpenMetrics (every recent one) would store ``kvmesh_prompt_tokens_total`` and no
dashboard or rule would find it.
"""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_asgi_app, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

logger = logging.getLogger("kvmesh.metrics")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # one line per scrape is noise
        pass


def metrics_wsgi_app(registry: CollectorRegistry):
    """A WSGI app serving ``registry`` in the text format (see the module docstring)."""
    app = make_wsgi_app(registry)

    def text_only(environ, start_response):
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    return text_only


def metrics_asgi_app(registry: CollectorRegistry):
    """An ASGI app serving ``registry`` in the text format, to mount at ``/metrics`` beside an
    HTTP API (FastAPI's ``app.mount``)."""
    app = make_asgi_app(registry)

    async def text_only(scope, receive, send):
        if scope.get("type") == "http":
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"accept"]
            scope = dict(scope, headers=headers)
        await app(scope, receive, send)

    return text_only


def add_metrics_route(app, registry: CollectorRegistry) -> None:
    """``GET /metrics`` on a Starlette / FastAPI ``app`` (the HTTP API's port), text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.responses import Response

    async def metrics(request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


class MetricsServer:
    """A registry on ``host:port`` (``/metrics``; 0 picks a free port) from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in [0, 65535], got {port}")
        try:
            self._server = make_server(
                host,
                port,
                metrics_wsgi_app(registry),
                ThreadingWSGIServer,
                handler_class=_QuietHandler,
            )
        except OSError as e:  # name the port: a process serves several
            raise OSError(e.errno, f"cannot bind metrics {host}:{port}: {e.strerror}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvmesh-metrics", daemon=True
        )
        self._thread.start()
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


__all__ = [
    "MetricsServer",
    "add_metrics_route",
    "metrics_asgi_app",
    "metrics_wsgi_app",
    "serve_metrics",
]
