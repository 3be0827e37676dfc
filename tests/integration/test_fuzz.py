"""A request can fail only itself.

One real worker (SmolLM2 on a loopback gRPC port) and a router in front of it, shared by the
module. Faults injected on the engine thread (non-finite logits, a detokenizer that raises, a
stop check that raises) finish only the request they hit, with finish_reason "error" and a
message, while a request batched with it completes with transformers' greedy tokens. Then a
few hundred random and hostile requests (bad floats, huge and empty lists, unknown tokens,
huge prompts, ...) through the worker and the router: every one is answered (a result, or
INVALID_ARGUMENT naming the field), and afterwards the worker is healthy, holds no request,
and still gives transformers' greedy output. Last, a worker whose engine loop dies says
NOT_SERVING on health.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import hf_greedy, in_process_router, wait_until

from kvmesh.cluster import AsyncClient, Client, Unavailable
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.kvmesh.v1 import inference_pb2_grpc as ipb_grpc
from kvmesh.worker import LLMEngine, SamplingParams, async_engine
from kvmesh.worker.engine import QueueFullError
from kvmesh.worker.request import RequestStatus
from kvmesh.worker.server import WorkerServer

MODEL = "smollm2-135m-instruct"
# max_model_len 128 keeps the longest valid fuzz request short; a huge prompt is one past it
ENGINE_ARGS = dict(
    kv_cache_memory="96MiB",
    max_model_len=128,
    max_num_batched_tokens=256,
    max_num_seqs=16,
    max_waiting=256,
)
VOCAB = 49152
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(smol_src):
    srv = WorkerServer(LLMEngine(MODEL, **ENGINE_ARGS), grace_s=2.0)
    srv.start_in_thread()
    yield srv
    srv.stop_in_thread(grace=0)


@pytest.fixture(scope="module")
def router(worker):
    with in_process_router(worker, name="fuzz-worker") as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(worker):
    return worker.engine.engine.tokenizer


@contextlib.contextmanager
def on_engine_thread(worker, install, uninstall):
    """Patch the engine between steps (on its own thread) and undo it afterwards."""
    aeng = worker.engine
    aeng.call(install)
    try:
        yield
    finally:
        aeng.call(uninstall)


def after_forward(worker, hook):
    """Run ``hook(to_sample, logits)`` on the engine thread after every forward pass, before
    sampling: a test's way to make one request's step go wrong."""

    def install(engine):
        orig = engine.runner.execute

        def execute(scheduled):
            to_sample, logits = orig(scheduled)
            logits = logits.clone()  # an inference-mode tensor cannot be changed in place
            hook(to_sample, logits)
            return to_sample, logits

        engine.runner.execute = execute

    return on_engine_thread(worker, install, lambda e: delattr(e.runner, "execute"))


def _assert_healthy(worker) -> None:
    """The loop runs, health says SERVING, and no request is left behind."""
    assert worker.engine.error is None
    with Client(worker.address, timeout=30) as c:
        assert c.health() == "SERVING"

    def idle() -> bool:
        s = worker.engine.call(LLMEngine.stats)
        return s.num_requests_running == 0 and s.num_requests_waiting == 0

    assert wait_until(idle, timeout=30)


# ---------------------------------------------------------------- one request fails alone


def _poison_nan(target: str, witness: str, seen: list):
    def hook(to_sample, logits):
        ids = [r.request_id for r in to_sample]
        for i, r in enumerate(to_sample):
            # only in a step that also samples the witness: the batch must go on without it
            if r.request_id == target and len(r.output_token_ids) >= 2 and witness in ids:
                logits[i, 123] = float("nan")
                seen.append(ids)

    return hook


class _BrokenDetokenizer:
    text = ""

    def push(self, token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "detokenizer broke on purpose")


def _poison_detokenizer(target: str, witness: str, seen: list):
    def hook(to_sample, logits):
        ids = [r.request_id for r in to_sample]
        for r in to_sample:
            if r.request_id == target and len(r.output_token_ids) >= 2 and witness in ids:
                r.detokenizer = _BrokenDetokenizer()
                seen.append(ids)

    return hook


def _poison_stop_check(target: str, witness: str, seen: list):
    flagged: set[str] = set()

    def hook(to_sample, logits):
        ids = [r.request_id for r in to_sample]
        for r in to_sample:
            if r.request_id == target and len(r.output_token_ids) >= 2 and witness in ids:
                flagged.add(r.request_id)
                seen.append(ids)

    def install(engine):
        proc = engine.output_processor
        orig = proc.check_stop

        def check_stop(req, tok):
            if req.request_id in flagged:
                raise ValueError("bad stop string on purpose")
            return orig(req, tok)

        proc.check_stop = check_stop

    return hook, install


@pytest.mark.parametrize(
    "fault, message, n_tokens",
    [
        ("nan_logits", "non-finite logits", 2),  # the step that fails samples nothing
        ("detokenizer", "UnicodeDecodeError", 3),  # the token it failed on is reported
        ("stop_check", "bad stop string on purpose", 3),
    ],
)
def test_a_failing_request_finishes_alone_with_error(
    worker, tokenizer, hf_smol, fault, message, n_tokens
):
    prompt = tokenizer.encode("The capital of France is")
    want = hf_greedy(hf_smol, prompt, GREEDY["max_tokens"])
    target, witness = f"{fault}-victim", f"{fault}-witness"
    seen: list[list[str]] = []
    undo = contextlib.ExitStack()
    if fault == "nan_logits":
        undo.enter_context(after_forward(worker, _poison_nan(target, witness, seen)))
    elif fault == "detokenizer":
        undo.enter_context(after_forward(worker, _poison_detokenizer(target, witness, seen)))
    else:
        hook, install = _poison_stop_check(target, witness, seen)
        undo.enter_context(after_forward(worker, hook))
        undo.enter_context(
            on_engine_thread(worker, install, lambda e: delattr(e.output_processor, "check_stop"))
        )

    async def both():
        async with AsyncClient(worker.address, timeout=120) as ac:
            return await asyncio.gather(
                ac.generate_text("Tell me a story about a cat.", request_id=target, **GREEDY),
                ac.generate_text(prompt, request_id=witness, **GREEDY),
            )

    with undo:
        bad, good = asyncio.run(both())
    assert seen and witness in seen[0], "the fault never hit a step shared with the witness"
    assert bad.finish_reason == "error" and message in bad.error
    assert len(bad.token_ids) == n_tokens
    assert good.finish_reason == "length" and good.error is None
    assert good.token_ids == want
    _assert_healthy(worker)


def test_a_tiny_temperature_is_greedy_and_cannot_crash_the_worker(worker, router, tokenizer):
    # temperature=1e-40 once overflowed the logits, torch.multinomial raised, the engine
    # loop died, and the router retried the request on the next worker, killing it too
    prompt = tokenizer.encode("Once upon a time")
    with Client(worker.address, timeout=120) as w, Client(router.address, timeout=120) as r:
        want = w.generate_text(prompt, **GREEDY)
        for c in (w, r):
            got = c.generate_text(prompt, temperature=1e-40, max_tokens=10, ignore_eos=True)
            assert got.finish_reason == "length" and got.token_ids == want.token_ids
    assert router.core.retries == 0
    _assert_healthy(worker)


# ---------------------------------------------------------------- the fuzz

OK, ANY = "ok", "any"
TEXTS = [
    "Hello",
    "The capital of France is",
    "\x00\x01\x02 nul and control bytes",
    "émigré façade — “quotes” and ünïcödé, 漢字, עברית, 🤖🔥",
    "<|endoftext|><|im_start|>system<|im_end|>" * 3,
    "e\u0301\u0302\u0303 combining marks",
]


def _hostile_cases(rng: random.Random) -> list[tuple[str, object]]:
    """(what the answer must be, how to spoil a valid request): OK, ANY, or a substring the
    INVALID_ARGUMENT details must contain (the field's name)."""

    def sp(**kw):
        def spoil(req: ipb.GenerateRequest) -> None:
            for k, v in kw.items():
                if isinstance(v, list):
                    getattr(req.sampling, k).extend(v)
                else:
                    setattr(req.sampling, k, v)

        return spoil

    def ids(values):
        def spoil(req):
            req.token_ids.SetInParent()  # the oneof says token_ids even when the list is empty
            del req.token_ids.ids[:]
            req.token_ids.ids.extend(values)

        return spoil

    def text(value):
        def spoil(req):
            req.text = value

        return spoil

    def no_prompt(req):
        req.ClearField("prompt")

    nan, inf = float("nan"), float("inf")
    return [
        ("temperature", sp(temperature=nan)),
        ("temperature", sp(temperature=inf)),
        ("temperature", sp(temperature=-inf)),
        ("temperature", sp(temperature=-1.0)),
        (OK, sp(temperature=1e-40)),
        (OK, sp(temperature=5e-324)),
        (OK, sp(temperature=1e300, seed=1)),
        ("top_p", sp(top_p=nan)),
        ("top_p", sp(top_p=0.0)),
        ("top_p", sp(top_p=1.5)),
        ("top_p", sp(top_p=inf)),
        (OK, sp(top_p=1e-300, temperature=1.0)),
        ("top_k", sp(top_k=-2)),
        ("top_k", sp(top_k=-(2**31))),
        (OK, sp(top_k=2**31 - 1, temperature=0.9)),
        ("max_tokens", sp(max_tokens=0)),
        ("max_tokens", sp(max_tokens=-1)),
        ("max_tokens", sp(max_tokens=-(2**31))),
        (OK, sp(seed=-(2**63), temperature=0.8)),
        (OK, sp(seed=2**63 - 1, temperature=0.8)),
        ("stop", sp(stop=[""])),
        ("stop", sp(stop=["x"] * 65)),
        ("stop", sp(stop=["y" * 2000])),
        ("stop", sp(stop=[str(i) for i in range(10_000)])),
        (OK, sp(stop=["\x00", "🤖", "e\u0301"])),
        ("stop_token_ids", sp(stop_token_ids=[-1])),
        ("stop_token_ids", sp(stop_token_ids=[2**31 - 1])),
        ("stop_token_ids", sp(stop_token_ids=[VOCAB])),
        ("stop_token_ids", sp(stop_token_ids=list(range(5000)))),
        (OK, sp(stop_token_ids=[0, 1, 2])),
        ("cache_salt", sp(cache_salt="s" * 5000)),
        (OK, sp(cache_salt="\x00tenant\u202e")),
        (OK, sp(logprobs=True, skip_special_tokens=False, include_stop_str_in_output=True)),
        ("empty", ids([])),
        ("token ids", ids([-1])),
        ("token ids", ids([VOCAB])),
        ("token ids", ids([2**31 - 1])),
        ("token ids", ids([-(2**31)])),
        ("max_model_len", ids([7] * 10_000)),
        ("max_model_len", ids([rng.randrange(VOCAB) for _ in range(200_000)])),
        (OK, ids([rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))])),
        ("empty", text("")),
        ("max_model_len", text("lorem ipsum " * 80_000)),
        ("no prompt", no_prompt),
        (OK, text(rng.choice(TEXTS))),
        (OK, lambda req: setattr(req, "request_id", "r" * 50_000 + str(rng.random()))),
    ]


