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

from kvmesh.cluster.autoscale import AutoscaleConfig
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
    # autoscaling (cluster/autoscale.py, docs/autoscaling.md): with min < max the cluster
    # starts ``min_workers`` and an Autoscaler adds and retires workers; ``workers`` is then
    # set to ``min_workers``
    autoscale: AutoscaleConfig | None = None
    # on shutdown each worker writes its cache down to Redis (when configured) for at most
    # this long (worker/flush.py); 0: no flush
    flush_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        from kvmesh.router.policies import POLICIES

        if self.autoscale is not None:
            self.workers = self.autoscale.min_workers
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
        if not self.flush_timeout_s >= 0:
            raise ValueError(f"flush_timeout_s must be >= 0, got {self.flush_timeout_s}")
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
        self.worker_names = [f"{cfg.name}-worker-{i}" for i in range(len(workers))]
        self._next_slot = len(workers)
        self._spawn = None  # (name) -> actor handle, set by start
        self._pending: dict[str, tuple[object, float]] = {}  # name -> (handle, started)
        self._lock = threading.Lock()
        self.autoscaler = None

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

            def spawn(name: str):
                # one GPU per worker where the cluster has GPUs: a worker Ray cannot place
                # stays pending, and Ray's autoscaler adds a node for it
                return worker_cls.options(
                    name=name,
                    num_cpus=cfg.worker_cpus,
                    num_gpus=gpus,
                    max_restarts=cfg.max_restarts,
                    max_concurrency=4,  # ping and stats must not wait behind a shutdown
                ).remote(
                    name,
                    f"{cfg.name}-router",
                    {"model": model, **cfg.engine_args},
                    num_threads=max(1, int(cfg.worker_cpus)),
                    grace_s=cfg.grace_s,
                    report_interval_s=cfg.report_interval_s,
                    log_level=cfg.log_level,
                    metrics=cfg.metrics_port is not None,
                    **security,
                )

            workers += [spawn(f"{cfg.name}-worker-{i}") for i in range(cfg.workers)]
            cluster = cls(cfg, router, workers, endpoint, identity)
            cluster._spawn = spawn
            left = max(1.0, deadline - time.monotonic())
            ray.get([w.ready.remote() for w in workers], timeout=left)
            cluster.wait_for_workers(cfg.workers, timeout_s=max(1.0, deadline - time.monotonic()))
            if cfg.autoscale is not None:
                ray.get(router.set_autoscale_config.remote(cfg.autoscale.as_dict()), timeout=30)
                if cfg.autoscale.enabled:
                    from kvmesh.cluster.autoscale import Autoscaler

                    cluster.autoscaler = Autoscaler(cluster, cfg.autoscale)
                    cluster.autoscaler.start()
        except BaseException:
            for h in [router, *workers]:
                ray.kill(h, no_restart=True)
            raise
        return cluster

    # ------------------------------------------------------------ scaling (autoscale.py)

    def add_worker(self) -> str:
        """Start one more worker actor; returns its name at once (it registers with the
        router when its engine is up, or stays pending until Ray has room for it)."""
        with self._lock:
            name = f"{self.cfg.name}-worker-{self._next_slot}"
            self._next_slot += 1
            self._pending[name] = (self._spawn(name), time.monotonic())
        return name

    def pending_workers(self, live_names: set[str]) -> list[str]:
        """Names of the workers started but not registered yet; those now registered join
        ``workers``; one not registered within ``autoscale.start_timeout_s`` is given up."""
        import ray

        limit = self.cfg.autoscale.start_timeout_s if self.cfg.autoscale else 900.0
        with self._lock:
            for name in list(self._pending):
                handle, started = self._pending[name]
                if name in live_names:
                    del self._pending[name]
                    self.workers.append(handle)
                    self.worker_names.append(name)
                elif time.monotonic() - started > limit:
                    logger.warning("worker %s did not start within %.0fs; giving up", name, limit)
                    del self._pending[name]
                    ray.kill(handle, no_restart=True)
            return sorted(self._pending)

    def cancel_worker(self, name: str) -> None:
        """Give up a worker still starting."""
        import ray

        with self._lock:
            entry = self._pending.pop(name, None)
        if entry is not None:
            ray.kill(entry[0], no_restart=True)

    def retire_worker(
        self,
        worker_id: str,
        name: str,
        *,
        drain_timeout_s: float = 30.0,
        flush_timeout_s: float = 30.0,
        preserve_cache: bool = True,
    ) -> dict:
        """Retire one worker: the router stops routing to it, its requests finish (at most
        ``drain_timeout_s``), it writes its cache down to Redis (``preserve_cache``, at most
        ``flush_timeout_s``) and leaves the router, then its actor is killed (its node can
        go). Returns its flush report."""
        import ray

        with self._lock:
            i = self.worker_names.index(name)
            handle = self.workers[i]
        ray.get(self.router.begin_retire.remote(worker_id), timeout=30)
        report: dict = {}
        try:
            report = ray.get(
                handle.retire.remote(drain_timeout_s, flush_timeout_s, preserve_cache),
                timeout=drain_timeout_s + flush_timeout_s + 120,
            )
        except Exception as e:  # it died meanwhile: the router drops it as dead anyway
            logger.warning("retiring %s failed: %r", name, e)
            ray.get(self.router.unregister.remote(worker_id, f"retired: {e!r}"), timeout=30)
        with self._lock:
            if name in self.worker_names:
                i = self.worker_names.index(name)
                del self.worker_names[i], self.workers[i]
        ray.kill(handle, no_restart=True)
        return report

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
        if self.autoscaler is not None:
            self.autoscaler.stop()
        with self._lock:
            pending = [h for h, _ in self._pending.values()]
            self._pending.clear()
        for h in pending:
            ray.kill(h, no_restart=True)
        try:
            ray.get(self.router.drain.remote(grace), timeout=grace + 30)
        except Exception as e:
            logger.warning("router drain failed: %r", e)
        flush = self.cfg.flush_timeout_s
        refs = [w.shutdown.remote(min(grace, 2.0), flush) for w in self.workers]
        try:
            ray.get(refs, timeout=grace + flush + 30)
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
    s.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker actors (one per GPU); a fixed size, or the default of --max-workers",
    )
    a = s.add_argument_group("autoscaling (docs/autoscaling.md)")
    a.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="autoscale between this many workers and --max-workers (default: 1 with "
        "--max-workers, else --workers)",
    )
    a.add_argument(
        "--max-workers",
        type=int,
        default=None,
        help="autoscale up to this many workers (default: --workers)",
    )
    a.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        metavar="SECONDS",
        help="scale up while the router's TTFT p99 stays above this",
    )
    a.add_argument("--upscale-delay", type=float, default=30.0, metavar="SECONDS")
    a.add_argument("--downscale-delay", type=float, default=600.0, metavar="SECONDS")
    a.add_argument(
        "--look-back",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="signals are averaged over this window",
    )
    a.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a retired worker's requests in flight get this long to finish",
    )
    a.add_argument(
        "--flush-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a retired or stopping worker writes its cache down to --redis-url for at most "
        "this long (0: no flush)",
    )
    a.add_argument(
        "--no-cache-preserving-scale-down",
        action="store_true",
        help="retire workers without writing their cache down first (the baseline)",
    )
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
        autoscale=autoscale_from_args(a),
        flush_timeout_s=a.flush_timeout,
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


