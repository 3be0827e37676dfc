"""The C decode kernel (kernels/cpu_attention.c) against its torch twin and a dense fp64
reference: both builds (native, AVX-512 where the CPU has it; portable, scalar), every float
format, GQA ratios, odd lengths, random block tables, sliding windows, head sizes off the
vector width."""

import math

import pytest
import torch
from kvsim import KVSim
from test_decode_attention import _dense_decode

from kvmesh.kernels import cpu_attention, cpu_native
from kvmesh.kernels.cache_write import write_kv_cache_torch
from kvmesh.kernels.decode_attention import paged_decode_attention_torch
from kvmesh.worker import envs

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Both builds. No compiler is a failure that says how to install one, not a skip."""
    d = tmp_path_factory.mktemp("cpu-kernels")
    cc = envs.c_compiler()
    native = cpu_native.CpuLibrary(cpu_native.compile_library(build_dir=d, cc=cc))
    portable = cpu_native.CpuLibrary(
        cpu_native.compile_library(build_dir=d, cc=cc, flags=cpu_native.PORTABLE_FLAGS)
    )
    assert not portable.vectorized
    return {"native": native, "portable": portable}


def _sim(fmt, Hkv, D, steps, seed, bs=16, num_pages=40, max_pages=6):
    sim = KVSim(
        fmt,
        H=Hkv,
        D=D,
        bs=bs,
        seed=seed,
        num_reqs=len(steps[0]),
        num_pages=num_pages,
        max_pages_per_req=max_pages,
    )
    for new in steps:
        write_kv_cache_torch(**sim.step(new))
    return sim


def _args(sim, q, scale, window=None):
    tables, ctx, _ = sim.read_meta()
    return dict(
        q=q,
        fmt=sim.fmt,
        cache=sim.views(),
        block_tables=tables,
        context_lens=ctx,
        scale=scale,
        sliding_window=window,
    )


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (5, 1, 32), (4, 4, 48), (6, 2, 20)])
def test_matches_torch_twin(libraries, build, fmt, Hq, Hkv, D):
    # a tail page, exactly full pages, a single token, and one spanning every page
    sim = _sim(fmt, Hkv, D, [[37, 32, 1, 90], [1, 0, 0, 5]], seed=Hq + D)
    g = torch.Generator().manual_seed(Hq * 7 + Hkv)
    q = torch.randn(4, Hq, D, generator=g)
    for window in (None, 20, 1):
        args = _args(sim, q, 1 / math.sqrt(D), window)
        want = paged_decode_attention_torch(**args)
        got = cpu_attention.paged_decode_attention_cpu(**args, library=libraries[build])
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got, want, rtol=TOL[torch.float32], atol=TOL[torch.float32])
        dense = _dense_decode(q, sim, 1 / math.sqrt(D), window).float()
        torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_queries_and_out(libraries, dtype):
    sim = _sim("fp16", 2, 64, [[21, 50, 3]], seed=3)
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    args = _args(sim, q, 0.125)
    out = torch.full_like(q, float("nan"))
    got = cpu_attention.paged_decode_attention_cpu(**args, out=out, library=libraries["native"])
    assert got is out and not out.isnan().any()
    want = paged_decode_attention_torch(**args)
    torch.testing.assert_close(out, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_null_page_padding_is_never_read(libraries):
    """Block-table columns past a sequence's pages point at the null page; poisoning it with
    NaN must not change the result."""
    sim = _sim("fp32", 2, 64, [[5, 33]], seed=4)
    args = _args(sim, torch.randn(2, 4, 64), 0.3)
    args["block_tables"] = torch.cat(
        [args["block_tables"], torch.zeros(2, 3, dtype=torch.int64)], 1
    )
    sim.views()["k"][0] = float("nan")
    sim.views()["v"][0] = float("nan")
    for lib in libraries.values():
        got = cpu_attention.paged_decode_attention_cpu(**args, library=lib)
        assert not got.isnan().any()
        torch.testing.assert_close(
            got, _dense_decode(args["q"], sim, 0.3).float(), rtol=1e-4, atol=1e-4
        )


def test_long_contexts_many_sequences(libraries):
    """More sequences than threads, a few hundred keys each, pages scattered over the pool:
    the engine's decode shape."""
    sim = _sim("fp32", 3, 64, [[250, 301, 17, 160, 288, 64]], seed=9, num_pages=140, max_pages=20)
    q = torch.randn(6, 9, 64, generator=torch.Generator().manual_seed(9))
    args = _args(sim, q, 0.125)
    want = paged_decode_attention_torch(**args)
    for lib in libraries.values():
        got = cpu_attention.paged_decode_attention_cpu(**args, library=lib)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_bad_arguments_are_named(libraries):
    sim = _sim("fp32", 2, 32, [[3]], seed=1)
    args = {**_args(sim, torch.randn(1, 4, 32), 0.5), "library": libraries["native"]}
    run = cpu_attention.paged_decode_attention_cpu
    with pytest.raises(ValueError, match="block_tables must be int64"):
        run(**{**args, "block_tables": args["block_tables"].int()})
    with pytest.raises(ValueError, match="multiple of 2"):
        run(**{**args, "q": torch.randn(1, 3, 32)})
    with pytest.raises(ValueError, match="float formats"):
        run(**{**args, "fmt": "int8"})
    with pytest.raises(ValueError, match="fewer pages"):
        run(**{**args, "context_lens": torch.tensor([10_000])})
    with pytest.raises(ValueError, match="sliding_window"):
        run(**{**args, "sliding_window": 0})


def test_missing_compiler_names_the_fix(tmp_path):
    with pytest.raises(cpu_native.CpuKernelError, match="apt-get install -y gcc"):
        cpu_native.compile_library(build_dir=tmp_path, cc="/nonexistent/cc")


def test_build_is_cached_by_source_and_flags(tmp_path):
    a = cpu_native.compile_library(build_dir=tmp_path, cc=envs.c_compiler())
    mtime = a.stat().st_mtime_ns
    assert cpu_native.compile_library(build_dir=tmp_path, cc=envs.c_compiler()) == a
    assert a.stat().st_mtime_ns == mtime  # found, not rebuilt
    b = cpu_native.compile_library(
        build_dir=tmp_path, cc=envs.c_compiler(), flags=cpu_native.PORTABLE_FLAGS
    )
    assert b != a
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])  # no temps
