"""KV eviction in operation, on the real SmolLM2 weights (fp32): a fault in one request's
eviction fails that request alone, a first compaction put off for want of pages keeps
SnapKV's vote, the observed attention leaves the device once per step, a request opts out
of the engine's default budget with kv_policy="none", and the eviction metrics count what
the engine did (with the deferred compaction)."""

import pytest
import torch
from helpers import text_prompts
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.worker import LLM, SamplingParams
from kvmesh.worker.config import EvictionConfig
from kvmesh.worker.eviction import manager as manager_mod

BS = 16


def _greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm():
    # no prefix cache: two runs of one prompt compute the same tensors in the same chunks
    return LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        kv_cache_memory="32MiB",
        max_num_batched_tokens=128,
        block_size=BS,
        enable_prefix_caching=False,
    )


@pytest.fixture(scope="module")
def prompts(llm, shakespeare):
    return text_prompts(llm.tokenizer, shakespeare, [80, 72])


def _samples(registry, label="policy") -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, s.labels.get(label))] = s.value
    return out


def _run_all(llm, items):
    """Add every (ids, params), step to the end; returns (requests, final outputs by id)."""
    eng = llm.engine
    reqs = [eng.make_request(ids, sp) for ids, sp in items]
    for r in reqs:
        eng.add(r)
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    return reqs, final


# the bystander observes every query (H2O) and is compacted after its prompt, in the very
# steps where the victim's eviction fails
B_PARAMS = _greedy(4, kv_budget=48, kv_policy="h2o")


@pytest.fixture(scope="module")
def b_alone(llm, prompts):
    return llm.generate([prompts[1]], B_PARAMS)[0]


@pytest.mark.parametrize("where", ["observe", "compact"])
def test_a_fault_in_one_requests_eviction_fails_it_alone(llm, prompts, b_alone, monkeypatch, where):
    """An exception in one request's attention observation (H2O observes every query) or in
    its compaction finishes it with finish_reason "error"; the other request of the same
    batch, observed and compacted too, gets the tokens it gets alone, no page is leaked and
    the failure is counted. The victim's prompt is prefilled in two chunks (the bystander's
    72 tokens take most of the first step's 128), so its observation fails mid-prefill,
    before it is sampled: the engine finishes it from ``pop_failures``. Its compaction fails
    once its prefill is done, in the step that samples it."""
    a_ids, b_ids = prompts
    eng = llm.engine
    mgr = eng.eviction
    free0 = eng.kv.num_free_pages
    victim = {}
    if where == "observe":
        orig = mgr._observe_one

        def faulty(ob, layer, *a):
            if ob.req is victim.get("req") and layer == 3:
                raise RuntimeError("injected fault")
            return orig(ob, layer, *a)

        monkeypatch.setattr(mgr, "_observe_one", faulty)
    else:
        orig = mgr._write

        def faulty(req, *a):
            if req is victim.get("req"):
                raise torch.cuda.OutOfMemoryError("injected out of memory")
            return orig(req, *a)

        monkeypatch.setattr(mgr, "_write", faulty)
    popped = []  # what the engine's mid-prefill failure path finished, by step
    orig_pop = mgr.pop_failures

    def spy_pop():
        out = orig_pop()
        popped.append([r.request_id for r in out])
        return out

    monkeypatch.setattr(mgr, "pop_failures", spy_pop)
    reg = eng.metrics.registry
    before = _samples(reg, "finished_reason")
    b = eng.make_request(b_ids, B_PARAMS)
    a = eng.make_request(a_ids, _greedy(4, kv_budget=32, kv_policy="h2o"))
    victim["req"] = a
    eng.add(b)  # first: its whole prompt goes in step 1, the victim's only in part
    eng.add(a)
    final, step_of = {}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
                step_of[o.request_id] = len(popped)  # steps run so far
    out_a, out_b = final[a.request_id], final[b.request_id]
    assert out_a.finish_reason == "error" and out_a.token_ids == []
    assert "KV eviction" in out_a.error and "kv_policy='h2o'" in out_a.error
    assert ("injected fault" if where == "observe" else "injected out of memory") in out_a.error
    if where == "observe":  # finished mid-prefill, in step 1, by the engine's pop_failures
        assert popped[0] == [a.request_id], popped
        assert step_of[a.request_id] == 1  # not left to fail when sampled, a step later
    else:  # failed in the step that sampled it: nothing left for pop_failures
        assert not any(popped), popped
    assert out_b.finish_reason == "length" and out_b.token_ids == b_alone.token_ids
    assert b.num_evicted > 0  # the bystander was compacted, next to the failure
    assert eng.kv.num_free_pages == free0  # the failed compaction's private pages came back
    assert not mgr.failures
    after = _samples(reg, "finished_reason")
    key = "kvmesh:request_success_total"
    assert after[(key, "error")] - before.get((key, "error"), 0) == 1
    assert after[(key, "length")] - before.get((key, "length"), 0) == 1


