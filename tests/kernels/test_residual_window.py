"""Decode reading a window of W residual pages (issue 23): ``residual_slots`` (B, W), entry
[b, i] the residual slot of page ``(ctx_b - 1) // bs - W + 1 + i``, -1 for a page read from
the pool. Every decode implementation (the C kernel in each build this host runs, the
Triton kernel under the interpreter, the torch twin) against the others, and the twin
against a dense fp64 reference built by hand from the known K/V, for W = 1, 2, 3.

The cache is built here, not through the write kernels: pool pages are quantized from the
sequences' true K/V (zero-padded past the context), a page that the ring names gets the
true K/V in its residual slot ``owner * W + page % W`` and its pool page is poisoned with
0xFF bytes (NaN scales), and residual slots no entry names are NaN, so a kernel that reads
a named page from the pool, or a wrong slot, returns NaN or a different result."""

import pytest
import torch
from builds import host_builds

from kvmesh.kernels import cpu_attention
from kvmesh.kernels.decode_attention import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from kvmesh.kernels.page_format import PageLayout
from kvmesh.kernels.paged_kv import residual_page_slots
from kvmesh.kernels.quant import dequantize_pages, quantize_pages

BUILDS = list(host_builds())

# (ctx, ring entries read from the pool instead): with bs = 16, a partial last page, an
# exactly full one (read from the residual too), a short sequence (fewer pages than W), -1
# entries at the front (pages restored from a prefix cache), one in the middle (a pool page
# after a residual one), a sequence with no residual page at all
SEQS = [(69, ()), (64, ()), (7, ()), (40, (0,)), (50, (1,)), (33, (0, 1, 2))]


def _ring_cache(fmt, W, seqs, *, Hkv, D, bs=16, seed=0):
    """-> (kwargs of a decode call without q/scale/window, the true K/V per sequence as read)."""
    g = torch.Generator().manual_seed(seed)
    B = len(seqs)
    n_pages = [-(-ctx // bs) for ctx, _ in seqs]
    num_pages = sum(n_pages) + 3  # page 0 is the null page; two spare
    layout = PageLayout(fmt, 1, Hkv, D, bs)
    buf = layout.allocate(num_pages)
    views = layout.views(buf, 0)
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    owners = torch.randperm(B + 1, generator=g).tolist()  # one spare ring of slots
    R = (B + 1) * W
    res_k = torch.full((R, bs, Hkv, D), float("nan"))
    res_v = torch.full((R, bs, Hkv, D), float("nan"))
    tables = torch.zeros(B, max(n_pages) + 1, dtype=torch.int64)
    slots = torch.full((B, W), -1, dtype=torch.int64)
    refs = []
    for b, ((ctx, pool), n) in enumerate(zip(seqs, n_pages)):
        k = torch.randn(n, bs, Hkv, D, generator=g) + torch.randn(Hkv, D, generator=g) * 2
        v = torch.randn(n, bs, Hkv, D, generator=g)
        k.view(-1, Hkv, D)[ctx:] = 0  # what a pool page holds past the context
        v.view(-1, Hkv, D)[ctx:] = 0
        pages, free = free[:n], free[n:]
        tables[b, :n] = torch.tensor(pages)
        comps = quantize_pages(fmt, k, v)
        for name, t in comps.items():
            views[name][pages] = t
        ref_k, ref_v = dequantize_pages(fmt, comps, torch.float32)  # what the pool reads as
        last = (ctx - 1) // bs
        for i in range(W):
            j = last - W + 1 + i
            if j < 0 or i in pool:
                continue
            s = owners[b] * W + j % W  # the ring: residual order differs from page order
            slots[b, i] = s
            res_k[s], res_v[s] = k[j], v[j]
            junk = torch.randn(2, bs, Hkv, D, generator=g) * 50  # finite, masked: never counts
            valid = min(bs, ctx - j * bs)
            res_k[s, valid:], res_v[s, valid:] = junk[0, valid:], junk[1, valid:]
            ref_k[j], ref_v[j] = k[j], v[j]
            buf[pages[j]] = 255  # the pool copy must not be read
        refs.append((ref_k.view(-1, Hkv, D)[:ctx], ref_v.view(-1, Hkv, D)[:ctx]))
    args = dict(
        fmt=fmt,
        cache=views,
        residual_k=res_k,
        residual_v=res_v,
        block_tables=tables,
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int64),
        residual_slots=slots,
    )
    return args, refs


def _dense(q, refs, scale, window=None):
    """Attention of q (B, Hq, D) over each sequence's reference K/V, in fp64."""
    outs = []
    for i, (k, v) in enumerate(refs):
        lo = 0 if window is None else max(0, k.shape[0] - window)
        G = q.shape[1] // k.shape[1]
        kk = k[lo:].double().repeat_interleave(G, 1)
        vv = v[lo:].double().repeat_interleave(G, 1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), kk) * scale
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
    return torch.stack(outs).float()