def autoscale_from_args(a: argparse.Namespace) -> AutoscaleConfig:
    """``--workers N`` alone: min = max = N (a fixed size). ``--max-workers M``: min
    defaults to 1; ``--min-workers N``: max defaults to max(N, --workers)."""
    if a.min_workers is None and a.max_workers is None:
        lo = hi = a.workers
    else:
        lo = a.min_workers if a.min_workers is not None else 1
        hi = a.max_workers if a.max_workers is not None else max(lo, a.workers)
    return AutoscaleConfig(
        min_workers=lo,
        max_workers=hi,
        ttft_slo_s=a.ttft_slo,
        upscale_delay_s=a.upscale_delay,
        downscale_delay_s=a.downscale_delay,
        look_back_s=a.look_back,
        drain_timeout_s=a.drain_timeout,
        flush_timeout_s=a.flush_timeout,
        preserve_cache=not a.no_cache_preserving_scale_down,
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
    most = cfg.autoscale.max_workers if cfg.autoscale is not None else cfg.workers
    need = math.ceil(most * cfg.worker_cpus)
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
        if cfg.autoscale is not None and cfg.autoscale.enabled:
            print(
                f"autoscaling between {cfg.autoscale.min_workers} and "
                f"{cfg.autoscale.max_workers} workers",
                file=sys.stderr,
                flush=True,
            )
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
