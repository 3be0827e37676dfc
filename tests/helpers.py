"""Helpers shared by test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import contextlib
import math

from kvmesh.protos.security import ClusterIdentity

# the cluster secret of the tests' own servers: a test that acts as a cluster member (calls
# KVTransfer, GetLoad, names peers) carries it; a local Ray cluster draws its own
# (Cluster.identity)
TEST_IDENTITY = ClusterIdentity(b"kvmesh-tests-cluster-secret-0123456789")


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos=True) -> list[int]:
    """transformers' greedy continuation; with ignore_eos it never stops early."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if ignore_eos else 0,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def text_prompts(tokenizer, text: str, lengths: list[int], stride: int = 4000) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths, cut from different parts of ``text``."""
    out = []
    for i, n in enumerate(lengths):
        ids = tokenizer.encode(text[i * stride : i * stride + n * 8])[:n]
        assert len(ids) == n, f"text slice too short for {n} tokens"
        out.append(ids)
    return out


def free_port() -> int:
    """A loopback port free right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_side_port_flags() -> list[str]:
    """``ray start`` flags giving every port Ray would otherwise take at a fixed default a
    free one: several test clusters (other checkouts' included) run on this machine at
    once. Also turns off the dashboard and usage stats."""
    return [
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]


def wait_until(pred, timeout: float = 30.0, every: float = 0.1):
    """Poll ``pred()`` until it is truthy or ``timeout`` seconds passed; its last value."""
    import time

    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > end:
            return value
        time.sleep(every)


class RayHead:
    """A Ray head node of its own for one test cluster, started by ``ray start`` in a process
    of its own: on free ports, in a short temp dir of its own, stopped by finding exactly its
    processes. Not ``ray.init(address="local")``: that forks Ray's daemons from the test
    process, and when another thread of that (long-lived, many-threaded) process is inside a
    filelock lock operation, filelock's at-fork hook (which Ray's ``preexec_fn`` runs) holds
    the fork for up to 30 s and then ends the child before it becomes the raylet: "The
    current node timed out during startup", a GCS but no raylet. DEVELOPERS.md, "Ray in the
    tests", has the evidence.

    Token auth is off (``RAY_AUTH_MODE=disabled`` while the head runs), as for
    ``ray_autoscaling.OwnAutoscalingCluster``: a driver process keeps the auth mode it read,
    so every Ray cluster one test process joins must use the same mode (a later
    ``ray.init(address="local")`` in it, with the default token mode, fails to connect)."""

    def __init__(self, num_cpus: int = 4, object_store_memory: int = 150 * 2**20) -> None:
        self.num_cpus = num_cpus
        self.object_store_memory = object_store_memory
        self.temp_dir: str | None = None
        self._old_auth_mode: str | None = None
        self._auth_saved = False  # start() changed this process's RAY_AUTH_MODE

    def start(self) -> str:
        """Start the head; its GCS address, for ``ray.init(address=...)``."""
        import os
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        import ray

        # short: Ray's Unix socket paths live under it (at most 107 bytes)
        self.temp_dir = tempfile.mkdtemp(prefix="kvt", dir="/tmp")
        port = free_port()
        cmd = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            f"--port={port}",
            f"--temp-dir={self.temp_dir}",
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={self.object_store_memory}",
            *ray_side_port_flags(),
        ]
        # Ray's token auth: the head and this driver must agree; a loopback test cluster
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        self._old_auth_mode = os.environ.get("RAY_AUTH_MODE")
        self._auth_saved = True
        os.environ["RAY_AUTH_MODE"] = "disabled"  # this driver's; stop() restores it
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if out.returncode != 0:
            logs = self.temp_dir
            self.stop(keep_logs=True)
            raise RuntimeError(
                f"ray start failed (rc {out.returncode}; its logs are in {logs}):\n"
                f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
        ray._private.services.find_gcs_addresses.cache_clear()
        return f"{ray.util.get_node_ip_address()}:{port}"

    def processes(self) -> list:
        """The head's processes (those naming its temp dir) and their descendants (the
        workers, whose command line Ray rewrites)."""
        import os

        import psutil

        if self.temp_dir is None:
            return []
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmdline = p.info["cmdline"] or ()
                if p.pid != os.getpid() and any(self.temp_dir in a for a in cmdline):
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        found.pop(os.getpid(), None)
        return list(found.values())

    def stop(self, keep_logs: bool = False) -> None:
        """End the head's processes and remove its temp dir. SIGTERM, then SIGKILL after
        0.5 s: the GCS does not stop on SIGTERM within 5 s even idle (over 10 s loaded), so
        a longer grace only waits, and nothing of a test cluster needs keeping (its object
        store's memory is freed with its processes)."""
        import os
        import shutil

        import psutil

        if self._auth_saved:  # only what start() changed
            if self._old_auth_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self._old_auth_mode
            self._auth_saved = False
        if self.temp_dir is None:
            return
        for grace in (0.5, 0.0):  # again: a worker may have spawned during the first sweep
            procs = self.processes()
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.terminate() if grace else p.kill()
            _, alive = psutil.wait_procs(procs, timeout=grace)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(alive, timeout=10)
        if not keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.temp_dir = None


@contextlib.contextmanager
def local_cluster(
    engine_args: dict, model: str = "smollm2-135m-instruct", workers: int = 2, **config
):
    """A real local Ray cluster (a head of its own, ``RayHead``; its own namespace) running
    ``kvmesh serve``'s cluster on a fixed free port, so a restarted router comes back where
    the client looks. ``config``: more ClusterConfig fields (e.g. ``http_port=0``)."""
    import uuid

    import pytest

    try:
        import ray
    except ImportError:  # never skip: a missing Ray is a broken set-up
        pytest.fail("ray is not installed: run `make setup` (or `pip install ray`)", pytrace=False)

    from kvmesh.cluster.serve import Cluster, ClusterConfig

    head = RayHead(num_cpus=4, object_store_memory=150 * 2**20)
    try:
        address = head.start()
        ray.init(address=address, namespace=f"kvmesh-test-{uuid.uuid4().hex[:6]}")
        try:
            cfg = ClusterConfig(
                workers=workers,
                model=model,
                engine_args=engine_args,
                host="127.0.0.1",
                port=free_port(),
                grace_s=2.0,
                log_level="WARNING",
                seed=0,
                **config,
            )
            c = Cluster.start(cfg, timeout_s=300)
            try:
                yield c
            finally:
                c.shutdown(grace=0)
        finally:
            ray.shutdown()
    finally:
        head.stop()


def restart_router(cluster, timeout: float = 120.0) -> bool:
    """Crash the cluster's router actor (Ray restarts it) and wait until a new one answers."""
    import ray

    old_id = ray.get(cluster.router.ping.remote())
    ray.kill(cluster.router, no_restart=False)

    def restarted():
        try:
            return ray.get(cluster.router.ping.remote(), timeout=5) != old_id
        except ray.exceptions.RayError:
            return False

    return wait_until(restarted, timeout=timeout)


def register_worker(
    router,
    *,
    worker_id: str,
    address: str,
    model_fp: str,
    block_size: int,
    name: str = "test-worker",
) -> None:
    """Register a worker with an in-process ``RouterServer`` the way the Ray shell does
    (``RouterServer.register_worker``, on the router's loop), with no pages and no load
    yet. The router's core should be built with a long ``report_timeout_s``: nothing
    reports for this worker."""
    info = {
        "worker_id": worker_id,
        "name": name,
        "address": address,
        "model_fp": model_fp,
        "block_size": block_size,
        "next_seq": 0,
        "pages": {},
        "load": None,
    }
    router.call(router.register_worker, info)


def make_test_pki(d, tokens: list[str], server_names: str = "IP:127.0.0.1,DNS:localhost"):
    """A throwaway CA in ``d`` (``ca.pem``), a server certificate for ``server_names``
    (``server.pem``/``.key``), a client certificate (``client.pem``/``.key``) and a token
    file (``tokens``), made with the ``openssl`` CLI. Returns ``d``."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make the test CA: apt-get install openssl")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=kvmesh test CA")  # fmt: skip
    exts = {"server": f"subjectAltName={server_names}\n", "client": "extendedKeyUsage=clientAuth\n"}
    for name, ext in exts.items():
        (d / f"{name}.ext").write_text(ext)
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=kvmesh test {name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                "-extfile", f"{name}.ext")  # fmt: skip
    (d / "tokens").write_text("# one per line\n" + "\n".join(tokens) + "\n")
    return d


@contextlib.contextmanager
def in_process_router(
    worker, *, name: str = "test-worker", core_kw: dict | None = None, **server_kw
):
    """An in-process ``RouterServer`` in front of one in-process ``WorkerServer``, the worker
    registered the way the Ray shell registers it. Nothing reports for that worker here, so
    the core's report timeout is an hour (``core_kw`` adds or overrides core options);
    ``server_kw`` goes to ``RouterServer`` (``tokenize`` defaults to the engine's
    tokenizer)."""
    from kvmesh.router.core import RouterCore
    from kvmesh.router.service import RouterServer

    eng = worker.engine.engine
    core = RouterCore(**{"report_timeout_s": 3600.0, **(core_kw or {})})
    server_kw.setdefault("tokenize", eng.tokenizer.encode)
    srv = RouterServer(core, **server_kw)
    srv.start_in_thread()
    try:
        register_worker(
            srv,
            worker_id=worker.worker_id,
            address=worker.address,
            model_fp=eng.model_fp,
            block_size=eng.cache_config.block_size,
            name=name,
        )
        yield srv
    finally:
        srv.stop_in_thread(grace=0)


def member_channel(address: str, identity: ClusterIdentity = TEST_IDENTITY):
    """A plaintext grpc channel whose every call carries ``identity``'s credential: a test
    that talks to KVTransfer (or GetLoad) as a cluster member would."""
    import grpc

    class AddMetadata(
        grpc.UnaryUnaryClientInterceptor,
        grpc.UnaryStreamClientInterceptor,
        grpc.StreamUnaryClientInterceptor,
        grpc.StreamStreamClientInterceptor,
    ):
        def _with(self, details):
            return details._replace(metadata=(*(details.metadata or ()), *identity.metadata()))

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._with(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._with(details), request)

        def intercept_stream_unary(self, continuation, details, requests):
            return continuation(self._with(details), requests)

        def intercept_stream_stream(self, continuation, details, requests):
            return continuation(self._with(details), requests)

    return grpc.intercept_channel(grpc.insecure_channel(address), AddMetadata())


def tiny_deepseek_config(**overrides) -> dict:
    """A DeepSeek-V3 config (Hugging Face field names) small enough for a unit test: every
    layer dense (kvmesh runs no mixture-of-experts), plain q_proj, MLA dimensions that
    differ from each other so a swapped one shows."""
    cfg = dict(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=16,
        v_head_dim=8,
        first_k_dense_replace=2,
        max_position_embeddings=4096,
    )
    cfg.update(overrides)
    return cfg


def ref_softmax_row(q, keys, upto: int, head_size: int) -> list[float]:
    """Softmax over slots 0..upto of q . keys[j] / sqrt(head_size), in float64 by plain
    loops: q (D,), keys (N, D). The eviction policies' loop references build on it."""
    logits = [float(q.double() @ keys[j].double()) / math.sqrt(head_size) for j in range(upto + 1)]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    total = sum(e)
    return [x / total for x in e]


def ref_top_and_recent(scores: list, budget: int, recent: int) -> list[int]:
    """The last ``recent`` slots and the ``budget - recent`` highest-scoring others (ties to
    the lower slot), ascending: the loop reference of eviction's top-and-recent rule."""
    n = len(scores)
    if budget >= n:
        return list(range(n))
    recent = min(recent, budget)
    older = sorted(range(n - recent), key=lambda i: (-scores[i], i))[: budget - recent]
    return sorted(older + list(range(n - recent, n)))


def fill_request_slots(
    cache, table: list[int], k, v, slot: int, *, block_size: int, residual_slots: int
):
    """Write k, v (N, H, D) into one layer's cache (a ``LayerCache``) as a request's first N
    slots, as the engine would: full pages into ``table``'s pages (quantized formats through
    the page quantizer), the rest into residual slot ``slot``. ``residual_slots``: how many
    residual slots the pool has (the staging rows sit after them)."""
    import torch

    from kvmesh.kernels.cache_write import write_kv_cache

    bs, n = block_size, k.shape[0]
    j = torch.arange(n)
    if not cache.quantized:
        pages = torch.tensor(table)[j // bs]
        cache.views["k"][pages, j % bs] = k.to(cache.views["k"].dtype)
        cache.views["v"][pages, j % bs] = v.to(cache.views["v"].dtype)
        return
    full = n // bs
    write_kv_cache(
        fmt=cache.cache_format,
        k=k,
        v=v,
        cache=cache.views,
        residual_k=cache.residual_k,
        residual_v=cache.residual_v,
        residual_slots=torch.where(j >= full * bs, slot * bs + j % bs, -1),
        complete_pages=torch.tensor(table[:full]),
        complete_src=(residual_slots * bs + torch.arange(full * bs)).view(full, bs),
    )
