"""cache_salt: tenants with different salts share no cached page; a tenant hits its own.

A real worker (SmolLM2 on a loopback gRPC port) and a router in front of it, fed the worker's
own block events. Requests go through the SDK with ``cache_salt``. What a tenant could learn
of another's prompts through the cache (``usage.cached_tokens``, the router's choice) is
measured here: with different salts there is nothing to learn.
"""

from __future__ import annotations

import threading

import pytest
from helpers import hf_greedy, in_process_router

from kvmesh.cluster import Client, InvalidArgument
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.router.core import encode_event
from kvmesh.router.prefix_index import NO_MATCH
from kvmesh.worker import LLMEngine
from kvmesh.worker.server import WorkerServer

MODEL = "smollm2-135m-instruct"
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
BS = 16


class _Events:
    """The worker's block events as the router's wire rows (what the Ray shell forwards)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list = []

    def __call__(self, ev) -> None:
        with self.lock:
            self.rows.append(encode_event(ev))

    def take(self) -> list:
        with self.lock:
            rows, self.rows = self.rows, []
        return rows


@pytest.fixture(scope="module")
def cluster(smol_src):
    worker = WorkerServer(LLMEngine(MODEL, kv_cache_memory="96MiB", max_model_len=256))
    worker.start_in_thread()
    eng = worker.engine.engine
    events = _Events()
    eng.events.subscribe(events)  # before any page is cached: the stream starts at seq 0
    # optimistic entries outlive the test, so what the router inserted for a request is seen
    try:
        with in_process_router(
            worker, name="salt-worker", core_kw={"optimistic_ttl_s": 600.0}
        ) as router:
            yield worker, router, events
    finally:
        worker.stop_in_thread(grace=0)


def _prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    assert len(ids) >= 2 * BS + 1, "the prompt must fill a few pages"
    return ids


def test_tenants_share_nothing_and_a_tenant_hits_its_own_pages(cluster, hf_smol):
    worker, router, events = cluster
    eng = worker.engine.engine
    prompt = _prompt(
        eng.tokenizer,
        "The quarterly report for the northern region shows that revenue grew by eleven "
        "percent while costs fell, driven by the new logistics contract and a mild winter. "
        "The board expects that next year",
    )
    full = (len(prompt) - 1) // BS * BS  # the last token is always computed, for its logits
    # (a prompt whose greedy continuation has no EOS: hf_greedy suppresses EOS under
    # ignore_eos, the engine only does not stop at it)
    want = hf_greedy(hf_smol, prompt, GREEDY["max_tokens"])
    with Client(router.address, timeout=120) as via_router, Client(worker.address) as direct:
        a1 = via_router.generate_text(prompt, cache_salt="tenant-a", **GREEDY)
        a2 = via_router.generate_text(prompt, cache_salt="tenant-a", **GREEDY)
        b1 = via_router.generate_text(prompt, cache_salt="tenant-b", **GREEDY)
        plain = via_router.generate_text(prompt, **GREEDY)
        b2 = direct.generate_text(prompt, cache_salt="tenant-b", **GREEDY)
        c1 = direct.generate_text(prompt, cache_salt="tenant-c", **GREEDY)
        plain2 = direct.generate_text(prompt, **GREEDY)
    # a first request of each salt finds nothing, though the same prompt is cached 1-3 times
    assert a1.usage.cached_tokens == 0
    assert b1.usage.cached_tokens == 0
    assert plain.usage.cached_tokens == 0
    assert c1.usage.cached_tokens == 0
    # the same salt (or the same absence of one) hits its own pages, every full page of them
    assert a2.usage.cached_tokens == full
    assert b2.usage.cached_tokens == full
    assert plain2.usage.cached_tokens == full
    # the salt changes which pages are shared, never the answer
    for r in (a1, a2, b1, plain, b2, c1, plain2):
        assert r.token_ids == want and r.finish_reason == "length"

    # the worker's pages are the salted hashes the router computes: one set per salt
    fp = eng.model_fp
    salted = {s: hash_pages(prompt, BS, fp, cache_salt=s) for s in ("tenant-a", "tenant-b", None)}
    assert len({h for hs in salted.values() for h in hs}) == 3 * len(salted[None])
    for hs in salted.values():
        assert all(worker.engine.call(lambda e, hs=hs: e.cached_on_device(hs)))
    core = router.core
    router.call(core.publish, worker.worker_id, events.take(), None)
    wid = worker.worker_id
    for s, hs in salted.items():
        assert router.call(core.index.match, hs)[wid].device == len(hs), s
    never_sent = hash_pages(prompt, BS, fp, cache_salt="tenant-z")
    assert router.call(core.index.match, never_sent)[wid] == NO_MATCH


def test_the_router_routes_on_salted_hashes(cluster):
    worker, router, _ = cluster
    eng = worker.engine.engine
    prompt = _prompt(
        eng.tokenizer,
        "Dear support team, my order number 4471 arrived with a cracked screen and the box "
        "was open; I would like a replacement sent to my office address. Reply:",
    )
    with Client(router.address, timeout=120) as c:
        c.generate_text(prompt, cache_salt="tenant-d", max_tokens=1)
    core, wid = router.core, worker.worker_id
    salted = hash_pages(prompt, BS, eng.model_fp, cache_salt="tenant-d")
    plain = hash_pages(prompt, BS, eng.model_fp)
    # what the router recorded for the request it routed (before any event of the worker's
    # was forwarded) is the salted prefix: an unsalted request of the same text matches none
    assert router.call(core.index.match, salted)[wid].pages == len(salted)
    assert router.call(core.index.match, plain)[wid] == NO_MATCH


def test_a_bad_salt_is_invalid_argument_naming_it(cluster):
    worker, router, _ = cluster
    for addr in (worker.address, router.address):
        with Client(addr, timeout=60) as c:
            with pytest.raises(InvalidArgument, match="cache_salt"):
                c.generate_text("Hi", cache_salt="s" * 5000, max_tokens=1)
