"""``kvmesh serve`` end to end: a real local Ray cluster (one per module), a router actor and
two worker actors with the real SmolLM2 model, real gRPC, the client SDK.

SDK -> router -> worker parity with the offline LLM, prefix affinity (same worker, cached
tokens), affinity against round robin on a multi-tenant workload, bad input, a router restart
(workers re-register with their cached pages), and a worker killed mid-run.
"""

from __future__ import annotations

import threading

import pytest
from helpers import local_cluster, restart_router, wait_until

try:
    import ray
except ImportError:  # never skip: a missing Ray is a broken set-up
    pytest.fail("ray is not installed: run `make setup` (or `pip install ray`)", pytrace=False)

from kvmesh.cluster import Client, InvalidArgument, Unavailable
from kvmesh.worker import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
# 136 pages of 16 tokens per worker: room for a 1,024-token prompt, and small enough to
# allocate fast; 512-token steps keep the engine thread answering between steps
ENGINE_ARGS = dict(kv_cache_memory="96MiB", max_num_batched_tokens=512, max_num_seqs=8)
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)
SHORT = dict(temperature=0, max_tokens=2, ignore_eos=True)
_NO_STOP = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(smol_src):
    with local_cluster(ENGINE_ARGS, MODEL) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.endpoint, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(smol_src):
    return LLM(MODEL, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def texts(offline, shakespeare):
    """Token-id runs cut from different parts of the text: tok(i, n) is n tokens."""

    def tok(i: int, n: int) -> list[int]:
        ids = offline.tokenizer.encode(shakespeare[i * 20000 : i * 20000 + n * 8])[:n]
        assert len(ids) == n
        return ids

    return tok


def test_greedy_output_equals_offline_llm(cluster, client, offline):
    prompts = ["Once upon a time", "The capital of France is", [504, 3458, 282, 4194, 314]]
    for prompt in prompts:
        want = offline.generate(prompt, SamplingParams(**GREEDY))[0]
        got = client.generate_text(prompt, **GREEDY)
        assert got.token_ids == want.token_ids, prompt
        assert got.text == want.text and got.finish_reason == "length"
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == 16
        assert got.worker_id in cluster.stats()["workers"]
    assert client.health() == "SERVING"
    assert client.model_info().fingerprint == offline.engine.model_fp


def test_shared_prefix_lands_on_the_same_worker(client, texts):
    prefix = texts(1, 1024)
    a = client.generate_text(prefix + texts(2, 16), **SHORT)
    b = client.generate_text(prefix + texts(3, 16), **SHORT)
    assert a.worker_id == b.worker_id
    assert b.usage.cached_tokens >= 1008
    assert b.usage.cached_tokens_by_tier["device"] == b.usage.cached_tokens


def _run_tenants(client: Client, tenants: list[list[int]], users: list[list[int]]):
    """Every user of every tenant, one after the other, tenant by tenant: round robin over
    two workers then sends each tenant to both."""
    prompt = cached = 0
    workers: dict[int, set[str]] = {}
    for t, sys_ids in enumerate(tenants):
        for u in users:
            r = client.generate_text(sys_ids + u, **SHORT)
            prompt += r.usage.prompt_tokens
            # the worker's own cache: pages pulled from the other worker are not free
            cached += r.usage.cached_tokens_by_tier.get("device", 0)
            workers.setdefault(t, set()).add(r.worker_id)
    return cached / prompt, workers


def test_prefix_affinity_caches_more_than_round_robin(cluster, client, texts):
    # 4 system prompts of 12 full pages, 6 users each with their own question
    tenants = [texts(10 + t, 192) for t in range(4)]
    users = [texts(20 + u, 10) for u in range(6)]
    try:
        cluster.reset_prefix_caches()
        cluster.set_policy("round_robin")
        rr, rr_workers = _run_tenants(client, tenants, users)
        cluster.reset_prefix_caches()
        cluster.set_policy("prefix_affinity")
        pa, pa_workers = _run_tenants(client, tenants, users)
    finally:
        cluster.set_policy("prefix_affinity")
    assert all(len(w) == 2 for w in rr_workers.values())  # each tenant computed twice
    assert all(len(w) == 1 for w in pa_workers.values())  # each tenant stays put
    assert pa > rr, (pa, rr)


def test_the_router_points_a_worker_at_the_peer_holding_the_prefix(cluster, client, texts):
    prefix = texts(30, 1024)
    try:
        cluster.reset_prefix_caches()
        cluster.set_policy("round_robin")  # the second request goes to the other worker
        a = client.generate_text(prefix + texts(31, 16), **SHORT)
        b = client.generate_text(prefix + texts(32, 16), **SHORT)
    finally:
        cluster.set_policy("prefix_affinity")
    assert a.worker_id != b.worker_id
    assert b.usage.cached_tokens_by_tier.get("peer", 0) >= 1008  # pulled over KVTransfer
    assert b.usage.cached_tokens == 1024


def test_bad_input_is_invalid_argument_and_the_cluster_keeps_serving(cluster, client):
    with pytest.raises(InvalidArgument, match="temperature"):
        client.generate_text("hello", temperature=-1.0, max_tokens=4)
    with pytest.raises(InvalidArgument, match="token ids"):
        client.generate_text([1, 49152 * 10], max_tokens=4)
    with pytest.raises(InvalidArgument, match="token ids"):
        client.generate_text([5, -3], max_tokens=4)
    with pytest.raises(InvalidArgument, match="empty"):
        client.generate_text("", max_tokens=4)
    r = client.generate_text("The capital of France is", **GREEDY)
    assert r.usage.completion_tokens == 16
    assert len(cluster.stats()["workers"]) == 2  # bad input never drops a worker


def test_a_restarted_router_gets_the_workers_and_their_caches_back(cluster, client, texts):
    prefix = texts(5, 512)
    first = client.generate_text(prefix + texts(6, 16), **SHORT)
    assert restart_router(cluster)  # a crash: Ray restarts the actor
    # each worker notices the new router on its next report and registers with a snapshot
    st = wait_until(
        lambda: (
            (s := cluster.stats())["workers"].keys() >= {first.worker_id}
            and len(s["workers"]) == 2
            and s
        ),
        timeout=30,
    )
    assert st, "the workers did not register with the restarted router"
    assert st["workers"][first.worker_id]["index_pages"]["device"] >= 32
    again = client.generate_text(prefix + texts(7, 16), **SHORT)
    assert again.worker_id == first.worker_id
    assert again.usage.cached_tokens >= 512


def test_a_client_that_leaves_aborts_its_request_on_the_worker(cluster, client):
    # defined here, not at module level: Ray pickles it by value for the worker actors
    def _record_aborts(self) -> None:
        """On a worker actor: keep the final output of every request its engine aborts."""

        def install(engine):
            orig = engine.abort_request
            self.aborted = {}

            def abort_request(request_id):
                out = orig(request_id)
                if out is not None:
                    self.aborted[request_id] = (out.finish_reason, len(out.token_ids))
                return out

            engine.abort_request = abort_request

        self.aeng.call(install)

    ray.get([w.__ray_call__.remote(_record_aborts) for w in cluster.workers])
    stream = client.generate(
        "Tell me a very long story.",
        request_id="leave-cluster",
        temperature=0,
        max_tokens=400,
        ignore_eos=True,
    )
    assert [len(next(stream).token_ids) for _ in range(3)] == [1, 1, 1]
    stream.close()  # cancels the call: the router cancels its call to the worker

    def aborted():
        seen = ray.get([w.__ray_call__.remote(lambda self: self.aborted) for w in cluster.workers])
        return next((a["leave-cluster"] for a in seen if "leave-cluster" in a), None)

    # the worker's engine finished it as an abort, not by running out its 400 tokens
    got = wait_until(aborted, timeout=15)
    assert got is not None, "the worker never aborted the request"
    reason, n_tokens = got
    assert reason == "abort" and 3 <= n_tokens < 400
    assert wait_until(
        lambda: all(
            w["load"]["running"] == 0 and w["load"]["waiting"] == 0
            for w in cluster.stats()["workers"].values()
        ),
        timeout=15,
    )


def test_abort_through_the_router_ends_the_stream_with_abort(cluster, client):
    chunks = []
    for c in client.generate(
        "Count to a thousand:", request_id="abort-via-router", max_tokens=400, **_NO_STOP
    ):
        chunks.append(c)
        if len(chunks) == 3:
            assert client.abort("abort-via-router") is True  # the router asks its worker
    last = chunks[-1]
    assert last.finished and last.finish_reason == "abort"
    n = sum(len(c.token_ids) for c in chunks)
    assert 3 <= n < 400 and last.usage.completion_tokens == n
    assert client.abort("abort-via-router") is False  # gone from the router and the worker


def test_a_restarted_worker_rejoins_with_an_empty_index(cluster, client):
    before = ray.get(cluster.workers[1].ready.remote())
    client.generate_text(list(range(1000, 1100)), **SHORT)  # something cached somewhere
    ray.kill(cluster.workers[1], no_restart=False)  # a crash: Ray restarts the actor

    def rejoined():
        ws = cluster.stats()["workers"]
        new = [w for w, v in ws.items() if v["name"] == before["name"]]
        return len(ws) == 2 and new and new[0] != before["worker_id"] and ws[new[0]]

    w = wait_until(rejoined, timeout=120, every=0.25)
    assert w, "the restarted worker did not register"
    assert w["index_pages"]["device"] == 0 and not w["resyncing"]
    assert before["worker_id"] not in cluster.stats()["index_workers"]
    r = client.generate_text("The capital of France is", **GREEDY)
    assert r.usage.completion_tokens == 16


def _stream(client: Client, prompt, out: dict) -> None:
    try:
        for chunk in client.generate(prompt, temperature=0, max_tokens=48, ignore_eos=True):
            out.setdefault("chunks", []).append(chunk)
            out["first"] = True
    except Exception as e:
        out["error"] = e


def test_a_killed_worker_is_dropped_and_the_other_serves(cluster, client):
    """Last in the module: the killed worker does not come back."""
    victim = ray.get(cluster.workers[0].ready.remote())["worker_id"]
    other = ray.get(cluster.workers[1].ready.remote())["worker_id"]
    cluster.set_policy("round_robin")  # one long stream on each worker
    outs: list[dict] = [{}, {}]
    threads = [
        threading.Thread(target=_stream, args=(client, f"Story number {i}:", outs[i]))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    assert wait_until(lambda: all(o.get("first") for o in outs), timeout=60)
    ray.kill(cluster.workers[0], no_restart=True)
    gone = wait_until(
        lambda: (
            victim not in (s := cluster.stats())["workers"] and victim not in s["index_workers"]
        ),
        timeout=10,
        every=0.05,
    )
    for t in threads:
        t.join(120)
    assert gone  # dropped within wait_until's 10 s
    # the stream on the dead worker had sent tokens: it ends with UNAVAILABLE; the other
    # stream finishes on its worker
    errors = [o["error"] for o in outs if "error" in o]
    done = [o["chunks"][-1] for o in outs if "error" not in o]
    assert len(errors) == 1 and isinstance(errors[0], Unavailable), outs
    assert len(done) == 1 and done[0].finished and done[0].worker_id == other
    cluster.set_policy("prefix_affinity")
    for i in range(3):
        r = client.generate_text(f"After the failure, request {i}", **SHORT)
        assert r.worker_id == other and r.usage.completion_tokens == 2
    assert list(cluster.stats()["workers"]) == [other]