def _q(B, Hq, D, seed):
    return torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_twin_matches_dense_reference(fmt, W):
    Hq, Hkv, D = 4, 2, 32
    args, refs = _ring_cache(fmt, W, SEQS, Hkv=Hkv, D=D, seed=W)
    q = _q(len(SEQS), Hq, D, W)
    for window in (None, 20, 1):
        got = paged_decode_attention_torch(q=q, scale=0.2, sliding_window=window, **args)
        torch.testing.assert_close(got, _dense(q, refs, 0.2, window), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_triton_matches_twin(fmt, W):
    Hq, Hkv, D = 4, 2, 32
    args, refs = _ring_cache(fmt, W, SEQS, Hkv=Hkv, D=D, seed=10 + W)
    q = _q(len(SEQS), Hq, D, 10 + W)
    for window, splits in ((None, 1), (None, 3), (20, 2)):
        want = paged_decode_attention_torch(q=q, scale=0.2, sliding_window=window, **args)
        got = paged_decode_attention_triton(
            q=q, scale=0.2, sliding_window=window, num_splits=splits, **args
        )
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_cpu_kernel_matches_twin(libraries, build, fmt, W):
    """D = 64 with 4 query heads per KV head: int4 takes the vector builds' fast step on
    pool pages, split accumulators put back for a residual page and split again for a pool
    page after it (the (50, (1,)) sequence at W = 3)."""
    Hq, Hkv, D = 8, 2, 64
    args, refs = _ring_cache(fmt, W, SEQS, Hkv=Hkv, D=D, seed=20 + W)
    q = _q(len(SEQS), Hq, D, 20 + W)
    for window in (None, 20, 1):
        want = paged_decode_attention_torch(q=q, scale=0.125, sliding_window=window, **args)
        got = cpu_attention.paged_decode_attention_cpu(
            q=q, scale=0.125, sliding_window=window, library=libraries[build], **args
        )
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got, _dense(q, refs, 0.125, window), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", BUILDS)
def test_cpu_kernel_sequences_split_over_threads(libraries, build):
    """Fewer sequences than two per thread: the C kernel cuts a sequence's pages into parts;
    the ring's pages (and a pool page after one) still come from the right place."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        args, refs = _ring_cache("int4", 3, [(300, ()), (291, (1,))], Hkv=2, D=64, seed=7)
        q = _q(2, 4, 64, 7)
        for window in (None, 130):
            want = _dense(q, refs, 0.125, window)
            got = cpu_attention.paged_decode_attention_cpu(
                q=q, scale=0.125, sliding_window=window, library=libraries[build], **args
            )
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_one_dimensional_slots_keep_their_meaning(libraries):
    """(B,) slots are the W = 1 form: the partial page's slot, unread where ctx % bs == 0."""
    ctx = torch.tensor([69, 64, 7])
    one = torch.tensor([4, 2, 0])
    two = residual_page_slots(one, ctx, bs=16, num_slots=5)
    assert two.tolist() == [[4], [-1], [0]]
    args, _ = _ring_cache("int8", 1, [(69, ()), (64, (0,)), (7, ())], Hkv=2, D=32, seed=3)
    assert args["residual_slots"][1, 0] == -1
    args_1d = {**args, "residual_slots": args["residual_slots"][:, 0].clone()}
    args_1d["residual_slots"][1] = 0  # a slot for a full last page: ignored in the 1-D form
    q = _q(3, 4, 32, 3)
    for run, extra in (
        (paged_decode_attention_torch, {}),
        (paged_decode_attention_triton, {}),
        (cpu_attention.paged_decode_attention_cpu, {"library": libraries["native"]}),
    ):
        want = run(q=q, scale=0.3, **args, **extra)
        torch.testing.assert_close(run(q=q, scale=0.3, **args_1d, **extra), want)


def test_bad_residual_slots_are_named(libraries):
    args, _ = _ring_cache("int8", 2, [(40, ()), (20, ())], Hkv=2, D=32, seed=4)
    q = _q(2, 4, 32, 4)
    bad = [
        (torch.zeros(3, 2, dtype=torch.int64), "residual_slots must have shape"),
        (torch.zeros(2, 2, 1, dtype=torch.int64), "residual_slots must be int64"),
        (torch.zeros(2, 2, dtype=torch.int32), "residual_slots must be int64"),
        (torch.zeros(2, 0, dtype=torch.int64), "W >= 1"),
        (torch.tensor([[0, 1], [2, 6]]), "residual_slots name a slot >= 6"),
    ]
    for run, extra in (
        (paged_decode_attention_torch, {}),
        (paged_decode_attention_triton, {}),
        (cpu_attention.paged_decode_attention_cpu, {"library": libraries["native"]}),
    ):
        for slots, match in bad:
            with pytest.raises(ValueError, match=match):
                run(q=q, scale=0.3, **{**args, "residual_slots": slots}, **extra)


def test_ring_slots_reach_past_the_first_w_pages():
    """A sanity check of the case builder itself: the ring names pages by ``page % W``, so
    at W = 3 a 5-page sequence's last page sits in the owner's second slot, before the
    pages it follows."""
    args, _ = _ring_cache("int8", 3, [(69, ())], Hkv=1, D=32, seed=5)
    s = args["residual_slots"][0].tolist()  # pages 2, 3, 4
    assert s[0] % 3 == 2 and s[1] % 3 == 0 and s[2] % 3 == 1
    assert s[0] // 3 == s[1] // 3 == s[2] // 3
    unnamed = sorted(set(range(args["residual_k"].shape[0])) - set(s))
    assert args["residual_k"][unnamed].isnan().all() and args["residual_v"][unnamed].isnan().all()
