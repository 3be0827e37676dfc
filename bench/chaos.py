"""Chaos: a 2-worker kvmesh cluster with Redis under steady greedy load while faults hit it.

The cluster is what ``kvmesh serve --workers 2 --redis-url ...`` starts (``Cluster.start`` on
a local Ray, the router on loopback), with a real ``redis-server`` on a free loopback port
and KV pools small enough that pages spill through a small host tier into Redis. The
workers bind to the Ray node's address (``addresses`` in the JSON says which): on one
machine that is a local interface, but not necessarily 127.0.0.1. Two phases
run the same prompts (shared prefixes, greedy, a few tokens each) with ``--concurrency``
client streams in flight:

1. ``reference``: every prompt once, no faults: the expected tokens of each prompt.
2. ``chaos``: for ``--duration`` seconds, random prompts of the same set, while at fixed
   fractions of the time it injects: a flood of invalid requests, corrupt objects written
   under live Redis keys, a Redis restart (SIGKILL, then a fresh server on the same port), a
   hostile peer (a KVTransfer server that serves garbage, named in ``peer_addresses`` by a
   client; a forged ``Push``), and a worker killed with SIGKILL.

Every chaos request ends as one of: completed (and then right or wrong against the
reference), failed before its first token, failed after it (with the status), or hung (no
end within ``--request-timeout`` seconds, or still open ``--grace`` seconds after the load
stopped). Targets (issue 15): 0 wrong, 0 hung, 0 failed before the first token (the SDK and
the router retry those), failures after the first token only for streams on the killed
worker.

Prints one JSON object (Ray's raylet may print a line about the killed worker before it;
``--output`` also writes the object to a file).

    .venv/bin/python bench/chaos.py [--duration 90] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

# bench/ is sys.path[0] when this runs as a script: it goes last, so a module there can
# never shadow a standard one for the libraries imported below
sys.path.append(sys.path.pop(0))

from machine import machine_info  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """A redis-server on one loopback port, no persistence: ``restart`` loses everything."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server not found: install it with `apt-get install -y redis-server`")
        self.binary, self.port = binary, _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.TemporaryDirectory(prefix="kvmesh-chaos-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self.dir.name, "--loglevel", "warning"]
        log = open(Path(self.dir.name) / "redis.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        for _ in range(500):
            try:
                if self.client().ping():
                    return
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


def make_prompts(a: argparse.Namespace) -> list[list[int]]:
    """``--prefixes`` shared prefixes of ``--prefix-tokens`` random token ids, each with
    ``--per-prefix`` different tails: prefix caching, spills and Redis all get work."""
    rng = random.Random(a.seed)
    prefixes = [
        [rng.randrange(100, 40000) for _ in range(a.prefix_tokens)] for _ in range(a.prefixes)
    ]
    return [
        p + [rng.randrange(100, 40000) for _ in range(a.tail_tokens)]
        for p in prefixes
        for _ in range(a.per_prefix)
    ]


def one_request(client, prompt: list[int], a: argparse.Namespace) -> dict:
    """Stream one greedy request; what happened to it."""
    from kvmesh.cluster import DeadlineExceeded, KvmeshError

    rec: dict = {"t0": time.monotonic(), "tokens": [], "first": None}
    try:
        for chunk in client.generate(
            prompt,
            max_tokens=a.max_tokens,
            temperature=0,
            ignore_eos=True,
            timeout=a.request_timeout,
        ):
            if chunk.token_ids and rec["first"] is None:
                rec["first"] = time.monotonic()
            rec["tokens"] += chunk.token_ids
            if chunk.finished:
                rec["finish_reason"] = chunk.finish_reason
                rec["worker"] = chunk.worker_id
        rec["status"] = "completed"
    except DeadlineExceeded:
        rec["status"] = "hung"
    except KvmeshError as e:
        got = rec["first"] is not None
        rec["status"] = "failed_after_first_token" if got else "failed_before_first_token"
        rec["code"] = e.code.name
        rec["details"] = e.details[:200]
    rec["t1"] = time.monotonic()
    return rec


def run_load(client, prompts, order, a, stop: threading.Event | None) -> tuple[list, int]:
    """``--concurrency`` threads take prompt indices from ``order`` (an iterator) until it
    ends or ``stop`` is set. Returns the records and how many were still open after
    ``--grace`` seconds (hung)."""
    lock = threading.Lock()
    records: list[dict] = []
    it = iter(order)

    def worker() -> None:
        while stop is None or not stop.is_set():
            with lock:
                idx = next(it, None)
            if idx is None:
                return
            rec = one_request(client, prompts[idx], a)
            rec["idx"] = idx
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    if stop is not None:
        stop.wait()
    deadline = time.monotonic() + (a.grace if stop is not None else 3600)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return records, sum(t.is_alive() for t in threads)


# ---------------------------------------------------------------- faults


def invalid_flood(endpoint: str, n: int) -> dict:
    """``n`` requests that must each be refused with INVALID_ARGUMENT, 8 at a time."""
    from kvmesh.cluster import Client, KvmeshError

    bad = [
        dict(temperature=float("nan")),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(max_tokens=0),
        dict(stop=["x"] * 1000),
        dict(stop_token_ids=[-1]),
        dict(cache_salt="s" * 10_000),
    ]
    codes: dict[str, int] = {}

    def send(i: int) -> str:
        prompt = [] if i % 8 == 7 else [1 + i % 1000, 2, 3]
        try:
            with_client.generate_text(prompt, **bad[i % len(bad)])
            return "OK"
        except KvmeshError as e:
            return e.code.name

    with Client(endpoint, timeout=60, retries=0) as with_client:
        with futures.ThreadPoolExecutor(8) as pool:
            for code in pool.map(send, range(n)):
                codes[code] = codes.get(code, 0) + 1
    return {"sent": n, "codes": codes}


def corrupt_live_keys(redis: Redis, limit: int) -> dict:
    """Overwrite up to ``limit`` live kvmesh page objects: half with garbage, half with one
    flipped payload byte (only the checksum can tell)."""
    r = redis.client()
    keys = [k for k in r.scan_iter(match="kvmesh:*", count=1000)][:limit]
    for i, k in enumerate(keys):
        obj = r.get(k)
        if obj is None:
            continue
        if i % 2:
            bad = bytearray(obj)
            bad[-100] ^= 0x5A
            r.set(k, bytes(bad), keepttl=True)
        else:
            r.set(k, b"\x00garbage, not a page", keepttl=True)
    return {"corrupted": len(keys)}


def hostile_peer(worker_address: str) -> dict:
    """A KVTransfer server that claims every page and serves garbage, named by a client in
    ``peer_addresses`` of a request sent straight to a worker; and a forged ``Push``."""
    import grpc

    from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
    from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
    from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as kpb
    from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as kpb_grpc

    class Liar(kpb_grpc.KVTransferServicer):
        contacted = 0

        def Lookup(self, request, context):
            Liar.contacted += 1
            return kpb.LookupResponse(tiers=["device"] * len(request.hashes))

        def Fetch(self, request, context):
            Liar.contacted += 1
            for i, h in enumerate(request.hashes):
                data = os.urandom(4096)
                yield kpb.PageChunk(
                    pieces=[kpb.PagePiece(hash=h, index=i, found=True, total_size=4096, data=data)]
                )

    server = grpc.server(futures.ThreadPoolExecutor(4))
    kpb_grpc.add_KVTransferServicer_to_server(Liar(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out: dict = {}
    try:
        with grpc.insecure_channel(worker_address) as ch:
            req = ipb.GenerateRequest(
                token_ids=ipb.TokenIds(ids=list(range(100, 164))),
                sampling=ipb.SamplingParams(max_tokens=2, temperature=0.0),
                peer_addresses=[f"127.0.0.1:{port}"],
            )
            try:
                list(ipb_grpc.InferenceStub(ch).Generate(req, timeout=60))
                out["generate_naming_hostile_peer"] = "OK"
            except grpc.RpcError as e:
                out["generate_naming_hostile_peer"] = e.code().name
            forged = kpb.PageChunk(
                pieces=[kpb.PagePiece(hash=b"\x01" * 16, found=True, total_size=4, data=b"evil")]
            )
            try:
                kpb_grpc.KVTransferStub(ch).Push(iter([forged]), timeout=30)
                out["forged_push"] = "OK"
            except grpc.RpcError as e:
                out["forged_push"] = e.code().name
    finally:
        server.stop(None)
    out["hostile_peer_contacted"] = Liar.contacted
    return out


def worker_tier_metrics(actors) -> list[dict]:
    """Each worker's Redis and host tier counters (a restarted worker's start from zero):
    whether corrupt objects were read (and refused), and Redis errors."""
    import ray

    def read(self):
        m = self.aeng.call(lambda e: e.store_metrics(), 30)
        return {"worker_id": self.worker_id} | {
            t: m.get("tiers", {}).get(t) for t in ("host", "redis")
        }

    out = []
    for actor in actors:
        try:
            out.append(ray.get(actor.__ray_call__.remote(read), timeout=60))
        except Exception as e:
            out.append({"error": repr(e)[:200]})
    return out


def sigkill_worker(actor) -> dict:
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)
    return {"pid": pid}


# ---------------------------------------------------------------- report


def restart_redis(redis: Redis) -> dict:
    redis.kill()  # SIGKILL: nothing saved
    redis.start()  # the same port, empty
    return {}


def summarize(
    records: list[dict], still_open: int, reference: dict | None, kill_t: float | None
) -> dict:
    """Counts by outcome; ``wrong``: completed with tokens other than the reference's."""
    by_status: dict[str, int] = {}
    codes: dict[str, int] = {}
    wrong = 0
    after_overlapping_kill = 0
    for r in records:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
        if "code" in r:
            key = f"{r['status']}:{r['code']}"
            codes[key] = codes.get(key, 0) + 1
        if (
            reference is not None
            and r["status"] == "completed"
            and r["idx"] in reference
            and reference[r["idx"]] != r["tokens"]
        ):
            wrong += 1
        if r["status"] == "failed_after_first_token" and kill_t is not None:
            after_overlapping_kill += r["t0"] <= kill_t <= r["t1"]
    return {
        "sent": len(records) + still_open,
        "completed": by_status.get("completed", 0),
        "failed_before_first_token": by_status.get("failed_before_first_token", 0),
        "failed_after_first_token": by_status.get("failed_after_first_token", 0),
        "failed_after_first_token_in_flight_at_the_kill": after_overlapping_kill,
        "failure_codes": codes,
        "wrong": wrong,
        "hung": by_status.get("hung", 0) + still_open,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=90.0, help="seconds of chaos load")
    p.add_argument("--concurrency", type=int, default=4)
    # 12 prefixes of 10 pages: more than the two device pools hold, so pages spill to Redis
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--per-prefix", type=int, default=2)
    p.add_argument("--prefix-tokens", type=int, default=160)
    p.add_argument("--tail-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-cache-memory", default="24MiB", help="per worker (34 pages)")
    p.add_argument("--host-cache-memory", default="4MiB", help="per worker: spills reach Redis")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--grace", type=float, default=60.0, help="after the load stops")
    p.add_argument("--flood", type=int, default=200, help="invalid requests in the flood")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the JSON object here")
    a = p.parse_args(argv)

    import ray

    from kvmesh.cluster import Client
    from kvmesh.cluster.serve import Cluster, ClusterConfig, init_ray

    prompts = make_prompts(a)
    redis = Redis()
    redis.start()
    out: dict = {"config": vars(a) | {"prompts": len(prompts)}}
    # every process on loopback: the router, the workers' gRPC and data-plane ports, Redis
    init_ray(
        None,
        num_cpus=4,
        log_to_driver=False,
        object_store_memory=150 * 2**20,
        _node_ip_address="127.0.0.1",
    )
    cluster = None
    try:
        t0 = time.monotonic()
        cluster = Cluster.start(
            ClusterConfig(
                workers=2,
                port=0,
                host="127.0.0.1",
                engine_args={
                    "kv_cache_memory": a.kv_cache_memory,
                    "host_cache_memory": a.host_cache_memory,
                    "redis_url": redis.url,
                    "max_num_batched_tokens": 256,
                },
                log_level="ERROR",
                seed=a.seed,
            )
        )
        out["config"]["startup_s"] = round(time.monotonic() - t0, 1)
        with Client(cluster.endpoint, timeout=a.request_timeout) as client:
            # 1. the reference: every prompt once, no faults
            t0 = time.monotonic()
            ref_records, ref_open = run_load(client, prompts, range(len(prompts)), a, None)
            reference = {r["idx"]: r["tokens"] for r in ref_records if r["status"] == "completed"}
            out["reference"] = summarize(ref_records, ref_open, None, None) | {
                "wall_s": round(time.monotonic() - t0, 1),
                "prompts_with_reference": len(reference),
            }
            print(f"reference: {out['reference']}", file=sys.stderr, flush=True)

            # 2. chaos: random prompts for --duration seconds while the faults land
            rng = random.Random(a.seed + 1)
            order = (rng.randrange(len(prompts)) for _ in iter(int, 1))
            stop = threading.Event()
            faults: list[dict] = []
            kill_t: list[float] = []
            workers = cluster.stats()["workers"]
            victim_addr = next(iter(workers.values()))["address"]
            out["addresses"] = {
                "router": cluster.endpoint,
                "workers": [w["address"] for w in workers.values()],
                "redis": redis.url,
            }

            def timeline() -> None:
                t_start = time.monotonic()
                plan = [
                    (0.10, "invalid_flood", lambda: invalid_flood(cluster.endpoint, a.flood)),
                    (0.25, "corrupt_redis_objects", lambda: corrupt_live_keys(redis, 64)),
                    (0.40, "redis_restart", lambda: restart_redis(redis)),
                    (0.55, "hostile_peer", lambda: hostile_peer(victim_addr)),
                    (0.70, "worker_sigkill", lambda: sigkill_worker(cluster.workers[0])),
                ]
                for frac, name, fn in plan:
                    delay = t_start + frac * a.duration - time.monotonic()
                    if stop.wait(max(0.0, delay)):
                        return
                    at = time.monotonic()
                    if name == "worker_sigkill":
                        kill_t.append(at)
                    try:
                        result = fn() or {}
                    except Exception as e:  # report it; the bench goes on
                        result = {"error": repr(e)}
                    faults.append({"fault": name, "at_s": round(at - t_start, 1)} | result)
                    print(f"fault: {faults[-1]}", file=sys.stderr, flush=True)

            chaos_t0 = time.monotonic()
            injector = threading.Thread(target=timeline, daemon=True)
            injector.start()
            threading.Timer(a.duration, stop.set).start()
            records, still_open = run_load(client, prompts, order, a, stop)
            injector.join(a.grace)
            out["chaos"] = summarize(records, still_open, reference, kill_t[0] if kill_t else None)
            out["chaos"]["wall_s"] = round(time.monotonic() - chaos_t0, 1)
            out["chaos"]["no_reference_for"] = sum(
                1 for r in records if r["status"] == "completed" and r["idx"] not in reference
            )
            out["faults"] = faults
            stats = cluster.stats()
            out["router"] = {"retries": stats.get("retries"), "removed": stats.get("removed")}
            out["worker_tiers"] = worker_tier_metrics(cluster.workers)
    finally:
        if cluster is not None:
            cluster.shutdown(grace=0)
        ray.shutdown()
        redis.kill()
    c = out.get("chaos", {})
    out["targets_met"] = {
        "wrong_eq_0": c.get("wrong") == 0,
        "hung_eq_0": c.get("hung") == 0,
        "failed_before_first_token_eq_0": c.get("failed_before_first_token") == 0,
        "failed_after_only_at_the_kill": c.get("failed_after_first_token")
        == c.get("failed_after_first_token_in_flight_at_the_kill"),
    }
    out["machine"] = machine_info()
    text = json.dumps(out, indent=2)
    if a.output:
        Path(a.output).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
