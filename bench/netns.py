"""A multi-node kvmesh cluster on one Linux machine: network namespaces joined by a bridge.

    with NetnsCluster(workers=2, engine_args={...}) as nc:     # needs root (ip netns)
        with Client(nc.endpoint) as c: ...                     # from the host side
        nc.call("stats"); nc.cut(1); nc.restore(1)

Layout: a bridge on the host with an address of its own (so the host reaches every node),
a namespace per node with one veth on the bridge and an address in a /24 of 10.213.0.0/16
picked at random among the unused ones:

    head  (.10): Ray's head (no CPUs, no GPUs), redis-server, the driver running
                 ``Cluster.start`` (router actor on this node, gRPC on ROUTER_PORT)
    node i (.10+i): a Ray worker node (``ray start --address``, 1 CPU) holding one worker actor

Every process lives in one of the namespaces, so each node has its own port space and
nothing listens on the host's interfaces; Ray's files go to a temp dir of this run
(``RAY_TMPDIR``, ``--temp-dir``). ``close()`` kills every process in the namespaces (by PID:
``ip netns pids``), deletes the namespaces and the bridge and removes the temp dir, also
after a failed start. ``ray stop`` is never run (it would kill every Ray on the machine).

The driver is this file run as a script inside the head namespace; it answers JSON commands
on stdin (``stats``, ``policy NAME``, ``reset``, ``shutdown``), one JSON line each on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROUTER_PORT = 50051
ROUTER_METRICS_PORT = 9400
WORKER_METRICS_PORT = 9401  # KVMESH_WORKER_METRICS_PORT on each worker node
REDIS_PORT = 6380  # Ray's GCS has 6379 in the head namespace
RAY_PORT = 6379
_MARK = "@@kvmesh-netns "


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _free_subnet() -> int:
    """A third octet N with 10.213.N.0/24 on no interface or route of this host."""
    used = _ip("-4", "route").stdout + _ip("-4", "addr").stdout
    choices = [n for n in range(100, 250) if f"10.213.{n}." not in used]
    if not choices:
        raise RuntimeError("no free 10.213.N.0/24 subnet on this host")
    return random.choice(choices)


class NetnsCluster:
    """See the module docstring. ``engine_args`` go to every worker's engine; ``redis``
    gives every worker the head node's Redis as its shared tier."""

    def __init__(
        self,
        workers: int = 2,
        *,
        engine_args: dict | None = None,
        policy: str = "prefix_affinity",
        redis: bool = True,
        model: str = "smollm2-135m-instruct",
        startup_timeout_s: float = 240.0,
        log_level: str = "WARNING",
        seed: int | None = 0,
        ray_env: dict | None = None,
    ) -> None:
        self.workers = workers
        self.engine_args = dict(engine_args or {})
        self.policy = policy
        self.redis = redis
        self.model = model
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level
        self.seed = seed
        tag = f"{random.getrandbits(16):04x}"
        self.tag = tag
        self.bridge = f"kvm{tag}br"
        self.nodes = ["head", *(f"n{i}" for i in range(1, workers + 1))]
        self.netns = {n: f"kvmesh-{tag}-{n}" for n in self.nodes}
        self.veth = {n: f"kvm{tag}h{i}" for i, n in enumerate(self.nodes)}
        self.subnet = _free_subnet()
        self.host_ip = f"10.213.{self.subnet}.1"
        self.ips = {n: f"10.213.{self.subnet}.{10 + i}" for i, n in enumerate(self.nodes)}
        self.tmp = Path(tempfile.mkdtemp(prefix=f"kvmesh-netns-{tag}-"))
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.ray_env = {
            # this cluster's own Ray token (Ray would otherwise share ~/.ray/auth_token with
            # every local Ray on the machine)
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            # a worker node cut off for a few seconds must stay a member: the test restores
            # it and expects its worker back (Ray's defaults declare it dead after ~15 s)
            "RAY_health_check_failure_threshold": "40",
            **(ray_env or {}),
        }
        self._procs: list[subprocess.Popen] = []
        self._driver: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._created_bridge = False
        self._created_ns: list[str] = []
        self.endpoint = f"{self.ips['head']}:{ROUTER_PORT}"
        self.redis_password = secrets.token_hex(16)
        self.redis_url = f"redis://:{self.redis_password}@{self.ips['head']}:{REDIS_PORT}/0"
        self.info: dict = {}

    # ------------------------------------------------------------ life

    def __enter__(self) -> NetnsCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self._network()
        bin_dir = Path(sys.executable).parent
        ray = str(bin_dir / "ray")
        common = [
            "--num-gpus=0",
            "--object-store-memory=80000000",
            "--disable-usage-stats",
        ]
        head = self.ips["head"]
        if self.redis:
            self._spawn(
                "head",
                "redis",
                [
                    shutil.which("redis-server") or "redis-server",
                    "--bind", head, "--port", str(REDIS_PORT), "--save", "",
                    "--appendonly", "no", "--maxmemory", "256mb",
                    "--maxmemory-policy", "allkeys-lru", "--requirepass", self.redis_password,
                ],
            )  # fmt: skip
            self.engine_args.setdefault("redis_url", self.redis_url)
        self._spawn(
            "head",
            "ray-head",
            [
                ray, "start", "--head", f"--node-ip-address={head}", f"--port={RAY_PORT}",
                "--num-cpus=0", f"--temp-dir={self.tmp / 'ray'}", "--include-dashboard=false",
                "--block", *common,
            ],
        )  # fmt: skip
        self._wait_started("head", "ray-head", self._procs[-1], 120)
        # one node at a time, each retried once: Ray gives a raylet 30 s to register, which a
        # loaded 2-core machine starting several at once does not always meet
        for n in self.nodes[1:]:
            for attempt in range(2):
                p = self._spawn(
                    n,
                    "ray-worker",
                    [
                        ray, "start", f"--address={head}:{RAY_PORT}",
                        f"--node-ip-address={self.ips[n]}", "--num-cpus=1", "--block", *common,
                    ],
                    env={"KVMESH_WORKER_METRICS_PORT": str(WORKER_METRICS_PORT)},
                )  # fmt: skip
                try:
                    self._wait_started(n, "ray-worker", p, 120)
                    break
                except RuntimeError:
                    if attempt:
                        raise
                    self._kill_ns(self.netns[n])
        cfg = {
            "address": f"{head}:{RAY_PORT}",
            "node_ip": head,
            "workers": self.workers,
            "model": self.model,
            "engine_args": self.engine_args,
            "policy": self.policy,
            "port": ROUTER_PORT,
            "metrics_port": ROUTER_METRICS_PORT,
            "log_level": self.log_level,
            "seed": self.seed,
            "nodes": len(self.nodes),
            "timeout_s": self.startup_timeout_s,
        }
        self._driver = self._spawn(
            "head",
            "driver",
            [sys.executable, str(Path(__file__).resolve()), json.dumps(cfg)],
            pipes=True,
        )
        self.info = self._read_reply(self.startup_timeout_s + 30)
        if "error" in self.info:
            tails = self.log_tails()
            raise RuntimeError(f"the cluster did not start: {self.info['error']}\n{tails}")

    def close(self) -> None:
        """Stop everything this cluster started; never raises."""
        # no graceful drain: every process in the namespaces is ours, and all go at once
        for ns in self._created_ns:
            self._kill_ns(ns)
        for p in self._procs:
            with contextlib.suppress(Exception):
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
        # deleting a host end deletes its pair at once (those of a deleted namespace go only
        # when the kernel gets round to it)
        for n in self.nodes:
            _ip("link", "del", self.veth[n], check=False)
        for ns in self._created_ns:
            _ip("netns", "del", ns, check=False)
        self._created_ns = []
        if self._created_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._created_bridge = False
        if os.environ.get("KVMESH_NETNS_KEEP"):  # debugging: keep Ray's files and the logs
            print(f"netns cluster files kept in {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------ operations

    def call(self, op: str, *args, timeout: float = 60.0):
        """One command to the driver; its JSON reply."""
        assert self._driver is not None and self._driver.stdin is not None
        with self._lock:
            self._driver.stdin.write(json.dumps([op, *args]) + "\n")
            self._driver.stdin.flush()
            reply = self._read_reply(timeout)
        if "error" in reply:
            raise RuntimeError(f"driver {op}: {reply['error']}")
        return reply["result"]

    def log_tails(self, chars: int = 1500) -> str:
        """The end of every process's log, for a failure message."""
        parts = []
        for f in sorted(self.logs.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def node_of(self, address: str) -> str:
        host = address.rsplit(":", 1)[0]
        return next(n for n, ip in self.ips.items() if ip == host)

    def cut(self, node: str) -> None:
        """Partition a node: its link to the bridge goes down."""
        _ip("link", "set", self.veth[node], "down")

    def restore(self, node: str) -> None:
        _ip("link", "set", self.veth[node], "up")

    def metrics(self, address: str, timeout: float = 10.0) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
            return r.read().decode()

    # ------------------------------------------------------------ internals

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created_bridge = True
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, n in enumerate(self.nodes):
            ns, host_end, ns_end = self.netns[n], self.veth[n], f"kvm{self.tag}n{i}"
            _ip("netns", "add", ns)
            self._created_ns.append(ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.ips[n]}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")

    def _spawn(
        self, node: str, name: str, argv: list[str], env: dict | None = None, pipes: bool = False
    ) -> subprocess.Popen:
        full_env = {
            **os.environ,
            **self.ray_env,
            "RAY_TMPDIR": str(self.tmp / "ray"),
            **(env or {}),
        }
        for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
            full_env.pop(k, None)
        log = open(self.logs / f"{node}-{name}.log", "w")  # noqa: SIM115 (lives with the process)
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.netns[node], *argv],
            env=full_env,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else log,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        self._procs.append(p)
        return p

    def _read_reply(self, timeout: float) -> dict:
        """The driver's next protocol line (others are its own output), within ``timeout``."""
        assert self._driver is not None and self._driver.stdout is not None
        out: list[dict] = []

        def read() -> None:
            for line in self._driver.stdout:
                if line.startswith(_MARK):
                    out.append(json.loads(line[len(_MARK) :]))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not out:
            if self._driver.poll() is not None:
                tail = (self.logs / "head-driver.log").read_text()[-3000:]
                raise RuntimeError(f"the driver exited ({self._driver.returncode}):\n{tail}")
            raise TimeoutError(f"the driver did not answer within {timeout:.0f}s")
        return out[0]

    def _wait_started(self, node: str, name: str, proc: subprocess.Popen, timeout: float) -> None:
        """Until ``ray start`` logs that its node runs; RuntimeError if it exits first."""
        log = self.logs / f"{node}-{name}.log"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if "Ray runtime started" in log.read_text(errors="replace"):
                return
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"ray start on {node} exited ({proc.returncode}):\n{tail}")
            time.sleep(0.2)
        raise TimeoutError(f"ray start on {node} did not finish within {timeout:.0f}s")

    def _kill_ns(self, ns: str) -> None:
        """SIGKILL every process in namespace ``ns`` (all of them ours; nothing of theirs
        outlives the run: Ray's files go with the temp dir) and wait until none is left."""
        end = time.monotonic() + 15
        while (pids := self._ns_pids(ns)) and time.monotonic() < end:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    @staticmethod
    def _ns_pids(ns: str) -> list[int]:
        out = _ip("netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]


# ---------------------------------------------------------------- the driver (head namespace)


def _driver(cfg: dict) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import ray

    from kvmesh.cluster.serve import Cluster, ClusterConfig

    def reply(obj) -> None:
        sys.stdout.write(_MARK + json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()

    try:
        # the namespace has no default route, so Ray could not guess this node's address
        ray.init(
            address=cfg["address"],
            namespace="kvmesh",
            log_to_driver=False,
            _node_ip_address=cfg["node_ip"],
        )
        # every worker node must be up before the actors are placed (1 CPU each)
        end = time.monotonic() + cfg["timeout_s"]
        while len([n for n in ray.nodes() if n["Alive"]]) < cfg["nodes"]:
            if time.monotonic() > end:
                raise TimeoutError(f"{len(ray.nodes())} of {cfg['nodes']} Ray nodes joined")
            time.sleep(0.2)
        config = ClusterConfig(
            workers=cfg["workers"],
            model=cfg["model"],
            engine_args=cfg["engine_args"],
            policy=cfg["policy"],
            port=cfg["port"],
            metrics_port=cfg["metrics_port"],
            log_level=cfg["log_level"],
            seed=cfg["seed"],
            grace_s=2.0,
        )
        try:
            cluster = Cluster.start(config, timeout_s=cfg["timeout_s"])
        except ray.exceptions.ActorUnavailableError as e:
            # an actor restarted while starting (seen once on a machine short of memory):
            # Cluster.start killed them all; one more try, said out loud
            # (actors of another name: none of the first try's can reach the second's router)
            print(f"netns driver: start failed ({e!r}); trying once more", file=sys.stderr)
            config.name = "kvmesh-retry"
            cluster = Cluster.start(config, timeout_s=cfg["timeout_s"])
    except Exception as e:
        reply({"error": repr(e)})
        return 1
    reply({"endpoint": cluster.endpoint, "stats": cluster.stats()})
    for line in sys.stdin:
        op, *args = json.loads(line)
        try:
            if op == "stats":
                result = cluster.stats()
            elif op == "policy":
                result = cluster.set_policy(args[0])
            elif op == "reset":
                cluster.reset_prefix_caches()
                result = None
            elif op == "shutdown":
                cluster.shutdown(grace=0)
                reply({"result": None})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
            reply({"result": result})
        except Exception as e:
            reply({"error": repr(e)})
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_driver(json.loads(sys.argv[1])))
