"""The tests' Ray head (helpers.RayHead) starts whatever other threads of the test process
do: Ray's daemons are not forked from this process, so filelock's at-fork hook (which holds
a fork up to 30 s while another thread is inside a lock operation, then ends the child
before it becomes the raylet) cannot stop them. DEVELOPERS.md, "Ray in the tests"."""

from __future__ import annotations

import threading
import time
import uuid

from helpers import RayHead


def test_a_ray_head_starts_while_another_thread_is_inside_a_filelock_operation():
    import ray
    from filelock._core._fork import fork_transition

    entered, release = threading.Event(), threading.Event()

    def hold() -> None:  # what a FileLock acquire or release does for its duration
        with fork_transition():
            entered.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert entered.wait(10)
    head = RayHead(num_cpus=1, object_store_memory=80 * 2**20)
    try:
        t0 = time.monotonic()
        address = head.start()
        ray.init(address=address, namespace=f"kvmesh-test-{uuid.uuid4().hex[:6]}")
        try:
            assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120) == 42
            took = time.monotonic() - t0
            assert release.is_set() is False  # the operation was open the whole time
        finally:
            ray.shutdown()
        assert head.processes(), "the head's processes are found by its temp dir"
    finally:
        release.set()
        head.stop()
    assert head.processes() == []  # everything this test started is gone
    print(f"head started and ran a task in {took:.1f}s beside an open filelock operation")
