"""Page transfer between workers: the data plane and gRPC Fetch. Prints one JSON object.

    .venv/bin/python bench/transfer.py [--pages 1000] [--page-nbytes 737280] [--skip-ttft]
                                       [--ttft-grpc] [--tls]

1. Throughput: a worker server whose host tier holds ``--pages`` page objects of
   ``--page-nbytes`` (SmolLM2's fp32 page by default); a ``PeerTier`` client fetches them
   all, once over the worker's raw-TCP data plane (PeerTier's default) and once with
   ``data_plane=False`` over ``KVTransfer.Fetch`` (chunks of at most 1 MiB, CRC-checked,
   reassembled). Baselines in the same run: a plain TCP socket on loopback copying the very
   same bytes into a buffer, and the ceiling of grpcio itself: a bare server stream of the
   same objects, one per message, with no kvmesh code on either side. Target: the path
   PeerTier uses by default at >= 50% of the socket's throughput. Each path's best of
   ``--repeats``; the previous repeat's pages are freed before the next fetch starts.
   Authentication (docs/security.md): every fetch is a cluster member's (a fresh cluster
   secret); the data plane MACs every page (keyed BLAKE3) on both ends, so its figure
   includes that cost, and ``page_mac_MBps`` is what one core MACs in the same run (each
   side pays it once per page; ``hmac_sha256_MBps`` beside it for comparison). ``--tls``
   adds ``fetch_tls_MBps``: the same Fetch from a worker whose gRPC port uses TLS (a
   throwaway CA made by the ``openssl`` CLI), and the data plane of that TLS worker
   (``data_plane_under_tls_MBps``; the same MAC'd bytes, not encrypted).
2. TTFT of worker B serving a ``--prefix-tokens`` prefix that worker A computed, by pulling
   A's pages (peer tier, over the transport PeerTier picks by default, or gRPC Fetch with
   ``--ttft-grpc``: ``peer_transport``), against B computing a same-length prompt A does not
   have.

Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from machine import machine_info

from kvmesh.kvstore.codec import PageSpec, encode
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.peer import PeerTier, TierPageSource
from kvmesh.protos.security import ClusterIdentity, TLSConfig
from kvmesh.worker.server import WorkerServer

IDENTITY = ClusterIdentity.generate()  # the benchmark's cluster

TEXT = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare.txt"


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def socket_copy_gbps(objs: list[bytes], repeats: int) -> float:
    """Plain loopback TCP: a sender thread writes every object, the receiver reads them into
    one preallocated buffer."""
    total = sum(map(len, objs))
    best = float("inf")
    for _ in range(repeats):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]

        def send(srv=srv):
            conn, _ = srv.accept()
            with conn:
                for o in objs:
                    conn.sendall(o)

        t = threading.Thread(target=send)
        t.start()
        buf = bytearray(total)
        view = memoryview(buf)
        with socket.create_connection(("127.0.0.1", port)) as c:
            t0 = time.perf_counter()
            got = 0
            while got < total:
                n = c.recv_into(view[got:], min(total - got, 1 << 20))
                if n == 0:
                    raise RuntimeError("socket closed early")
                got += n
            best = min(best, time.perf_counter() - t0)
        t.join()
        srv.close()
    return total / best / 1e9


def grpc_stream_gbps(objs: list[bytes], repeats: int) -> float:
    """grpcio's own ceiling here: a bare grpc.aio server stream (uvloop, as the worker)
    sending each object as one PageChunk; the client only touches the bytes."""
    import asyncio

    import grpc
    import uvloop

    from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2 as pb
    from kvmesh.protos.kvmesh.v1 import kv_transfer_pb2_grpc as pb_grpc

    class Bare(pb_grpc.KVTransferServicer):
        async def Fetch(self, request, context):
            for o in objs:
                chunk = pb.PageChunk()
                chunk.pieces.add().data = o
                yield chunk

    opts = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    box: dict = {}
    started = threading.Event()

    async def serve():
        server = grpc.aio.server(options=opts)
        pb_grpc.add_KVTransferServicer_to_server(Bare(), server)
        box["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        box["stop"] = asyncio.Event()
        box["loop"] = asyncio.get_running_loop()
        started.set()
        await box["stop"].wait()
        await server.stop(0)

    t = threading.Thread(target=lambda: uvloop.run(serve()), daemon=True)
    t.start()
    started.wait(30)
    total = sum(map(len, objs))
    best = float("inf")
    with grpc.insecure_channel(f"127.0.0.1:{box['port']}", options=opts) as ch:
        stub = pb_grpc.KVTransferStub(ch)
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = sum(len(c.pieces[0].data) for c in stub.Fetch(pb.FetchRequest()))
            best = min(best, time.perf_counter() - t0)
            assert n == total
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(10)
    return total / best / 1e9


def mac_gbps(objs: list[bytes], repeats: int, kind: str) -> float:
    """The data plane's page MAC (``page``: keyed BLAKE3) or HMAC-SHA256 (``hmac``) of every
    object on one core: what each side of the data plane pays per page."""
    import hmac

    from kvmesh.kvstore.dataplane.protocol import PAGE_HEAD, page_mac

    key = IDENTITY.data_plane_key
    head = PAGE_HEAD.pack(0, 1, len(objs[0]))
    total = sum(map(len, objs))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for o in objs:
            if kind == "page":
                page_mac(key, bytes(16), head, bytes(16), o)
            else:
                hmac.digest(key, o, "sha256")
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def throwaway_tls(tmp: Path) -> TLSConfig:
    """A CA and a certificate for 127.0.0.1 made by the openssl CLI."""
    import subprocess

    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=tmp, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=bench CA")  # fmt: skip
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=bench")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "srv.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    return TLSConfig.from_files(tmp / "srv.pem", tmp / "srv.key", ca=tmp / "ca.pem")


def peer_fetch_s(
    address: str, hashes, objs, repeats: int, *, data_plane: bool, credentials=None
) -> tuple:
    """Seconds of each ``PeerTier.get`` of every page, and the transport it used."""
    name = "data plane" if data_plane else "gRPC Fetch"
    total = sum(map(len, objs))
    peer = PeerTier(
        [address], identity=IDENTITY, timeout=120.0, data_plane=data_plane, credentials=credentials
    )
    try:
        transport = peer.transport()
        times = []
        got = None
        for r in range(repeats):
            got = None  # the previous repeat's pages are freed, as a loader frees them
            t0 = time.perf_counter()
            got = peer.get(hashes)
            times.append(time.perf_counter() - t0)
            assert all(g == o for g, o in zip(got, objs)), f"{name}: fetched bytes differ"
            log(f"{name} {r + 1}: {total / times[-1] / 1e9:.3f} GB/s")
        assert peer.metrics["errors"] == 0, peer.metrics
    finally:
        peer.close()
    return times, transport


def bench_fetch(args) -> dict:
    spec = PageSpec("ab" * 16, "fp32", 30, 3, 64, 16, args.page_nbytes)
    payload = os.urandom(args.page_nbytes)
    hashes = [i.to_bytes(16, "little") for i in range(args.pages)]
    objs = [encode(spec, payload) for _ in hashes]
    host = HostTier(sum(map(len, objs)) + 1)
    host.put(list(zip(hashes, objs)))
    total = sum(map(len, objs))
    sock_gbps = socket_copy_gbps(objs, args.repeats)
    log(f"socket: {sock_gbps:.3f} GB/s")
    page_mac_gbps = mac_gbps(objs, args.repeats, "page")
    hmac_gbps = mac_gbps(objs, args.repeats, "hmac")
    log(f"page MAC: {page_mac_gbps:.3f} GB/s, hmac-sha256: {hmac_gbps:.3f} GB/s")
    server = WorkerServer(None, page_source=TierPageSource(host, spec=spec), identity=IDENTITY)
    server.start_in_thread()
    try:
        dp_times, default = peer_fetch_s(
            server.address, hashes, objs, args.repeats, data_plane=True
        )
        assert default == "data_plane", default
        fetch_times, _ = peer_fetch_s(server.address, hashes, objs, args.repeats, data_plane=False)
    finally:
        server.stop_in_thread(grace=0)
    tls_out = {}
    if args.tls:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tls-") as tmp:
            tls = throwaway_tls(Path(tmp))
        server = WorkerServer(
            None,
            page_source=TierPageSource(host, spec=spec),
            identity=IDENTITY,
            server_credentials=tls.server_credentials(),
            data_plane=True,  # asked for: a TLS worker runs none by default
        )
        server.start_in_thread()
        creds = tls.channel_credentials()
        try:
            tls_fetch, _ = peer_fetch_s(
                server.address, hashes, objs, args.repeats, data_plane=False, credentials=creds
            )
            tls_dp, _ = peer_fetch_s(
                server.address, hashes, objs, args.repeats, data_plane=True, credentials=creds
            )
        finally:
            server.stop_in_thread(grace=0)
        tls_out = {
            "fetch_tls_MBps": total / min(tls_fetch) / 1e6,
            "fetch_tls_over_fetch": min(fetch_times) / min(tls_fetch),
            "data_plane_under_tls_MBps": total / min(tls_dp) / 1e6,
        }
    bare_gbps = grpc_stream_gbps(objs, args.repeats)
    log(f"bare grpc stream: {bare_gbps:.3f} GB/s")
    dp_s, fetch_s = min(dp_times), min(fetch_times)
    fetch_gbps, dp_gbps = total / fetch_s / 1e9, total / dp_s / 1e9
    return {
        "pages": args.pages,
        "page_object_bytes": len(objs[0]),
        "socket_MBps": sock_gbps * 1e3,
        "socket_pages_per_s": sock_gbps * 1e9 / len(objs[0]),
        "data_plane_MBps": dp_gbps * 1e3,
        "data_plane_pages_per_s": args.pages / dp_s,
        "data_plane_over_socket": dp_gbps / sock_gbps,
        # the first fetch, before the receive pool holds memory to reuse
        "data_plane_first_MBps": total / dp_times[0] / 1e6,
        "fetch_MBps": fetch_gbps * 1e3,  # gRPC KVTransfer.Fetch
        "fetch_pages_per_s": args.pages / fetch_s,
        "fetch_over_socket": fetch_gbps / sock_gbps,
        "bare_grpc_stream_MBps": bare_gbps * 1e3,
        "bare_grpc_stream_over_socket": bare_gbps / sock_gbps,
        "fetch_over_bare_grpc": fetch_gbps / bare_gbps,
        "peer_tier_default": default,
        "page_mac_MBps": page_mac_gbps * 1e3,  # one core; each side MACs every page once
        "hmac_sha256_MBps": hmac_gbps * 1e3,
        **tls_out,
        # the path PeerTier uses by default (the data plane) against the plain socket
        "target_ge_0.5": dp_gbps / sock_gbps >= 0.5,
    }


def bench_peer_ttft(args) -> dict:
    from kvmesh.worker import LLM, SamplingParams
    from kvmesh.worker.engine import LLMEngine

    text = TEXT.read_text()
    a_engine = LLMEngine("smollm2-135m-instruct", kv_cache_memory="512MiB")
    a = WorkerServer(a_engine, identity=IDENTITY)
    a.start_in_thread()
    # PeerTier's default transport (the data plane), unless --ttft-grpc
    peer = PeerTier([a.address], identity=IDENTITY, timeout=120.0, data_plane=not args.ttft_grpc)
    transport = peer.transport()
    b = LLM("smollm2-135m-instruct", kv_cache_memory="512MiB", extra_tiers=[peer])
    tok = b.tokenizer
    n = args.prefix_tokens + 1
    prompts = [tok.encode(text[i * 40_000 : i * 40_000 + n * 6])[:n] for i in range(7)]
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def timed(ids):
        t0 = time.perf_counter()
        out = b.generate([ids], one)[0]
        return time.perf_counter() - t0, out

    n_data_plane = n_grpc = 0
    try:
        timed(prompts[6])  # warm-up
        peer_s, cold_s = [], []
        for i in range(args.repeats):
            a.engine.call(lambda e, p=prompts[i]: e.add_request(p, one))  # A computes it
            while a.engine.call(lambda e: e.has_unfinished_requests()):
                time.sleep(0.05)
            t, out = timed(prompts[i])
            assert out.cached_tokens_by_tier.get("peer", 0) >= args.prefix_tokens - 16, out
            peer_s.append(t)
            t, out = timed(prompts[3 + i])  # A never saw it: B computes it all
            cold_s.append(t)
            log(f"ttft peer {peer_s[-1]:.3f}s recompute {cold_s[-1]:.3f}s")
        n_data_plane, n_grpc = peer.metrics["data_plane_pages"], peer.metrics["grpc_pages"]
    finally:
        b.close()
        a.stop_in_thread(grace=0)
    med = statistics.median
    return {
        "prefix_tokens": args.prefix_tokens,
        "peer_transport": transport,
        "pages_over_data_plane": n_data_plane,
        "pages_over_grpc": n_grpc,
        "ttft_peer_s": med(peer_s),
        "ttft_recompute_s": med(cold_s),
        "peer_over_recompute": med(peer_s) / med(cold_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=1000)
    ap.add_argument("--page-nbytes", type=int, default=737_280)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument(
        "--tls", action="store_true", help="also fetch from a TLS worker (needs the openssl CLI)"
    )
    ap.add_argument(
        "--ttft-grpc", action="store_true", help="peer TTFT over gRPC Fetch, not the data plane"
    )
    args = ap.parse_args()
    out = {"fetch": bench_fetch(args)}
    if not args.skip_ttft:
        out["peer_ttft"] = bench_peer_ttft(args)
    out["loadavg_1m"] = os.getloadavg()[0]
    out["machine"] = machine_info()  # CPU model and SIMD flags
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
