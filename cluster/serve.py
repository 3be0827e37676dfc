"""``kvmesh serve``: N worker actors behind the prefix-aware router, on a Ray cluster.

    kvmesh serve --workers 2 --policy prefix_affinity --port 50051     # a local Ray cluster
    kvmesh serve --address ray://head:10001 --workers 8                # an existing one

``Cluster`` is the same thing from Python (the demo, the tests and the benchmark use it):

    ray.init(...)
    cluster = Cluster.start(ClusterConfig(workers=2, engine_args={"kv_cache_memory": "1GiB"}))
    with Client(cluster.endpoint) as c: ...
    cluster.shutdown()

Ray is imported only when a cluster starts, so ``kvmesh --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from kvmesh.protos.security import BearerTokens, ClusterIdentity, TLSConfig
from kvmesh.protos.serving import DEFAULT_DEADLINE_S

logger = logging.getLogger("kvmesh.cluster")

DEFAULT_PORT = 50051


@dataclass
class ClusterConfig:
    """What ``Cluster.start`` builds. ``engine_args`` go to every worker's ``LLMEngine``."""

    workers: int = 2
    model: str | None = None  # None: the default model
    engine_args: dict = field(default_factory=dict)
    policy: str = "prefix_affinity"
    host: str = "0.0.0.0"  # the router's client-facing bind address
    port: int = DEFAULT_PORT  # 0 picks a free port (it changes if the router restarts)
    worker_cpus: float = 1.0
    worker_gpus: float | None = None  # None: 1 per worker when the Ray cluster has GPUs
    max_restarts: int = 3  # per actor; -1 restarts without limit
    grace_s: float = 10.0
    name: str = "kvmesh"  # prefix of the actor names
    report_interval_s: float = 0.25
    log_level: str = "INFO"  # of the actors' kvmesh loggers
    seed: int | None = None  # of the policy's tie-breaks
    # Prometheus: the router's /metrics port (None: no metrics anywhere; 0: any free port);
    # with it every worker serves its own /metrics on a free port, and the router lists them
    # all in ``prometheus_sd_file`` (file-based service discovery), when given
    metrics_port: int | None = None
    prometheus_sd_file: str | None = None
    http_port: int | None = None  # the router's OpenAI-compatible HTTP API (0: a free port)
    # Access (docs/security.md): the cluster secret every actor proves to the others (None:
    # Cluster.start draws a random one and hands it to the actors), TLS material of the
    # router's client port and the workers' ports, client tokens, the default deadline
    identity: ClusterIdentity | None = None
    tls: TLSConfig | None = None
    tokens: BearerTokens | None = None
    default_deadline_s: float | None = DEFAULT_DEADLINE_S

    def __post_init__(self) -> None:
        from kvmesh.router.policies import POLICIES

        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown routing policy {self.policy!r}; accepted: {', '.join(sorted(POLICIES))}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.worker_cpus <= 0:
            raise ValueError(f"worker_cpus must be > 0, got {self.worker_cpus}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.default_deadline_s is not None and not self.default_deadline_s > 0:
            raise ValueError(
                f"default_deadline_s must be > 0 or None, got {self.default_deadline_s}"
            )
        if self.prometheus_sd_file and self.metrics_port is None:
            raise ValueError("prometheus_sd_file needs metrics_port (the router's /metrics port)")


class Cluster:
    """A running router actor and its worker actors (on the Ray cluster ``ray.init`` joined)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        router,
        workers: list,
        endpoint: str,
        identity: ClusterIdentity | None = None,
    ) -> None:
        self.cfg = cfg
        # the cluster's secret: an SDK client acting as a member passes it (GetLoad)
        self.identity = identity
        self.router = router
        self.workers = workers  # actor handles, in slot order
        self.endpoint = endpoint

    @classmethod
    def start(cls, cfg: ClusterConfig, *, timeout_s: float = 600.0) -> Cluster:
        """Start the router, then the workers; return once every worker has registered.
        A worker that fails to start (a bad model or engine argument) raises its error."""
        import ray

        from kvmesh.cluster.actors import RouterActor, WorkerActor
        from kvmesh.worker.models.loader import DEFAULT_MODEL

        if not ray.is_initialized():
            raise RuntimeError("call ray.init() first (kvmesh serve does it for you)")
        model = cfg.model or DEFAULT_MODEL
        # every actor gets the secret through Ray (its actor arguments): a local cluster is
        # authenticated with no set-up, and nothing outside it can act as a member
        identity = cfg.identity or ClusterIdentity.generate()
        security = dict(
            identity=identity,
            tls=cfg.tls,
            tokens=cfg.tokens,
            default_deadline_s=cfg.default_deadline_s,
        )
        gpus = cfg.worker_gpus
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        router = (
            ray.remote(RouterActor)
            .options(
                name=f"{cfg.name}-router",
                num_cpus=0,  # it waits on sockets; the CPUs belong to the engines
                scheduling_strategy=_driver_node(),
                max_restarts=cfg.max_restarts,
                max_concurrency=32,  # register/publish from every worker, pings, stats
            )
            .remote(
                model,
                host=cfg.host,
                port=cfg.port,
                policy=cfg.policy,
                grace_s=cfg.grace_s,
                seed=cfg.seed,
                log_level=cfg.log_level,
                metrics_port=cfg.metrics_port,
                prometheus_sd_file=cfg.prometheus_sd_file,
                http_port=cfg.http_port,
                **security,
            )
        )
        deadline = time.monotonic() + timeout_s
        workers: list = []
        try:
            endpoint = ray.get(router.endpoint.remote(), timeout=timeout_s)
            worker_cls = ray.remote(WorkerActor)
            workers += [
                worker_cls.options(
                    name=f"{cfg.name}-worker-{i}",
                    num_cpus=cfg.worker_cpus,
                    num_gpus=gpus,
                    max_restarts=cfg.max_restarts,
                    max_concurrency=4,  # ping and stats must not wait behind a shutdown
                ).remote(
                    f"{cfg.name}-worker-{i}",
                    f"{cfg.name}-router",
                    {"model": model, **cfg.engine_args},
                    num_threads=max(1, int(cfg.worker_cpus)),
                    grace_s=cfg.grace_s,
                    report_interval_s=cfg.report_interval_s,
                    log_level=cfg.log_level,
                    metrics=cfg.metrics_port is not None,
                    **security,
                )
                for i in range(cfg.workers)
            ]
            cluster = cls(cfg, router, workers, endpoint, identity)
            left = max(1.0, deadline - time.monotonic())
            ray.get([w.ready.remote() for w in workers], timeout=left)
            cluster.wait_for_workers(cfg.workers, timeout_s=max(1.0, deadline - time.monotonic()))
        except BaseException:
            for h in [router, *workers]:
                ray.kill(h, no_restart=True)
            raise
        return cluster

    # ------------------------------------------------------------ operations

    @property
    def http_endpoint(self) -> str | None:
        """host:port of the router's OpenAI-compatible HTTP API (None: not served)."""
        import ray

        return ray.get(self.router.http_endpoint.remote(), timeout=30)

    def stats(self) -> dict:
        """The router's view: workers (address, load, index pages), decisions, index stats."""
        import ray

        return ray.get(self.router.stats.remote(), timeout=30)

    def wait_for_workers(self, n: int, timeout_s: float = 60.0) -> dict:
        """Wait until the router has ``n`` live workers; returns its stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if len(st["workers"]) >= n:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(st['workers'])} of {n} workers registered within {timeout_s:.0f}s"
                )
            time.sleep(0.1)

    def metrics_address(self) -> str | None:
        """host:port of the router's Prometheus /metrics (None: not served)."""
        import ray

        return ray.get(self.router.metrics_address.remote(), timeout=30)

    def set_policy(self, name: str) -> str:
        import ray

        return ray.get(self.router.set_policy.remote(name), timeout=30)

    def reset_prefix_caches(self, timeout_s: float = 30.0) -> None:
        """Empty every worker's device prefix cache and wait until the router's index agrees
        (the removals arrive as events; optimistic entries expire in ~2 s)."""
        import ray

        ray.get([w.reset_prefix_cache.remote() for w in self.workers], timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if all(w["index_pages"]["device"] == 0 for w in st["workers"].values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the router's index still shows cached pages")
            time.sleep(0.1)

    def shutdown(self, grace: float | None = None) -> None:
        """Drain the router (in-flight streams get ``grace`` seconds), stop the workers, and
        kill every actor. Safe to call twice."""
        import ray

        grace = self.cfg.grace_s if grace is None else grace
        if not ray.is_initialized():
            return
        try:
            ray.get(self.router.drain.remote(grace), timeout=grace + 30)
        except Exception as e:
            logger.warning("router drain failed: %r", e)
        refs = [w.shutdown.remote(min(grace, 2.0)) for w in self.workers]
        try:
            ray.get(refs, timeout=grace + 30)
        except Exception as e:
            logger.warning("worker shutdown failed: %r", e)
        for h in [self.router, *self.workers]:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already gone
                pass


def _driver_node():
    """Place the router on the node ``kvmesh serve`` runs on (the head pod on KubeRay), so
    the endpoint is where the operator expects it. Hard affinity: Ray's soft affinity sent
    the router to a worker node now and then when the driver's node offers no CPUs (a
    KubeRay head, tests/integration/test_netns_cluster.py); and the actors die with the
    driver anyway, so there is no other node for a restart to go to."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # a client without a node of its own: let Ray choose
        return None
    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


# ---------------------------------------------------------------- the CLI


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``kvmesh serve`` on the CLI's subparsers."""
    from kvmesh.cluster import cli

    s = subparsers.add_parser(
        "serve", help="run a Ray cluster of workers behind the prefix-aware router"
    )
    s.add_argument("--workers", type=int, default=2, help="worker actors (one per GPU)")
    s.add_argument(
        "--policy", default="prefix_affinity", help="prefix_affinity, least_loaded or round_robin"
    )
    s.add_argument(
        "--address",
        default=None,
        help="join this Ray cluster (e.g. auto, ray://head:10001); default: start a local one",
    )
    s.add_argument("--host", default="0.0.0.0", help="the router's bind address")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="the router's port")
    s.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port too (0: any free port)",
    )
    s.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs per worker actor")
    s.add_argument(
        "--worker-gpus",
        type=float,
        default=None,
        help="GPUs per worker actor (default: 1 if the cluster has GPUs)",
    )
    s.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="CPUs of a local Ray cluster (default: what the workers need)",
    )
    s.add_argument("--max-restarts", type=int, default=3, help="Ray restarts per actor")
    s.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds in-flight streams may finish after SIGTERM/SIGINT",
    )
    s.add_argument("--name", default="kvmesh", help="prefix of the Ray actor names")
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="the router's Prometheus /metrics port (0: any free port); every worker then "
        "serves its own on a free port (default: no metrics)",
    )
    s.add_argument(
        "--prometheus-sd-file",
        default=None,
        metavar="PATH",
        help="with --metrics-port: the router keeps this Prometheus file_sd JSON listing its "
        "own and every live worker's /metrics",
    )
    cli._add_security_args(s, serve=True)
    cli._add_engine_args(s)  # the same engine flags as `kvmesh generate` and `kvmesh worker`
    s.set_defaults(func=cmd_serve)
    return s


