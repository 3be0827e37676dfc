"""The per-op dispatchers: CPU tensors take the torch twins (the CPU engine path)."""

import torch
from kvsim import KVSim

from kvmesh.kernels.cache_write import write_kv_cache, write_kv_cache_torch
from kvmesh.kernels.decode_attention import paged_decode_attention, paged_decode_attention_torch
from kvmesh.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_torch,
)


def test_cpu_dispatch_uses_the_torch_twins():
    a = KVSim("int4", H=2, D=32, seed=1)
    b = KVSim("int4", H=2, D=32, seed=1)
    for new in ([18, 4, 0], [1, 13, 2]):
        write_kv_cache(**a.step(new))
        write_kv_cache_torch(**b.step(new))
    assert torch.equal(a.buf, b.buf) and torch.equal(a.residual, b.residual)

    tables, ctx, slots = a.read_meta()
    rk, rv = a.residual_kv()
    common = dict(fmt="int4", cache=a.views(), residual_k=rk, residual_v=rv, scale=0.2)
    q = torch.randn(3, 4, 32)
    dec = dict(q=q, block_tables=tables, context_lens=ctx, residual_slots=slots, **common)
    assert torch.equal(paged_decode_attention(**dec), paged_decode_attention_torch(**dec))

    cu = torch.tensor([0, 1, 14, 16])
    pre = dict(
        q=torch.randn(16, 4, 32),
        cu_seqlens_q=cu,
        context_lens=ctx,
        block_tables=tables,
        residual_slots=slots,
        **common,
    )
    assert torch.equal(paged_prefill_attention(**pre), paged_prefill_attention_torch(**pre))
