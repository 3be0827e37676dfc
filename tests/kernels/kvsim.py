"""A tiny stand-in for the engine's cache bookkeeping, for kernel tests.

Requests own random pages of a pool larger than needed (page 0 is the null page) and, for
quantized formats, a residual slot. ``step`` turns "request i gets n new tokens" into the
write metadata the engine produces (slot_mapping, residual_slots, complete_pages,
complete_src) and remembers every token's full-precision K/V, so tests can build the
expected dense K/V independently of the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.kernels.page_format import PageLayout


@dataclass
class Req:
    pages: list[int]
    slot: int  # residual slot
    ctx: int = 0
    k: list[torch.Tensor] = field(default_factory=list)  # (H, D) per token, full precision
    v: list[torch.Tensor] = field(default_factory=list)


class KVSim:
    def __init__(
        self,
        fmt,
        *,
        H,
        D,
        bs=16,
        num_layers=2,
        layer=1,
        num_pages=40,
        num_slots=6,
        max_pages_per_req=6,
        num_reqs=3,
        seed=0,
        residual_dtype=torch.float32,
    ):
        self.g = torch.Generator().manual_seed(seed)
        self.fmt, self.H, self.D, self.bs, self.layer = fmt, H, D, bs, layer
        self.layout = PageLayout(fmt, num_layers, H, D, bs)
        self.buf = self.layout.allocate(num_pages)
        self.residual = None
        if self.layout.quantized:
            self.residual = torch.zeros(self.layout.residual_shape(num_slots), dtype=residual_dtype)
        perm = (torch.randperm(num_pages - 1, generator=self.g) + 1).tolist()
        slots = torch.randperm(num_slots, generator=self.g).tolist()
        self.reqs = [
            Req(perm[i * max_pages_per_req : (i + 1) * max_pages_per_req], slots[i])
            for i in range(num_reqs)
        ]
        self.max_pages = max_pages_per_req

    def views(self, buf=None):
        return self.layout.views(self.buf if buf is None else buf, self.layer)

    def residual_kv(self, residual=None):
        r = self.residual if residual is None else residual
        if r is None:
            return None, None
        return r[self.layer, 0], r[self.layer, 1]  # (R, bs, H, D)

    def step(self, new: list[int], dtype=torch.float32, scale=1.0):
        """New tokens per request -> (k, v (T, H, D), write kwargs). Updates ctx."""
        bs, R = self.bs, 0 if self.residual is None else self.residual.shape[2]
        ks, vs, slot_map, res_slots, pages, srcs = [], [], [], [], [], []
        t = 0
        for req, n in zip(self.reqs, new):
            k = torch.randn(n, self.H, self.D, generator=self.g) * scale
            v = torch.randn(n, self.H, self.D, generator=self.g) * scale
            k = k + torch.randn(self.H, self.D, generator=self.g)  # channel offsets, like keys
            k, v = k.to(dtype), v.to(dtype)
            old, ctx = req.ctx, req.ctx + n
            assert ctx <= self.max_pages * bs, "request outgrew its pages"
            for i in range(n):
                p = old + i
                slot_map.append(req.pages[p // bs] * bs + p % bs)
                full_after = (p // bs + 1) * bs <= ctx
                res_slots.append(-1 if full_after else req.slot * bs + p % bs)
            for j in range(old // bs, ctx // bs):  # pages that fill this step
                pages.append(req.pages[j])
                # a token written before this step waits in the residual; a new one is
                # new-token row t + (position - old), offset by the residual's R * bs rows
                page_src = [
                    req.slot * bs + o if j * bs + o < old else R * bs + t + (j * bs + o - old)
                    for o in range(bs)
                ]
                srcs.append(page_src)
            req.k += list(k.float())
            req.v += list(v.float())
            req.ctx = ctx
            ks.append(k)
            vs.append(v)
            t += n
        k, v = torch.cat(ks), torch.cat(vs)
        rk, rv = self.residual_kv()
        kw = dict(
            fmt=self.fmt,
            k=k,
            v=v,
            cache=self.views(),
            slot_mapping=torch.tensor(slot_map, dtype=torch.int64),
        )
        if self.layout.quantized:
            kw.update(
                residual_k=rk,
                residual_v=rv,
                residual_slots=torch.tensor(res_slots, dtype=torch.int64),
                complete_pages=torch.tensor(pages, dtype=torch.int64),
                complete_src=torch.tensor(srcs, dtype=torch.int64).view(-1, bs),
            )
        return kw

    def read_meta(self, reqs=None):
        """Block tables (B, P) padded with the null page, context lens, residual slots."""
        reqs = self.reqs if reqs is None else reqs
        bs = self.bs
        P = max(-(-r.ctx // bs) for r in reqs) + 1  # one spare column of padding
        tables = torch.zeros(len(reqs), P, dtype=torch.int64)
        for i, r in enumerate(reqs):
            n = -(-r.ctx // bs)
            tables[i, :n] = torch.tensor(r.pages[:n])
        ctx = torch.tensor([r.ctx for r in reqs], dtype=torch.int64)
        slots = torch.tensor(
            [r.slot if (self.layout.quantized and r.ctx % bs) else -1 for r in reqs],
            dtype=torch.int64,
        )
        return tables, ctx, slots


def expected_kv(sim: KVSim, req: Req) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache should hold for ``req``: (ctx, H, D) fp32 K and V. Full pages went
    through quantize_pages (independently of the kernels); the tail page is in the residual,
    i.e. rounded to the residual dtype; float formats are rounded to the cache dtype."""
    from kvmesh.kernels.page_format import FLOAT_FORMATS
    from kvmesh.kernels.quant import dequantize_pages, quantize_pages

    k, v = torch.stack(req.k), torch.stack(req.v)  # (ctx, H, D) fp32
    if sim.fmt in FLOAT_FORMATS:
        dt = FLOAT_FORMATS[sim.fmt]
        return k.to(dt).float(), v.to(dt).float()
    bs, full = sim.bs, req.ctx // sim.bs * sim.bs
    rdt = sim.residual.dtype
    pages = (t[:full].view(-1, bs, sim.H, sim.D) for t in (k, v))
    kq, vq = dequantize_pages(sim.fmt, quantize_pages(sim.fmt, *pages))
    k_out = torch.cat([kq.reshape(full, sim.H, sim.D), k[full:].to(rdt).float()])
    v_out = torch.cat([vq.reshape(full, sim.H, sim.D), v[full:].to(rdt).float()])
    return k_out, v_out
