"""The tests' Ray head (helpers.RayHead) starts whatever the test process's at-fork hooks do.

``ray.init(address="local")`` forked Ray's daemons from the test process with a
``preexec_fn``, which runs the process's ``os.register_at_fork`` hooks; filelock's, while
another thread is inside a lock operation, holds the fork up to 30 s and then ends the child
before it becomes the raylet ("a GCS but no raylet"; DEVELOPERS.md, "Ray in the tests").
Here a hook of our own ends every child forked with hooks while the test runs: the head
must start and run a task all the same."""

from __future__ import annotations

import os
import threading
import time
import uuid

from helpers import RayHead

_ARMED = threading.Event()  # copied into a forked child with the rest of its memory


def _end_child_if_armed() -> None:
    if _ARMED.is_set():
        os.write(2, b"test_ray_start: a child forked with at-fork hooks is ended\n")
        os._exit(70)


# once per process (hooks cannot be removed); it does nothing unless a test arms it
os.register_at_fork(after_in_child=_end_child_if_armed)


def test_a_ray_head_starts_though_every_child_forked_with_hooks_dies():
    import ray

    head = RayHead(num_cpus=1, object_store_memory=80 * 2**20)
    _ARMED.set()
    try:
        t0 = time.monotonic()
        address = head.start()
        ray.init(address=address, namespace=f"kvmesh-test-{uuid.uuid4().hex[:6]}")
        try:
            assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120) == 42
            took = time.monotonic() - t0
        finally:
            ray.shutdown()
        procs = head.processes()
        assert procs, "the head's processes are found by its temp dir"
    finally:
        _ARMED.clear()
        head.stop()
    assert not [p for p in procs if p.is_running()]  # everything this test started is gone
    print(f"head started and ran a task in {took:.1f}s")
