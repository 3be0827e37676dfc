"""protos.serving, the runner under the worker's and the router's gRPC servers: a drain
waits for the calls in flight, runs once, and a second stop ends it sooner; a server thread
hands back its start's result or error, runs calls on its loop and ends on stop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.protos.serving import Drain, Lifecycle, ServerThread, aio_server


def test_a_call_that_moves_between_tasks_is_waited_for_and_then_forgotten():
    """An HTTP stream enters in its handler's task and leaves in the response's task: the
    drain waits for it until leave(handle), and nothing of it stays behind."""

    async def main() -> None:
        life, drain = Lifecycle(), Drain()
        release = asyncio.Event()

        async def handler() -> asyncio.Future:
            return life.enter()  # the handler's task ends here; the call goes on

        handle = await asyncio.ensure_future(handler())

        async def body() -> None:
            await release.wait()
            life.leave(handle)

        streaming = asyncio.ensure_future(body())
        life.draining = True
        waiting = asyncio.ensure_future(drain.stop(3600, lambda: drain.wait_for(life.inflight)))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the handler's task is done, the call is not
        release.set()
        await asyncio.gather(streaming, waiting)
        assert life.inflight == set() and not life._by_task and not life._task_of

    asyncio.run(main())


def test_a_drain_waits_for_the_calls_in_flight():
    async def main() -> list[bool]:
        life, drain = Lifecycle(), Drain()
        release = asyncio.Event()
        seen: list[bool] = []

        async def call() -> None:
            life.enter()
            try:
                await release.wait()
            finally:
                life.leave()

        task = asyncio.ensure_future(call())
        await asyncio.sleep(0)  # the call has entered
        assert len(life.inflight) == 1

        async def drain_and_stop() -> None:
            life.draining = True
            await drain.wait_for(life.inflight)
            seen.append(task.done())

        stopping = asyncio.ensure_future(drain.stop(3600, drain_and_stop))
        while not life.draining:  # the drain has begun
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        assert not stopping.done()  # the call is still in flight
        release.set()
        await stopping
        assert life.inflight == set()
        return seen

    assert asyncio.run(main()) == [True]


def test_a_second_stop_ends_the_drain_sooner_and_the_drain_runs_once():
    async def main() -> tuple[int, bool]:
        drain = Drain()
        forever = asyncio.ensure_future(asyncio.Event().wait())
        runs = 0

        async def drain_and_stop() -> None:
            nonlocal runs
            runs += 1
            await drain.wait_for([forever])

        first = asyncio.ensure_future(drain.stop(3600, drain_and_stop))
        while not runs:  # the drain has begun
            await asyncio.sleep(0)
        await drain.stop(0, drain_and_stop)  # the second SIGTERM
        await first
        stuck = not forever.done()
        forever.cancel()
        return runs, stuck

    assert asyncio.run(main()) == (1, True)


def test_a_drain_waits_while_the_server_is_busy_outside_its_calls():
    async def main() -> int:
        drain, polls = Drain(), 0

        def busy() -> bool:
            nonlocal polls
            polls += 1
            return polls < 3  # e.g. data-plane requests being answered

        await drain.stop(3600, lambda: drain.wait_for([], busy=busy))
        return polls

    assert asyncio.run(main()) == 3


def test_a_server_thread_runs_start_calls_and_stop_on_its_own_loop():
    thread = ServerThread("kvmesh-test-loop")
    stopped = threading.Event()
    done: asyncio.Event | None = None

    async def start() -> int:
        nonlocal done
        done = asyncio.Event()
        return 4242

    async def serve() -> None:
        await done.wait()

    async def stop() -> None:
        stopped.set()
        done.set()

    assert thread.start(start, serve) == 4242
    assert thread.alive
    assert thread.call(lambda: threading.current_thread().name) == "kvmesh-test-loop"
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    thread.stop(stop, timeout=30)
    assert stopped.is_set() and not thread.alive
    thread.stop(stop, timeout=30)  # not running: nothing to do


def test_a_server_thread_raises_what_its_start_raised():
    async def start() -> int:
        raise OSError("cannot bind 127.0.0.1:1")

    thread = ServerThread("kvmesh-test-loop")
    with pytest.raises(OSError, match="cannot bind"):
        thread.start(start, asyncio.sleep)
    assert not thread.alive


def test_a_message_limit_below_one_mib_is_refused():
    with pytest.raises(ValueError, match="max_message_mb must be >= 1, got 0"):
        aio_server(0)
