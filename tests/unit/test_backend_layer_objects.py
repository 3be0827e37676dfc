"""The cpu backend's per-layer C writer and decoder (``TorchAttentionBackend._layer_obj``):
made once per layer cache and reused step after step, and never the reason a cache the
engine has dropped (a rebuilt pool) stays in memory; a new cache gets its own."""

import gc
import weakref

import pytest
import torch

from kvmesh.kernels import cpu_attention, cpu_quant
from kvmesh.kernels.page_format import PageLayout
from kvmesh.worker import cpu_kernels
from kvmesh.worker.attention.base import AttentionMetadata, LayerCache
from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

H, HQ, D, BS = 2, 4, 32, 16


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels must build here (a C compiler is a test requirement)"
    return lib


def _int8_cache() -> tuple[LayerCache, torch.Tensor]:
    layout = PageLayout("int8", 1, H, D, BS)
    pool = layout.allocate(4)
    residual = torch.zeros(2, 2, BS, H, D)  # (K/V, R = 2 slots, bs, H, D)
    return LayerCache("int8", layout.views(pool, 0), residual[0], residual[1]), pool


def _decode_step(be: TorchAttentionBackend, cache: LayerCache, seed: int) -> None:
    """Two requests' first tokens (pages 1 and 2, residual slots 0 and 1) as a decode step:
    each query sees only its own key, so the output is that token's V (per KV head)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HQ, D, generator=g)
    k, v = torch.randn(2, H, D, generator=g), torch.randn(2, H, D, generator=g)
    be.prepare(
        AttentionMetadata(
            slot_mapping=torch.tensor([BS, 2 * BS]),
            num_decode=2,
            decode_block_tables=torch.tensor([[1], [2]]),
            decode_context_lens=torch.tensor([1, 1]),
            prefills=[],
            block_size=BS,
            residual_slots=torch.tensor([0, BS]),  # row 0 of residual pages 0 and 1
            complete_pages=torch.zeros(0, dtype=torch.int64),
            complete_src=torch.zeros(0, BS, dtype=torch.int64),
            decode_residual_slots=torch.tensor([[0], [1]]),
        )
    )
    out = be.forward(q, k, v, cache, D**-0.5)
    assert torch.equal(cache.residual_k[:, 0], k) and torch.equal(cache.residual_v[:, 0], v)
    torch.testing.assert_close(out, v.repeat_interleave(HQ // H, dim=1), rtol=0, atol=1e-6)


def test_one_writer_per_layer_cache_and_none_kept_for_a_dropped_cache(lib, monkeypatch):
    made = []

    def counted(cls):
        def make(**kw):
            made.append(cls.__name__)
            return cls(**kw)

        return make

    monkeypatch.setattr(cpu_quant, "LayerWriter", counted(cpu_quant.LayerWriter))
    monkeypatch.setattr(
        cpu_attention, "QuantLayerDecoder", counted(cpu_attention.QuantLayerDecoder)
    )
    be = TorchAttentionBackend(native=True)
    assert be._native is not None
    cache, pool = _int8_cache()
    for seed in range(3):  # three steps over one layer cache: made and checked once
        _decode_step(be, cache, seed)
    assert sorted(made) == ["LayerWriter", "QuantLayerDecoder"]
    cache_ref, pool_ref = weakref.ref(cache), weakref.ref(pool)
    res_ref = weakref.ref(cache.residual_k)
    del cache, pool  # the engine drops the pool (e.g. rebuilds it)
    gc.collect()
    assert cache_ref() is None  # the backend holds neither the cache nor its tensors
    assert pool_ref() is None and res_ref() is None
    new, _pool = _int8_cache()  # possibly at the dead one's address, so under its id
    _decode_step(be, new, 7)  # written into and read from the new cache
    assert sorted(made) == ["LayerWriter"] * 2 + ["QuantLayerDecoder"] * 2
    # the same cache given other residual tensors gets new ones too
    new.residual_k, new.residual_v = new.residual_k.clone(), new.residual_v.clone()
    _decode_step(be, new, 8)
    assert len(made) == 6


def test_a_stale_entry_under_a_new_caches_id_is_not_reused(lib):
    """An entry whose cache is dead but still sits under the id a new cache now has (its
    reference's callback not run yet) is replaced: the new cache gets its own writer and
    decoder, and the step writes into the new cache's tensors."""
    be = TorchAttentionBackend(native=True)
    new, _pool = _int8_cache()
    old, _old_pool = _int8_cache()
    _decode_step(be, old, 1)  # entries for the old cache, under id(old)
    stale = {key: be._writers.pop(key) for key in list(be._writers)}
    dead = weakref.ref(_int8_cache()[0])  # a reference to a cache that is gone
    assert dead() is None
    for key, entry in stale.items():  # the old cache's objects, planted under id(new)
        new_key = id(new) if key == id(old) else ("decode", id(new))
        be._writers[new_key] = (dead, *entry[1:])
    _decode_step(be, new, 2)  # asserts the output and the residual write into `new`
    for key in (id(new), ("decode", id(new))):
        assert be._writers[key][0]() is new