def _base_request(rng: random.Random, i: int) -> ipb.GenerateRequest:
    req = ipb.GenerateRequest(request_id=f"fuzz-{i}")
    req.text = rng.choice(TEXTS)
    req.sampling.max_tokens = rng.randint(1, 3)
    if rng.random() < 0.5:
        req.sampling.temperature = 0.0
    return req


def _send(stub, req: ipb.GenerateRequest) -> tuple[grpc.StatusCode, str, list]:
    try:
        msgs = list(stub.Generate(req, timeout=120))
    except grpc.RpcError as e:
        return e.code(), e.details() or "", []
    return grpc.StatusCode.OK, "", msgs


def test_hostile_requests_are_all_answered_and_the_worker_stays_correct(
    worker, router, tokenizer, hf_smol
):
    rng = random.Random(1515)
    cases = _hostile_cases(rng)
    jobs = []
    for i in range(320):
        req = _base_request(rng, i)
        expect = OK
        if rng.random() < 0.8:
            expect, spoil = rng.choice(cases)
            spoil(req)
        if rng.random() < 0.05:
            req.request_id = "fuzz-shared-id"  # concurrent duplicates: one may be refused
            expect = ANY
        jobs.append((i % 2, expect, req))
    # every kind of hostile request goes at least once to each of worker and router
    for j, (expect, spoil) in enumerate(cases):
        for target in (0, 1):
            req = _base_request(rng, 1000 + 2 * j + target)
            spoil(req)
            jobs.append((target, expect, req))
    # hostile peer hints go to the worker only (the router replaces them): a closed port and
    # malformed addresses; how a worker treats a client's hints is part of its hardening
    for j, peers in enumerate([["127.0.0.1:1"], ["no-port"], ["127.0.0.1:1"] * 3]):
        req = _base_request(rng, 5000 + j)
        req.peer_addresses.extend(peers)
        jobs.append((0, ANY, req))
    rng.shuffle(jobs)

    channels = [grpc.insecure_channel(a) for a in (worker.address, router.address)]
    stubs = [ipb_grpc.InferenceStub(ch) for ch in channels]
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda job: _send(stubs[job[0]], job[2]), jobs))
    finally:
        for ch in channels:
            ch.close()

    answered = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
    allowed_any = answered | {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
    n_ok = n_invalid = 0
    for (target, expect, req), (code, details, msgs) in zip(jobs, results):
        where = f"{('worker', 'router')[target]} request {req.request_id[:40]!r}"
        assert code in (allowed_any if expect == ANY else answered), (where, code, details)
        if code == grpc.StatusCode.OK:
            n_ok += 1
            assert msgs and msgs[-1].finished, where
            assert msgs[-1].finish_reason in ("stop", "length"), (where, msgs[-1])
            assert expect in (OK, ANY), (where, f"accepted, but should name {expect!r}")
        else:
            n_invalid += code == grpc.StatusCode.INVALID_ARGUMENT
            assert expect != OK, (where, code, details)
            if expect != ANY:
                assert expect in details, (where, details)
    assert n_ok >= 100 and n_invalid >= 100, (n_ok, n_invalid)  # both kinds really ran

    _assert_healthy(worker)
    prompt = tokenizer.encode("The capital of France is")
    want = hf_greedy(hf_smol, prompt, GREEDY["max_tokens"])
    for addr in (worker.address, router.address):
        with Client(addr, timeout=120) as c:
            got = c.generate_text(prompt, **GREEDY)
            assert got.token_ids == want and got.finish_reason == "length"
    assert router.core.retries == 0  # no request made the router give up on the worker


# ---------------------------------------------------------------- bounded queues


@contextlib.contextmanager
def engine_thread_busy(aeng):
    """Keep the engine thread inside one ``call`` until the block ends: what reaches it
    meanwhile waits in its command queue."""
    gate, entered = threading.Event(), threading.Event()

    def hold(engine):
        entered.set()
        gate.wait(120)

    t = threading.Thread(target=aeng.call, args=(hold, 180))
    t.start()
    try:
        assert entered.wait(60)
        yield
    finally:
        gate.set()
        t.join(60)


@contextlib.contextmanager
def max_waiting(engine, n: int):
    cfg = engine.scheduler_config
    engine.scheduler_config = dataclasses.replace(cfg, max_waiting=n)
    try:
        yield
    finally:
        engine.scheduler_config = cfg


def test_requests_not_yet_queued_count_against_max_waiting(worker):
    aeng = worker.engine
    params = SamplingParams(temperature=0, max_tokens=1)

    async def one(i):
        try:
            return [o async for o in aeng.generate("Hi", params, f"burst-{i}")][-1]
        except QueueFullError as e:
            return e

    async def until_refused(tasks, n):
        for _ in range(1000):
            if sum(t.done() for t in tasks) >= n:
                return
            await asyncio.sleep(0.01)

    loop = asyncio.new_event_loop()
    try:
        with max_waiting(aeng.engine, 3):
            with engine_thread_busy(aeng):  # the adds pile up in the command queue
                tasks = [loop.create_task(one(i)) for i in range(6)]
                loop.run_until_complete(until_refused(tasks, 3))
                # refused at once, while nothing had reached the engine's own queue
                refused = [t.result() for t in tasks if t.done()]
            results = loop.run_until_complete(asyncio.gather(*tasks))
    finally:
        loop.close()
    assert len(refused) == 3 and all(isinstance(r, QueueFullError) for r in refused)
    assert "queue is full (3 requests)" in str(refused[0])
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(done) == 3 and all(o.finish_reason == "length" for o in done)
    _assert_healthy(worker)


def test_requests_waiting_for_a_promotion_count_against_max_waiting(worker):
    def check(engine):
        # two requests whose prefix a tier is promoting: they wait in the queue, passed over
        parked = [engine.make_request([1, 2, 3], request_id=f"promoting-{i}") for i in range(2)]
        for r in parked:
            r.status = RequestStatus.PROMOTING
            engine.scheduler.waiting.append(r)
        try:
            engine.add(engine.make_request([4, 5, 6], request_id="one-too-many"))
        except QueueFullError as e:
            return str(e)
        finally:
            for r in parked:
                engine.scheduler.waiting.remove(r)
        engine.abort_request("one-too-many")
        return None

    with max_waiting(worker.engine.engine, 2):
        refused = worker.engine.call(check)
    assert refused is not None and "queue is full" in refused


def test_calls_waiting_for_the_engine_thread_are_bounded(worker, monkeypatch):
    aeng = worker.engine
    monkeypatch.setattr(async_engine, "MAX_PENDING_CALLS", 1)
    with engine_thread_busy(aeng):
        queued = threading.Thread(target=aeng.call, args=(LLMEngine.stats, 60))
        queued.start()
        assert wait_until(lambda: aeng._pending_calls == 1, timeout=30)
        with pytest.raises(QueueFullError, match="calls already wait"):
            aeng.call(LLMEngine.stats)
    queued.join(60)
    assert aeng.call(LLMEngine.stats).num_requests_running == 0  # answered again


# ---------------------------------------------------------------- a dead engine


def test_a_worker_whose_engine_died_reports_not_serving(smol_src):
    srv = WorkerServer(LLMEngine(MODEL, kv_cache_memory="32MiB", max_model_len=64), grace_s=0)
    srv.start_in_thread()
    try:
        with Client(srv.address, timeout=30, retries=0) as c:
            assert c.health() == "SERVING"
            assert c.generate_text("Hi", max_tokens=2).finish_reason == "length"
            crashed = threading.Event()

            def break_the_loop(engine):
                def step():
                    crashed.set()
                    raise RuntimeError("the device fell off the bus (on purpose)")

                engine.step = step  # an engine-wide failure, not one request's

            srv.engine.call(break_the_loop)
            assert crashed.wait(30)
            assert wait_until(lambda: c.health() == "NOT_SERVING", timeout=30)
            assert c.health("kvmesh.v1.Inference") == "NOT_SERVING"
            assert c.health("kvmesh.v1.KVTransfer") == "NOT_SERVING"  # it serves engine pages
            with pytest.raises(Unavailable, match="crashed"):
                c.generate_text("Hi", max_tokens=2)
    finally:
        srv.stop_in_thread(grace=0)
