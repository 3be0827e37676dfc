"""kv_budget and kv_policy ride every path into the engine: the OpenAI HTTP front, the gRPC
SamplingParams, the client SDK; bad values are named."""

import pytest
from fastapi.testclient import TestClient
from test_openai_app import Backend

from kvmesh.cluster.client import build_request
from kvmesh.protos.kvmesh.v1 import inference_pb2 as ipb
from kvmesh.protos.openai_app import build_app
from kvmesh.worker.inference_servicer import sampling_from_proto


def test_http_carries_the_budget_to_the_wire():
    backend = Backend()
    with TestClient(build_app(backend)) as c:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, "kv_budget": 64}
        r = c.post("/v1/completions", json={**body, "kv_policy": "h2o"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={**body, "kv_budget": -1})
        assert r.status_code == 400 and "kv_budget" in r.text
    with_budget, without = backend.seen
    assert (with_budget.sampling.kv_budget, with_budget.sampling.kv_policy) == (64, "h2o")
    assert (without.sampling.kv_budget, without.sampling.kv_policy) == (0, "")


def test_grpc_sampling_params_carry_it_and_unset_is_the_default():
    sp = sampling_from_proto(ipb.SamplingParams(kv_budget=128, kv_policy="streaming"))
    assert (sp.kv_budget, sp.kv_policy) == (128, "streaming")
    sp = sampling_from_proto(ipb.SamplingParams())
    assert (sp.kv_budget, sp.kv_policy) == (None, None)
    with pytest.raises(ValueError, match="kv_policy must be one of"):
        sampling_from_proto(ipb.SamplingParams(kv_budget=128, kv_policy="lru"))
    with pytest.raises(ValueError, match="kv_budget must be an integer"):
        sampling_from_proto(ipb.SamplingParams(kv_budget=3))


def test_the_client_sdk_sends_it():
    req = build_request("hello", max_tokens=4, kv_budget=256, kv_policy="snapkv")
    assert (req.sampling.kv_budget, req.sampling.kv_policy) == (256, "snapkv")


@pytest.mark.parametrize(
    "kwargs,needle",
    [(dict(kv_budget=3), "kv_budget must be"), (dict(kv_budget=64, kv_policy="lru"), "kv_policy")],
)
def test_a_bad_engine_default_fails_before_loading(kwargs, needle, monkeypatch):
    import kvmesh.worker.engine as engine_mod
    from kvmesh.worker import LLMEngine

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(engine_mod, "load_config", no_load)
    with pytest.raises(ValueError, match=needle):
        LLMEngine("smollm2-135m-instruct", **kwargs)