def config_from_args(a: argparse.Namespace) -> ClusterConfig:
    from kvmesh.cluster import cli

    # tiers hold sockets and threads: each worker builds its own from the addresses
    engine_args = cli._engine_kwargs(a, peer_tiers=False)
    engine_args.pop("extra_tiers", None)
    if a.peer:
        engine_args["peers"] = list(a.peer)
    return ClusterConfig(
        workers=a.workers,
        model=a.model,
        engine_args=engine_args,
        policy=a.policy,
        host=a.host,
        port=a.port,
        http_port=a.http_port,
        worker_cpus=a.worker_cpus,
        worker_gpus=a.worker_gpus,
        max_restarts=a.max_restarts,
        grace_s=a.grace_period,
        name=a.name,
        metrics_port=a.metrics_port,
        prometheus_sd_file=a.prometheus_sd_file,
        **cli._security_kwargs(a, serve=True),
        log_level=logging.getLevelName(logging.getLogger("kvmesh").getEffectiveLevel()),
    )


def init_ray(address: str | None, *, num_cpus: int | None = None, **kwargs) -> None:
    """Join ``address``, or start a local Ray cluster sized for the workers."""
    import ray

    if address:
        ray.init(address=address, namespace="kvmesh", **kwargs)
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            namespace="kvmesh",
            **kwargs,
        )


