"""The ``triton`` attention backend (kernels/ ops: Triton on CUDA, their torch twins here)
wired into the engine: same tokens as the ``torch`` backend for float caches, and the same
attention output, layer by layer, for quantized ones."""

from __future__ import annotations

import pytest
from helpers import text_prompts

from kvmesh.worker import LLM, SamplingParams
from kvmesh.worker.attention import get_backend
from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smol_llm, shakespeare):
    return text_prompts(smol_llm.tokenizer, shakespeare, [37, 50, 21])


def test_float_cache_tokens_equal_the_torch_backend(smol_llm, prompts):
    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_memory="64MiB",
        max_num_batched_tokens=40,
        attention_backend="triton",
    )
    assert llm.engine.backend.name == "triton"
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in smol_llm.generate(prompts, GREEDY)]


class _Compare(TorchAttentionBackend):
    """Runs the triton backend on a snapshot of the layer's cache, then the torch backend on
    the original, and records the largest difference of their outputs."""

    name = "compare"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.other = get_backend("triton", **kw)
        self.max_diff = 0.0
        self.steps_with_prefix = 0

    def prepare(self, meta):
        super().prepare(meta)
        self.other.prepare(meta)
        self.steps_with_prefix += any(s.context_len > s.q_len for s in meta.prefills)

    def forward(self, q, k, v, cache, scale):
        saved = {n: t.clone() for n, t in cache.views.items()}
        rk, rv = cache.residual_k.clone(), cache.residual_v.clone()
        o_triton = self.other.forward(q, k, v, cache, scale)
        for n, t in cache.views.items():
            t.copy_(saved[n])
        cache.residual_k.copy_(rk)
        cache.residual_v.copy_(rv)
        out = super().forward(q, k, v, cache, scale)
        self.max_diff = max(self.max_diff, float((out - o_triton).abs().max()))
        return out


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_attention_equals_the_torch_backend_per_layer(fmt, prompts):
    llm = LLM(
        "smollm2-135m-instruct",
        kv_cache_dtype=fmt,
        kv_cache_memory="64MiB",
        max_num_batched_tokens=40,
    )
    eng = llm.engine
    eng.backend = eng.runner.backend = _Compare(sliding_window=None)
    llm.generate(prompts, GREEDY)  # chunked prefill over residual tails, batched decode
    assert eng.backend.steps_with_prefix > 0
    assert eng.backend.max_diff < 1e-4


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="triton"):
        get_backend("cuda-magic")


def test_cpu_default_is_cpu_and_cuda_default_is_triton():
    from kvmesh.worker.attention import default_backend_name

    assert default_backend_name("cpu") == "cpu"  # torch plus kvmesh's C kernels
    assert default_backend_name("cuda") == "triton"
