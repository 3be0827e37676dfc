"""The roofs of a prefix restore on this machine: how fast any client could move a 2,048-token
prefix's pages from host RAM or from Redis into the page pool (issue 21). Prints one JSON
object.

    .venv/bin/python bench/restore_roof.py [--pages 128] [--page-nbytes 737280] [--trials 7]
        [--device-hit-s 0.051] [--redis-url URL]

What it times (best and median of ``--trials``; 128 pages of 737,280 bytes = a SmolLM2 fp32
2,048-token prefix, ~94 MB):

a. ``memcpy``: the pages, held as stored objects (bytes, payload after a header as the
   host tier holds them), copied into a preallocated, already-touched pool tensor: one page
   at a time with numpy on 1 thread (what ``write_page_buffers`` does), the pages split
   over 2 threads, and one contiguous 94 MB ``torch`` copy with 1 and 2 threads; beside them
   the codec's xxh3-128 over the same payloads (1 and 2 threads). The floor of what a host
   restore adds to a device hit.
b. ``tcp``: raw loopback TCP between two processes: the sender ``sendall``s 94 MB from a
   preallocated buffer, the receiver ``recv_into``s a preallocated buffer; one connection,
   and two connections (two sender processes, two receiver threads) moving half each. The
   floor of any restore over one (or two) sockets on this machine.
c. ``redis``: a real redis-server (a throwaway one on loopback, as bench/tiers.py starts,
   unless ``--redis-url``) holding 128 values of ``--page-nbytes``: redis-py's MGET (the
   baseline), kvmesh's reader (``kvstore/redis_fast.py``), the fastest read this bench
   could write (the MGET's whole reply, whose length is known, ``recv_into`` one
   preallocated buffer, no parsing until the end), the same with 128 pipelined GETs, and
   the raw MGET split over 2 and 4 connections read by as many threads. Redis runs one
   thread; with 2 cores, server and client share them.

``implied_*`` rows: the restore TTFT these floors allow, ``device_hit_s`` plus the floor, as
a ratio to ``device_hit_s`` (a device hit measured by bench/tiers.py on a quiet run; pass
this machine's with ``--device-hit-s``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import redis
import torch
import xxhash
from machine import machine_info

from kvmesh.cluster.calibrate import redis_url_for
from kvmesh.kvstore.redis_fast import SlabPool, read_mget_reply

HEADER = 180  # bytes before the payload in a stored object (length prefix + msgpack header)


def timed(fn, trials: int) -> dict:
    """Best and median wall seconds of ``fn()`` over ``trials`` (one warm-up first), and the
    median process CPU seconds per call (all threads)."""
    fn()
    wall, cpu = [], []
    for _ in range(trials):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "best_s": min(wall),
        "median_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
    }


def with_gbps(row: dict, nbytes: int) -> dict:
    row["best_gbps"] = nbytes / row["best_s"] / 1e9
    return row


# ------------------------------------------------------------------------- (a) memcpy


def bench_memcpy(n: int, page: int, trials: int) -> dict:
    objs = [os.urandom(HEADER) + os.urandom(page) for _ in range(n)]
    payloads = [memoryview(o)[HEADER:] for o in objs]
    pool_t = torch.zeros((n + 1, page), dtype=torch.uint8)  # touched: no page faults
    pool = pool_t.numpy()
    ids = list(range(1, n + 1))
    total = n * page

    def copy_pages(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            pool[ids[i]] = np.frombuffer(payloads[i], dtype=np.uint8)

    two = ThreadPoolExecutor(2)

    def copy_pages_2() -> None:
        half = n // 2
        list(two.map(lambda r: copy_pages(*r), [(0, half), (half, n)]))

    src_t = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).reshape(n, page)
    dst_t = pool_t[1:]

    def torch_copy(threads: int):
        def run() -> None:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                dst_t.copy_(src_t)
            finally:
                torch.set_num_threads(before)

        return run

    def hash_pages(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            xxhash.xxh3_128_digest(payloads[i])

    def hash_pages_2() -> None:
        half = n // 2
        list(two.map(lambda r: hash_pages(*r), [(0, half), (half, n)]))

    def hash_then_copy(lo: int, hi: int) -> None:  # one page checked then copied, in cache
        for i in range(lo, hi):
            xxhash.xxh3_128_digest(payloads[i])
            pool[ids[i]] = np.frombuffer(payloads[i], dtype=np.uint8)

    def hash_then_copy_2() -> None:
        half = n // 2
        list(two.map(lambda r: hash_then_copy(*r), [(0, half), (half, n)]))

    out = {
        "numpy_per_page_1_thread": timed(lambda: copy_pages(0, n), trials),
        "numpy_per_page_2_threads": timed(copy_pages_2, trials),
        "torch_contiguous_1_thread": timed(torch_copy(1), trials),
        "torch_contiguous_2_threads": timed(torch_copy(2), trials),
        "xxh3_1_thread": timed(lambda: hash_pages(0, n), trials),
        "xxh3_2_threads": timed(hash_pages_2, trials),
        "xxh3_then_copy_per_page_1_thread": timed(lambda: hash_then_copy(0, n), trials),
        "xxh3_then_copy_per_page_2_threads": timed(hash_then_copy_2, trials),
    }
    two.shutdown()
    return {k: with_gbps(v, total) for k, v in out.items()}


# ------------------------------------------------------------------------- (b) raw TCP


def _sender(srv: socket.socket, nbytes: int) -> None:
    """Accept one connection on ``srv``; for every request byte, send ``nbytes`` from one
    buffer."""
    data = memoryview(bytearray(nbytes))
    data[: min(nbytes, 1 << 20)] = os.urandom(min(nbytes, 1 << 20))
    with srv:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(1):
                conn.sendall(data)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the sender closed the connection")
        got += k


def _tcp_case(total: int, conns: int, trials: int) -> dict:
    """``total`` bytes over ``conns`` loopback connections, one sender process each."""
    # fork: the child inherits the listening socket, so the parent can connect at once
    ctx = mp.get_context("fork")
    part = total // conns
    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(conns)]
    procs = [ctx.Process(target=_sender, args=(s, part), daemon=True) for s in servers]
    for p in procs:
        p.start()
    socks = []
    for srv in servers:
        socks.append(socket.create_connection(srv.getsockname()))
        socks[-1].settimeout(60)
        srv.close()
    bufs = [memoryview(bytearray(part)) for _ in range(conns)]
    pool = ThreadPoolExecutor(conns)

    def one(k: int) -> None:
        socks[k].sendall(b"x")
        _recv_exact(socks[k], bufs[k])

    def run() -> None:
        if conns == 1:
            one(0)
        else:
            list(pool.map(one, range(conns)))

    try:
        return with_gbps(timed(run, trials), part * conns)
    finally:
        pool.shutdown()
        for s in socks:
            s.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def bench_tcp(total: int, trials: int) -> dict:
    return {
        "1_connection": _tcp_case(total, 1, trials),
        "2_connections": _tcp_case(total, 2, trials),
    }


# ------------------------------------------------------------------------- (c) Redis


def _resp_command(*args: bytes) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


def _connect(url: str) -> socket.socket:
    c = redis.Redis.from_url(url).connection_pool.connection_kwargs
    s = socket.create_connection((c.get("host", "127.0.0.1"), c.get("port", 6379)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if c.get("db"):
        s.sendall(_resp_command(b"SELECT", str(c["db"]).encode()))
        if s.recv(64) != b"+OK\r\n":
            raise ConnectionError("SELECT failed")
    return s


def bench_redis(url: str, n: int, page: int, trials: int) -> dict:
    client = redis.Redis.from_url(url)
    prefix = f"kvmesh-roof:{os.urandom(6).hex()}:"
    keys = [f"{prefix}{i}".encode() for i in range(n)]
    values = [os.urandom(page) for _ in range(n)]
    pipe = client.pipeline(transaction=False)
    for k, v in zip(keys, values):
        pipe.set(k, v)
    pipe.execute()
    value_reply = len(b"$%d\r\n" % page) + page + 2
    total = n * page
    out = {}
    try:
        got = client.mget(keys)
        if got != values:
            raise RuntimeError("redis returned other bytes than were stored")
        out["redis_py_mget"] = timed(lambda: client.mget(keys), trials)

        slabs = SlabPool()
        sock1 = _connect(url)

        def kvmesh_reader() -> None:
            sock1.sendall(_resp_command(b"MGET", *keys))
            vals = read_mget_reply(sock1, n, slabs)
            del vals

        out["kvmesh_reader_mget"] = timed(kvmesh_reader, trials)

        def kvmesh_reader_batches(batch: int):
            def run() -> None:  # one MGET after the other, as a batched restore reads
                for at in range(0, n, batch):
                    part = keys[at : at + batch]
                    sock1.sendall(_resp_command(b"MGET", *part))
                    vals = read_mget_reply(sock1, len(part), slabs)
                    del vals

            return run

        for batch in (22, 8):
            out[f"kvmesh_reader_mget_of_{batch}_in_turn"] = timed(
                kvmesh_reader_batches(batch), trials
            )
        sock1.close()

        def raw_reader(conns: int, pipelined_gets: bool = False, batch: int = 0):
            """``conns`` connections, each asking for its share of the keys as one MGET,
            as pipelined GETs, or as pipelined MGETs of ``batch`` keys each."""
            socks = [_connect(url) for _ in range(conns)]
            per = [keys[k * n // conns : (k + 1) * n // conns] for k in range(conns)]
            bufs = []
            cmds = []
            for part in per:
                if pipelined_gets:
                    cmds.append(b"".join(_resp_command(b"GET", k) for k in part))
                    nbytes = len(part) * value_reply
                else:
                    step = batch or len(part)
                    groups = [part[at : at + step] for at in range(0, len(part), step)]
                    cmds.append(b"".join(_resp_command(b"MGET", *g) for g in groups))
                    nbytes = sum(len(b"*%d\r\n" % len(g)) + len(g) * value_reply for g in groups)
                bufs.append(memoryview(bytearray(nbytes)))
            pool = ThreadPoolExecutor(conns) if conns > 1 else None

            def one(k: int) -> None:
                socks[k].sendall(cmds[k])
                _recv_exact(socks[k], bufs[k])

            def run() -> None:
                if pool is None:
                    one(0)
                else:
                    list(pool.map(one, range(conns)))

            def close() -> None:
                if pool is not None:
                    pool.shutdown()
                for s in socks:
                    s.close()

            return run, bufs, close

        for name, conns, gets, batch in (
            ("raw_mget_1_connection", 1, False, 0),
            ("raw_pipelined_get_1_connection", 1, True, 0),
            ("raw_pipelined_mget_of_32_1_connection", 1, False, 32),
            ("raw_pipelined_mget_of_16_1_connection", 1, False, 16),
            ("raw_pipelined_mget_of_8_1_connection", 1, False, 8),
            ("raw_pipelined_mget_of_4_1_connection", 1, False, 4),
            ("raw_mget_2_connections", 2, False, 0),
            ("raw_pipelined_mget_of_16_2_connections", 2, False, 16),
            ("raw_mget_4_connections", 4, False, 0),
        ):
            run, bufs, close = raw_reader(conns, gets, batch)
            try:
                run()
                # the reply is what was stored: the value bytes sit at fixed offsets
                head = 0 if gets else len(b"*%d\r\n" % (batch or n // conns))
                first = bytes(bufs[0][head + value_reply - page - 2 : head + value_reply - 2])
                if first != values[0]:
                    raise RuntimeError(f"{name}: the reply is not the stored value")
                out[name] = timed(run, trials)
            finally:
                close()
    finally:
        client.delete(*keys)
        client.close()
    return {k: with_gbps(v, total) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-nbytes", type=int, default=737_280)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument(
        "--device-hit-s",
        type=float,
        default=0.051,
        help="the device-hit TTFT the floors are compared with (bench/tiers.py, quiet run)",
    )
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--skip", default="", help="comma list of: memcpy, tcp, redis")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    n, page, trials = args.pages, args.page_nbytes, args.trials
    out: dict = {"pages": n, "page_nbytes": page, "bytes": n * page, "trials": trials}
    out["loadavg_1m_start"] = os.getloadavg()[0]
    if "memcpy" not in skip:
        out["memcpy"] = bench_memcpy(n, page, trials)
    if "tcp" not in skip:
        out["tcp"] = bench_tcp(n * page, trials)
    if "redis" not in skip:
        with redis_url_for(args.redis_url, lambda m: None) as url:
            out["redis"] = bench_redis(url, n, page, trials)
    dev = args.device_hit_s
    implied: dict = {"device_hit_s": dev}
    if "memcpy" in out:
        m = out["memcpy"]
        copy = min(m["numpy_per_page_1_thread"]["best_s"], m["numpy_per_page_2_threads"]["best_s"])
        checked = min(
            m["xxh3_then_copy_per_page_1_thread"]["best_s"],
            m["xxh3_then_copy_per_page_2_threads"]["best_s"],
        )
        implied["host_copy_only"] = (dev + copy) / dev
        implied["host_checked_copy"] = (dev + checked) / dev
    if "tcp" in out:
        implied["tcp_1_connection"] = (dev + out["tcp"]["1_connection"]["best_s"]) / dev
        implied["tcp_2_connections"] = (dev + out["tcp"]["2_connections"]["best_s"]) / dev
    if "redis" in out:
        r = out["redis"]
        for k in ("raw_mget_1_connection", "raw_mget_2_connections", "kvmesh_reader_mget"):
            implied[f"redis_{k}"] = (dev + r[k]["best_s"]) / dev
    out["implied_restore_over_device_hit"] = implied
    out["loadavg_1m_end"] = os.getloadavg()[0]
    out["machine"] = machine_info()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    threading.current_thread().name = "restore-roof"
    main()
