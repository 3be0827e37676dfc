"""The client SDK against a real worker server on loopback, with the real SmolLM2 model:
outputs equal to the offline LLM, streaming, cancellation and deadlines that free pages, the
status codes, health, reflection, retries and graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import TEST_IDENTITY as ID
from helpers import free_port, wait_until

from kvmesh.cluster import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    KvmeshError,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.protos.kvmesh.v1 import inference_pb2, inference_pb2_grpc
from kvmesh.worker import LLM, LLMEngine, SamplingParams
from kvmesh.worker.server import WorkerServer

# max_num_seqs=2 and max_waiting=2 make a full queue cheap to reach (tests send at most two
# requests at once otherwise); neither changes what a single request computes
ENGINE_ARGS = dict(
    kv_cache_memory="256MiB", max_num_batched_tokens=64, max_num_seqs=2, max_waiting=2
)
MODEL = "smollm2-135m-instruct"
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)
LONG = dict(temperature=0, max_tokens=500, ignore_eos=True)  # outlives any test


@pytest.fixture(scope="module")
def server(smol_src):
    srv = WorkerServer(LLMEngine(MODEL, **ENGINE_ARGS), grace_s=5.0, identity=ID)
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120, identity=ID) as c:  # a member: GetLoad too
        yield c


@pytest.fixture(scope="module")
def offline(smol_src):
    return LLM(MODEL, **ENGINE_ARGS)


def pages_back(client: Client, free: int) -> bool:
    load = client.get_load()
    return load.num_free_pages == free and load.num_requests_running == 0


def test_health_model_info_and_reflection(server, client):
    assert client.health() == "SERVING"
    assert client.health("kvmesh.v1.Inference") == "SERVING"
    assert client.health("kvmesh.v1.KVTransfer") == "SERVING"
    with pytest.raises(KvmeshError) as e:
        client.health("no.such.Service")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    info = client.model_info()
    eng = server.engine.engine
    assert info.fingerprint == eng.model_fp and info.block_size == 16
    assert info.vocab_size == 49152 and info.max_model_len == eng.max_model_len
    assert info.kv_cache_dtype == "fp32" and info.worker_id == server.worker_id
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.address) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"kvmesh.v1.Inference", "kvmesh.v1.KVTransfer", "grpc.health.v1.Health"} <= services


def test_greedy_output_equals_offline_llm(client, offline):
    prompts = ["Once upon a time", "The capital of France is", [504, 3458, 282, 4194, 314]]
    for prompt in prompts:
        want = offline.generate(prompt, SamplingParams(**GREEDY))[0]
        got = client.generate_text(prompt, **GREEDY)
        assert got.token_ids == want.token_ids, prompt
        assert got.text == want.text and got.finish_reason == "length" == want.finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == 16
        assert got.usage.cached_tokens_by_tier.get("device", 0) == got.usage.cached_tokens
        assert got.worker_id == client.model_info().worker_id


def test_streaming_yields_chunks_as_tokens_are_made(client, offline):
    chunks = list(client.generate("Write a haiku about rain.", logprobs=True, **GREEDY))
    assert len(chunks) == 16 and all(len(c.token_ids) == 1 for c in chunks)
    assert [c.finished for c in chunks] == [False] * 15 + [True]
    assert chunks[0].usage is None and chunks[-1].usage.completion_tokens == 16
    assert all(len(c.logprobs) == 1 and c.logprobs[0] <= 0 for c in chunks)
    want = offline.generate("Write a haiku about rain.", SamplingParams(**GREEDY))[0]
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text


def test_stop_string_reaches_the_client(client):
    full = client.generate_text("The capital of France is", **GREEDY)
    word = full.text.split()[1]
    res = client.generate_text("The capital of France is", stop=word, **GREEDY)
    assert res.finish_reason == "stop" and res.stop_reason == word
    assert full.text.startswith(res.text) and word not in res.text


class _Aborts:
    """Records, on the engine thread, the final output of every request the engine aborts:
    what a client that left can no longer see."""

    def __init__(self, server) -> None:
        self.aeng = server.engine
        self.outputs: dict = {}

    def __enter__(self) -> _Aborts:
        def install(engine):
            orig = engine.abort_request

            def abort_request(request_id):
                out = orig(request_id)
                if out is not None:
                    self.outputs[request_id] = out
                return out

            engine.abort_request = abort_request

        self.aeng.call(install)
        return self

    def __exit__(self, *exc) -> None:
        self.aeng.call(lambda e: delattr(e, "abort_request"))


def test_cancel_mid_stream_aborts_the_request_and_frees_the_pages(server, client):
    free = client.get_load().num_free_pages
    with _Aborts(server) as aborts:
        stream = client.generate("Tell me a very long story.", request_id="leave-me", **LONG)
        got = [next(stream) for _ in range(3)]
        assert client.get_load().num_requests_running == 1
        stream.close()  # what a `break` out of the loop does
        assert wait_until(lambda: "leave-me" in aborts.outputs)
    assert len(got) == 3
    out = aborts.outputs["leave-me"]
    # aborted, not run to its end: at least the 3 tokens seen, far fewer than the 500 asked
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 500
    assert wait_until(lambda: pages_back(client, free))


def test_abort_by_request_id(client):
    free = client.get_load().num_free_pages
    chunks = []
    for c in client.generate("Count to a thousand:", request_id="abort-me", **LONG):
        chunks.append(c)
        if len(chunks) == 2:
            with pytest.raises(InvalidArgument, match="already in use"):
                client.generate_text("Hi", request_id="abort-me")
            assert client.abort("abort-me") is True
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"
    n = sum(len(c.token_ids) for c in chunks)
    assert 2 <= n < 500 and chunks[-1].usage.completion_tokens == n
    assert client.abort("abort-me") is False
    assert wait_until(lambda: pages_back(client, free))


def test_deadline_exceeded_is_an_sdk_error_and_aborts_the_request(server, client):
    free = client.get_load().num_free_pages
    with _Aborts(server) as aborts:
        with pytest.raises(DeadlineExceeded) as e:
            client.generate_text(
                "Tell me a long story.", request_id="too-slow", timeout=1.0, **LONG
            )
        assert wait_until(lambda: "too-slow" in aborts.outputs)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    out = aborts.outputs["too-slow"]
    assert out.finish_reason == "abort" and len(out.token_ids) < 500
    assert wait_until(lambda: pages_back(client, free))


@pytest.mark.parametrize(
    "prompt,kwargs,needle",
    [
        ("Hello", dict(temperature=-1), "temperature must be >= 0"),
        ("", dict(), "the prompt is empty"),
        ([10**9], dict(), "prompt token ids must be integers in [0, 49152)"),
        ("Hello", dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(client, prompt, kwargs, needle):
    with pytest.raises(InvalidArgument) as e:
        client.generate_text(prompt, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details
    assert client.generate_text("Hi", max_tokens=2).usage.completion_tokens == 2


def test_unknown_sampling_keyword_is_a_type_error(client):
    with pytest.raises(TypeError, match="temprature"):
        client.generate_text("Hi", temprature=0)


def test_async_client(server, client):
    want = client.generate_text("Once upon a time", **GREEDY)

    async def main():
        async with AsyncClient(server.address, timeout=120, identity=ID) as ac:
            assert await ac.health() == "SERVING"
            a, b = await asyncio.gather(
                ac.generate_text("Once upon a time", **GREEDY),
                ac.generate_text("The sky is", temperature=0, max_tokens=8),
            )
            chunks = [c async for c in ac.generate("Once upon a time", **GREEDY)]
            with pytest.raises(InvalidArgument, match="temperature"):
                await ac.generate_text("Hi", temperature=-1)
            load = await ac.get_load()
            info = await ac.model_info()
            assert await ac.abort("no-such-request") is False
            return a, b, chunks, load, info

    a, b, chunks, load, info = asyncio.run(main())
    assert a.token_ids == want.token_ids and a.text == want.text
    assert b.usage.completion_tokens == 8
    assert len(chunks) == 16 and [t for c in chunks for t in c.token_ids] == want.token_ids
    assert load.worker_id == info.worker_id


def test_full_queue_is_resource_exhausted(server, client):
    free = client.get_load().num_free_pages

    async def main():
        async with AsyncClient(server.address, timeout=120, identity=ID) as ac:
            tasks: list[asyncio.Task] = []

            async def run(started: asyncio.Event) -> None:
                async for _ in ac.generate("Tell me a long story.", **LONG):
                    started.set()

            try:
                # two running (max_num_seqs=2), one by one so neither meets a full queue
                for _ in range(2):
                    started = asyncio.Event()
                    tasks.append(asyncio.create_task(run(started)))
                    await asyncio.wait_for(started.wait(), 60)
                # then two waiting (max_waiting=2)
                tasks += [asyncio.create_task(run(asyncio.Event())) for _ in range(2)]
                for _ in range(200):
                    if (await ac.get_load()).num_requests_waiting == 2:
                        break
                    await asyncio.sleep(0.05)
                with pytest.raises(ResourceExhausted) as e:
                    await ac.generate_text("One too many", max_tokens=4)
                return e.value
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    err = asyncio.run(main())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details
    assert wait_until(lambda: pages_back(client, free))
    assert client.generate_text("Hi", max_tokens=2).finish_reason == "length"


def test_retries_unavailable_until_the_server_is_up(server):
    port = free_port()
    late = WorkerServer(server.engine, port=port)  # shares the engine: nothing to load
    fast_reconnect = [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 200),
    ]
    timer = threading.Timer(0.5, late.start_in_thread)
    timer.start()
    try:
        with Client(
            f"127.0.0.1:{port}",
            retries=8,
            backoff_s=0.1,
            backoff_max_s=0.5,
            channel_options=fast_reconnect,
            timeout=60,
        ) as c:
            res = c.generate_text("Hi", temperature=0, max_tokens=3)
        assert res.usage.completion_tokens == 3
    finally:
        timer.join()
        late.stop_in_thread(grace=0)
    # without retries, the same refusal is an Unavailable error
    with Client(f"127.0.0.1:{free_port()}", retries=0) as c:
        with pytest.raises(Unavailable):
            c.generate_text("Hi", max_tokens=3)


def test_graceful_shutdown_drains_then_refuses(server, client):
    """A second server over the same engine: in-flight streams finish within the grace
    period, health turns NOT_SERVING for watchers, new calls are refused."""
    drained = WorkerServer(server.engine, grace_s=30.0)
    drained.start_in_thread()
    free = client.get_load().num_free_pages
    with grpc.insecure_channel(drained.address) as ch, Client(drained.address, retries=0) as c:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stream = c.generate("Once upon a time", **GREEDY)
        chunks = [next(stream)]
        stopper = threading.Thread(target=drained.stop_in_thread)
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        chunks += list(stream)  # the in-flight stream runs to its end
        stopper.join(30)
        assert not stopper.is_alive()
        with pytest.raises(Unavailable):
            c.generate_text("Hi", max_tokens=2)
    assert len(chunks) == 16 and chunks[-1].finish_reason == "length"
    assert wait_until(lambda: pages_back(client, free))


def test_grace_period_end_aborts_in_flight_streams(server, client):
    short = WorkerServer(server.engine, grace_s=0.5)
    short.start_in_thread()
    free = client.get_load().num_free_pages
    got = []
    with Client(short.address, retries=3) as c:
        stream = c.generate("Tell me a long story.", **LONG)
        got.append(next(stream))
        stopper = threading.Thread(target=short.stop_in_thread)
        stopper.start()
        with pytest.raises(KvmeshError):
            for chunk in stream:
                got.append(chunk)
        stopper.join(30)
    assert 1 <= len(got) < 500 and not got[-1].finished
    assert wait_until(lambda: pages_back(client, free))


class FlakyInference(inference_pb2_grpc.InferenceServicer):
    """Fails with UNAVAILABLE: ``before`` times before any token, or after one token."""

    def __init__(self, before: int = 0, after: bool = False) -> None:
        self.before, self.after, self.calls = before, after, 0
        self.seen: list[tuple[dict, float | None]] = []  # (metadata, time remaining) per call

    def Generate(self, request, context):
        self.calls += 1
        self.seen.append((dict(context.invocation_metadata()), context.time_remaining()))
        if self.calls <= self.before:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        yield inference_pb2.GenerateResponse(request_id="r", token_ids=[1], text="a")
        if self.after:
            context.abort(grpc.StatusCode.UNAVAILABLE, "gone mid-stream")
        yield inference_pb2.GenerateResponse(
            request_id="r", token_ids=[2], text="b", finished=True, finish_reason="length"
        )


@pytest.fixture
def flaky():
    servicer = FlakyInference()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(0)


def test_retries_only_before_the_first_token(flaky):
    servicer, address = flaky
    servicer.before = 2
    with Client(address, retries=2, backoff_s=0.01) as c:
        res = c.generate_text("x")
    assert servicer.calls == 3 and res.text == "ab" and res.token_ids == [1, 2]

    servicer.calls, servicer.before = 0, 5
    with Client(address, retries=2, backoff_s=0.01) as c, pytest.raises(Unavailable):
        c.generate_text("x")
    assert servicer.calls == 3  # the first try and two retries

    servicer.calls, servicer.before, servicer.after = 0, 0, True
    got = []
    with Client(address, retries=5, backoff_s=0.01) as c, pytest.raises(Unavailable) as e:
        for chunk in c.generate("x"):
            got.append(chunk)
    assert servicer.calls == 1 and len(got) == 1 and "mid-stream" in e.value.details


def test_async_client_retries_the_same_way(flaky):
    servicer, address = flaky
    servicer.before = 1

    async def main():
        async with AsyncClient(address, retries=1, backoff_s=0.01) as ac:
            return await ac.generate_text("x")

    assert asyncio.run(main()).text == "ab" and servicer.calls == 2
    servicer.calls, servicer.before, servicer.after = 0, 0, True

    async def mid_stream():
        async with AsyncClient(address, retries=5, backoff_s=0.01) as ac:
            return await ac.generate_text("x")

    with pytest.raises(Unavailable):
        asyncio.run(mid_stream())
    assert servicer.calls == 1


def test_per_call_metadata_and_timeout_reach_the_server(flaky):
    servicer, address = flaky
    with Client(address, metadata=[("x-tenant", "a")], timeout=30) as c:
        c.generate_text("x", metadata=[("x-trace", "t1")], timeout=5)
    md, remaining = servicer.seen[0]
    assert md["x-tenant"] == "a" and md["x-trace"] == "t1"
    assert 0 < remaining <= 6  # the call's 5 s, not the client's 30 s (grpc rounds up)


def test_kvmesh_worker_cli_serves_and_drains_on_sigterm(smol_src):
    port = free_port()
    env = {**os.environ, "KVMESH_NUM_THREADS": "1"}
    args = f"worker --host 127.0.0.1 --port {port} --kv-cache-memory 64MiB --grace-period 60"
    cmd = [sys.executable, "-m", "kvmesh.cluster.cli", *args.split()]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with Client(f"127.0.0.1:{port}", retries=0, timeout=5) as c:

            def up() -> bool:
                try:
                    return c.health() == "SERVING"
                except Unavailable:
                    return proc.poll() is not None  # died: stop waiting

            assert wait_until(up, timeout=180, every=0.5) and proc.poll() is None
            stream = c.generate("Once upon a time", timeout=120, **GREEDY)
            chunks = [next(stream)]
            proc.send_signal(signal.SIGTERM)
            chunks += list(stream)  # the in-flight stream finishes within the grace
        assert len(chunks) == 16 and chunks[-1].finish_reason == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read().decode()
    assert "SIGTERM: draining" in log and "stopped" in log