def test_a_deferred_first_compaction_keeps_snapkvs_vote(llm, prompts, monkeypatch):
    """With no free pages at the end of the prompt, the first compaction waits; when it runs
    a step later, it still votes over the prompt (the window's pooled votes), the token
    generated since joins the kept set, and only then is the request past its first
    compaction. Without this, the retry ranked raw decode-time scores and lost the vote."""
    ids, _ = prompts
    budget = 48  # the prompt (80) is past budget + one page: a decode compaction would run too
    sp = _greedy(3, kv_budget=budget, kv_policy="snapkv")
    mgr = llm.engine.eviction
    seen = []
    orig_select = mgr._select

    def spy(req, st, n, first):
        keep, scores = orig_select(req, st, n, first)
        seen.append((n, first, keep.clone()))
        return keep, scores

    monkeypatch.setattr(mgr, "_select", spy)
    _run_all(llm, [(ids, sp)])
    n0, first0, on_time = seen[0]
    assert (n0, first0) == (80, True)

    seen.clear()
    kv = llm.engine.kv
    orig_take = kv.take_private_pages
    calls = []

    def no_pages_once(n):
        calls.append(n)
        return None if len(calls) == 1 else orig_take(n)

    monkeypatch.setattr(kv, "take_private_pages", no_pages_once)
    deferred0 = mgr.num_deferred
    reg = llm.engine.metrics.registry
    before = _samples(reg)
    (req,), _ = _run_all(llm, [(ids, sp)])
    assert mgr.num_deferred == deferred0 + 1
    after = _samples(reg)
    n1, first1, late = seen[1]  # seen[0]: the attempt that found no pages
    assert (n1, first1) == (81, True)
    assert late.shape[-1] == budget
    window = set(range(80 - 32, 80))
    for layer in range(late.shape[0]):
        for h in range(late.shape[1]):
            kept = set(late[layer, h].tolist())
            assert 80 in kept  # the generated token
            assert window <= kept  # the observation window
            # the prompt slots kept are those the on-time vote kept (less the lowest one)
            assert kept - {80} <= set(on_time[layer, h].tolist()), (layer, h)
    assert req.num_evicted == 81 - budget

    # the eviction metrics count it: one compaction of 33 tokens, one put off, all SnapKV's
    def delta(name, policy="snapkv"):
        return after[(name, policy)] - before[(name, policy)]

    assert delta("kvmesh:kv_compactions_total") == 1
    assert delta("kvmesh:kv_evicted_tokens_total") == 81 - budget
    assert delta("kvmesh:kv_compactions_deferred_total") == 1
    assert ("kvmesh:kv_compactions_total", "h2o") in after  # every policy, from the start
    assert delta("kvmesh:kv_compactions_total", "h2o") == 0


def test_the_observed_attention_leaves_the_device_once_per_step(llm, prompts, monkeypatch):
    """H2O observes every query of every layer; the step's weights are moved to the
    request's scores in one copy per step, not one per layer (a sync each on CUDA)."""
    ids, _ = prompts
    copies = []
    orig = manager_mod._to_host

    def counting(x):
        copies.append(x.numel())
        return orig(x)

    monkeypatch.setattr(manager_mod, "_to_host", counting)
    steps = []
    eng = llm.engine
    req = eng.make_request(ids, _greedy(4, kv_budget=512, kv_policy="h2o"))  # never compacts
    eng.add(req)
    while eng.has_unfinished_requests():
        eng.step()
        steps.append(len(copies))
    L = llm.engine.model_config.num_layers
    assert L > 1
    # one prefill step and three decode steps observed, one copy each (of all the layers)
    assert copies and len(copies) == len(steps) == 4
    assert steps == [1, 2, 3, 4]
    assert copies[-1] == L * llm.engine.model_config.num_kv_heads * (80 + 3)


def test_kv_policy_none_opts_out_of_the_engine_default(llm, prompts, monkeypatch):
    ids, _ = prompts
    base = llm.generate([ids], _greedy(4))[0]
    monkeypatch.setattr(llm.engine, "eviction_config", EvictionConfig(32, "streaming"))
    (dflt, out_out), final = _run_all(llm, [(ids, _greedy(4)), (ids, _greedy(4, kv_policy="none"))])
    assert (dflt.kv_budget, dflt.kv_policy) == (32, "streaming") and dflt.num_evicted > 0
    assert (out_out.kv_budget, out_out.kv_policy, out_out.num_evicted) == (None, None, 0)
    assert final[out_out.request_id].token_ids == base.token_ids
