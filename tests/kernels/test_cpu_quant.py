"""Full pages quantized in C (kernels/cpu_quant.c) against the torch quantizer, the twin:
the same bytes in the pool for fp8 and int8; for int4 the same bytes except where two value
clipping candidates' squared errors tie to within float rounding (the sums run in another
order), and there the error is the same. Both builds (native, portable); the engine-side
writer against write_kv_cache_torch."""

import pytest
import torch
from kvsim import KVSim

from kvmesh.kernels import cpu_native, cpu_quant
from kvmesh.kernels.cache_write import write_kv_cache_torch
from kvmesh.kernels.page_format import PageLayout
from kvmesh.kernels.quant import dequantize_pages, quantize_pages
from kvmesh.worker import envs


@pytest.fixture(scope="module", params=["native", "portable"])
def lib(request, tmp_path_factory):
    flags = cpu_native.NATIVE_FLAGS if request.param == "native" else cpu_native.PORTABLE_FLAGS
    d = tmp_path_factory.getbasetemp() / "cpu-kernels"  # shared with the other kernel tests
    return cpu_native.CpuLibrary(
        cpu_native.compile_library(build_dir=d, cc=envs.c_compiler(), flags=flags)
    )


def _pages(n, bs, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, bs, H, D, generator=g) * (0.5 + 2 * torch.rand(H, D, generator=g))
    k = k + 2 * torch.randn(H, D, generator=g)  # outlier channels, like keys
    v = torch.randn(n, bs, H, D, generator=g) * 0.7
    v[0, 0, 0, :4] = 0.0  # an exact zero, a -0.0 and values at fp8's subnormal edge
    v[0, 1, 0, 0] = -0.0
    k[0, 0, 0, :3] = torch.tensor([1e-9, 448.0 * 3, -(2.0**-9)])
    return k, v


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("H,D", [(3, 64), (2, 20), (1, 128)])
@pytest.mark.parametrize("bs", [16, 4, 2])  # int4 V: 4 or 8 groups a head-page leave idle lanes
def test_pages_in_the_pool_match_the_torch_quantizer(lib, fmt, H, D, bs):
    if fmt == "int4" and D % min(32, D):
        D = 32
    n = 5
    layout = PageLayout(fmt, 2, H, D, bs)
    k, v = _pages(n, bs, H, D, seed=H * D)
    ids = torch.tensor([7, 2, 9, 4, 11])
    buf = layout.allocate(12)
    cache = layout.views(buf, 1)
    cpu_quant.quantize_pages_into(fmt, k, v, cache, ids, library=lib)
    want = quantize_pages(fmt, k, v)
    for name, t in want.items():
        got = cache[name][ids]
        if fmt == "int4" and name.startswith("v"):
            continue  # below: equal up to clipping ties
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    if fmt == "int4":
        comps = {n: cache[n][ids] for n in want}
        same = (comps["v_scale"] == want["v_scale"]) & (comps["v_zero"] == want["v_zero"])
        assert same.float().mean() > 0.98  # ties are rare
        # where the choice differs, the error of the C choice equals the twin's to rounding
        _, v_c = dequantize_pages(fmt, comps)
        _, v_t = dequantize_pages(fmt, want)
        g = min(32, D)
        err_c = (v_c - v).view(n, bs, H, D // g, g).square().sum(-1)
        err_t = (v_t - v).view(n, bs, H, D // g, g).square().sum(-1)
        torch.testing.assert_close(err_c, err_t, rtol=1e-5, atol=1e-7)
        packed_same = (comps["v"] == want["v"]).view(n, bs, H, D // g, g // 2).all(-1)
        assert bool(packed_same[same].all())  # same parameters: same codes
    # pages not written stay zero
    others = [p for p in range(12) if p not in ids.tolist()]
    assert not buf[others].any()


def test_engine_writer_matches_write_kv_cache_torch(lib):
    """write_kv_cache_cpu over several engine steps (tails in the residual, pages completing
    from residual rows and new tokens) leaves the pool and residual as the torch writer."""
    sims = [KVSim("int8", H=2, D=32, seed=3, num_reqs=3) for _ in range(2)]
    for new in ([5, 16, 40], [11, 1, 0], [20, 3, 8]):
        kw = sims[0].step(new)
        kw2 = sims[1].step(new)
        write_kv_cache_torch(**kw)
        kw2.pop("slot_mapping")
        cpu_quant.write_kv_cache_cpu(**kw2, library=lib)
    assert torch.equal(sims[0].buf, sims[1].buf)
    assert torch.equal(sims[0].residual, sims[1].residual)


def test_bad_arguments_are_named(lib):
    layout = PageLayout("int8", 1, 2, 32, 16)
    cache = layout.views(layout.allocate(4), 0)
    k = torch.randn(1, 16, 2, 32)
    run = cpu_quant.quantize_pages_into
    with pytest.raises(ValueError, match="not a quantized cache format: 'fp32'"):
        run("fp32", k, k, cache, torch.tensor([1]), library=lib)
    with pytest.raises(ValueError, match="outside the pool's 4 pages"):
        run("int8", k, k, cache, torch.tensor([4]), library=lib)
    with pytest.raises(ValueError, match="page_ids must be int64"):
        run("int8", k, k, cache, torch.tensor([1], dtype=torch.int32), library=lib)
    with pytest.raises(ValueError, match="float32 k, v"):
        run("int8", k.half(), k.half(), cache, torch.tensor([1]), library=lib)


def test_int4_pages_are_the_same_bytes_on_every_build(libraries):
    """The int4 quantizer runs its loops across lanes (channels, value groups), vectorised on
    the native and AVX2 builds: the bytes must equal the scalar (portable) build's exactly,
    ties included (each lane sums its own group in value order), for odd lane counts too."""
    for H, D, bs, seed in (
        (3, 64, 16, 1), (2, 20, 16, 2), (1, 128, 16, 3), (5, 32, 8, 4),
        (2, 128, 32, 5),  # 128 value groups a head: a second block of lanes, a short last one
    ):  # fmt: skip
        n = 5
        layout = PageLayout("int4", 1, H, D, bs)
        k, v = _pages(n, bs, H, D, seed=seed)
        v[1, 3, 0, :] = 0.5  # a flat group: every candidate ties
        v[2, 0, 0, : D // 2] = -0.0
        ids = torch.tensor([3, 1, 6, 2, 5])
        bufs = {}
        for name, lib in libraries.items():
            buf = layout.allocate(7)
            cpu_quant.quantize_pages_into("int4", k, v, layout.views(buf, 0), ids, library=lib)
            bufs[name] = buf
        for name, buf in bufs.items():
            assert torch.equal(buf, bufs["portable"]), (name, H, D, bs)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_one_call_writer_reads_strided_rows_as_the_torch_writer(lib, fmt):
    """write_kv_cache_cpu (one C call: assemble, quantize, store the ring rows) fed k/v as the
    model hands them, column slices of a fused qkv output (rows not contiguous), over steps
    whose pages complete from the ring and new tokens alike: the torch writer's bytes."""
    H, D = 3, 64
    sims = [KVSim(fmt, H=H, D=D, seed=5, num_reqs=3) for _ in range(2)]
    for new in ([17, 1, 40], [1, 1, 1], [15, 14, 8], [1, 1, 1]):
        kw = sims[0].step(new)
        kw2 = sims[1].step(new)
        write_kv_cache_torch(**kw)
        kw2.pop("slot_mapping")
        T = kw2["k"].shape[0]
        qkv = torch.randn(T, 5 * H * D)  # q, k, v side by side, as the fused projection
        qkv[:, 3 * H * D : 4 * H * D] = kw2["k"].reshape(T, -1)
        qkv[:, 4 * H * D :] = kw2["v"].reshape(T, -1)
        kw2["k"] = qkv[:, 3 * H * D : 4 * H * D].view(T, H, D)
        kw2["v"] = qkv[:, 4 * H * D :].view(T, H, D)
        assert not kw2["k"].is_contiguous()
        cpu_quant.write_kv_cache_cpu(**kw2, library=lib)
    assert torch.equal(sims[0].residual, sims[1].residual)
    if fmt == "int8":
        assert torch.equal(sims[0].buf, sims[1].buf)
        return
    # int4: the C quantizer's bytes (the twin's up to clipping ties, test above)
    want = sims[0].views()
    got = sims[1].views()
    for name in ("k", "k_scale", "k_zero"):
        assert torch.equal(got[name], want[name]), name
    same = (got["v_scale"] == want["v_scale"]) & (got["v_zero"] == want["v_zero"])
    assert same.float().mean() > 0.98


def test_writer_names_out_of_range_indices(lib):
    sim = KVSim("int4", H=2, D=32, seed=1, num_reqs=2)
    kw = sim.step([3, 20])
    kw.pop("slot_mapping")
    before = sim.buf.clone(), sim.residual.clone()
    bad = dict(kw, complete_src=kw["complete_src"].clone())
    bad["complete_src"][0, 0] = 10**6
    with pytest.raises(ValueError, match="out of range"):
        cpu_quant.write_kv_cache_cpu(**bad, library=lib)
    bad = dict(kw, residual_slots=kw["residual_slots"].clone())
    bad["residual_slots"][0] = 10**6
    with pytest.raises(ValueError, match="out of range"):
        cpu_quant.write_kv_cache_cpu(**bad, library=lib)
    assert kw["complete_pages"].numel() > 0  # the 20-token request completes a page
    bad = dict(kw, complete_pages=kw["complete_pages"].clone())
    bad["complete_pages"][0] = 10**6  # outside the pool
    with pytest.raises(ValueError, match="out of range"):
        cpu_quant.write_kv_cache_cpu(**bad, library=lib)
    assert torch.equal(sim.buf, before[0]) and torch.equal(sim.residual, before[1])


def test_writer_rotating_v_equals_rotating_before_it(lib):
    """``v_rotation``: the writer rotates the new V rows itself (int4's Hadamard, in C), as
    the backend's separate rotation before the write did: the same pool and ring bytes, and
    the caller's v untouched."""
    from kvmesh.kernels.cpu_attention import hadamard_cpu

    H, D = 3, 64
    sims = [KVSim("int4", H=H, D=D, seed=8, num_reqs=3) for _ in range(2)]
    for new in ([17, 1, 40], [1, 1, 1], [15, 14, 8]):
        kws = [s.step(new) for s in sims]
        for kw in kws:
            kw.pop("slot_mapping")
        v0 = kws[1]["v"].clone()
        cpu_quant.write_kv_cache_cpu(**dict(kws[0], v=hadamard_cpu(kws[0]["v"], D)), library=lib)
        cpu_quant.write_kv_cache_cpu(**kws[1], library=lib, v_rotation=D)
        assert torch.equal(kws[1]["v"], v0)
    assert torch.equal(sims[0].buf, sims[1].buf)
    assert torch.equal(sims[0].residual, sims[1].residual)
    with pytest.raises(ValueError, match="v_rotation must be a power of two"):
        cpu_quant.write_kv_cache_cpu(**kws[1], library=lib, v_rotation=48)


def test_one_layer_writer_over_many_steps_is_the_torch_writer(lib):
    """The backend's path: a ``LayerWriter`` made once for a layer and one ``WriteIndices``
    per step (V rotated in the call) leave the pool and ring as the torch writer given the
    V rows rotated by the torch rotation; indices for another number of tokens are refused
    before anything is written."""
    from kvmesh.kernels.quant import hadamard_transform

    sims = [KVSim("int8", H=3, D=64, seed=6, num_reqs=3) for _ in range(2)]
    writer = None
    for new in ([5, 16, 40], [11, 1, 0], [1, 1, 1], [20, 3, 8]):
        kws = [s.step(new) for s in sims]
        write_kv_cache_torch(**dict(kws[0], v=hadamard_transform(kws[0]["v"], 64)))
        kw = kws[1]
        kw.pop("slot_mapping")
        if writer is None:
            writer = cpu_quant.LayerWriter(
                fmt="int8", cache=kw["cache"], residual_k=kw["residual_k"],
                residual_v=kw["residual_v"], library=lib,
            )  # fmt: skip
        idx = cpu_quant.WriteIndices(
            kw["residual_slots"], kw["complete_pages"], kw["complete_src"], 16
        )
        writer.write(kw["k"], kw["v"], idx, v_rotation=64)
    assert torch.equal(sims[0].buf, sims[1].buf)
    assert torch.equal(sims[0].residual, sims[1].residual)
    before = sims[1].buf.clone()
    with pytest.raises(ValueError, match=r"residual_slots must have shape \(2,\)"):
        writer.write(kw["k"][:2], kw["v"][:2], idx)
    assert torch.equal(sims[1].buf, before)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda k, v: (k[:, :1], v[:, :1]), r"k, v must be \(T, 2, 32\)"),  # a head short
        (lambda k, v: (k, v[:-1]), r"k, v must be \(T, 2, 32\)"),  # unequal token counts
        (lambda k, v: (k, v.double()), "k, v must share a float dtype"),
        (lambda k, v: (k.int(), v.int()), "k, v must share a float dtype"),
        (lambda k, v: (k.transpose(1, 2).contiguous().transpose(1, 2), v), "unit innermost"),
    ],
    ids=["heads", "tokens", "dtypes", "integer", "stride"],
)
def test_both_writers_refuse_the_same_k_v_alike(lib, bad, match):
    """The torch writer and the C layer writer check a step's k, v with one function
    (``paged_kv.check_new_kv``): the same refusal, before anything is written."""
    sim = KVSim("int8", H=2, D=32, seed=2, num_reqs=2)
    kw = sim.step([3, 20])
    kw.pop("slot_mapping")
    kw["k"], kw["v"] = bad(kw["k"], kw["v"])
    before = sim.buf.clone(), sim.residual.clone()
    with pytest.raises(ValueError, match=match):
        write_kv_cache_torch(**kw)
    writer = cpu_quant.LayerWriter(
        fmt="int8", cache=kw["cache"], residual_k=kw["residual_k"],
        residual_v=kw["residual_v"], library=lib,
    )  # fmt: skip
    idx = cpu_quant.WriteIndices(kw["residual_slots"], kw["complete_pages"], kw["complete_src"], 16)
    with pytest.raises(ValueError, match=match):
        writer.write(kw["k"], kw["v"], idx)
    assert torch.equal(sim.buf, before[0]) and torch.equal(sim.residual, before[1])