def cmd_serve(a: argparse.Namespace) -> int:
    import ray

    cfg = config_from_args(a)  # bad flags fail before Ray starts
    need = math.ceil(cfg.workers * cfg.worker_cpus)
    init_ray(a.address, num_cpus=a.num_cpus or max(need, os.cpu_count() or 1))
    stop = threading.Event()
    signals = []

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        if len(signals) > 1:
            raise KeyboardInterrupt  # a second signal: stop without waiting
        stop.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = None
    try:
        print(f"starting {cfg.workers} workers and the router ...", file=sys.stderr, flush=True)
        cluster = Cluster.start(cfg)
        st = cluster.stats()
        print(f"kvmesh serving on {cluster.endpoint}  (policy {st['policy']})", flush=True)
        if cfg.http_port is not None:
            scheme = "https" if cfg.tls is not None and cfg.tls.serves else "http"
            print(f"  OpenAI-compatible API: {scheme}://{cluster.http_endpoint}/v1", flush=True)
        if cfg.metrics_port is not None:
            print(f"  metrics on http://{cluster.metrics_address()}/metrics", flush=True)
        for wid, w in st["workers"].items():
            print(f"  worker {wid} ({w['name']}) at {w['address']}", flush=True)
        print("Ctrl-C or SIGTERM to stop", file=sys.stderr, flush=True)
        stop.wait()
        print(
            f"stopping: draining for up to {cfg.grace_s:.0f}s (again to stop now)",
            file=sys.stderr,
            flush=True,
        )
        cluster.shutdown()
    except KeyboardInterrupt:
        if cluster is not None:
            cluster.shutdown(grace=0)
        return 130
    except ray.exceptions.RayActorError as e:
        print(f"error: an actor failed to start: {e}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        ray.shutdown()
    return 0
