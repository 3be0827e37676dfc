"""The C decode kernel (kernels/cpu_attention.c) against its torch twin and a dense fp64
reference: every build the machine runs (tests/kernels/builds.py: native, AVX-512 where the
CPU has it; AVX2, native with AVX-512 turned off, where the CPU has AVX2, FMA and F16C;
portable, scalar), every cache format (float pages read as stored,
fp8/int8/int4 pages dequantized in the kernel with the tail in the residual), GQA ratios, odd
lengths, random block tables, sliding windows, head sizes off the vector width."""

import math
import os
import subprocess
import sys

import pytest
import torch
from builds import has_avx2, host_builds, is_x86, native_vector_bits
from kvsim import KVSim
from test_decode_attention import _dense_decode

from kvmesh.kernels import cpu_attention, cpu_native
from kvmesh.kernels.cache_write import write_kv_cache_torch
from kvmesh.kernels.decode_attention import paged_decode_attention_torch
from kvmesh.worker import envs

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


BUILDS = list(host_builds())  # native, AVX2 where the CPU has it, portable


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


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
# (20, 4, 64): more query heads than one AVX-512 vector (the softmax folds VW heads at a time)
@pytest.mark.parametrize(
    "Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (5, 1, 32), (4, 4, 48), (6, 2, 20), (20, 4, 64)]
)
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


def test_nan_in_a_real_key_stays_nan_for_its_heads_only(libraries):
    """A NaN in a key a sequence reads makes the heads that read it NaN, as in the torch
    twin (the softmax's exp must not turn a NaN score into a weight of 0), and leaves the
    other KV head's query heads and the other sequence as they were."""
    sim = _sim("fp32", 2, 64, [[5, 40]], seed=6)
    args = _args(sim, torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(6)), 0.3)
    sim.views()["k"][int(args["block_tables"][1, 1]), 3, 0, 7] = float("nan")
    want = paged_decode_attention_torch(**args)
    assert want[1, :2].isnan().all() and not want[1, 2:].isnan().any()
    assert not want[0].isnan().any()
    for lib in libraries.values():
        got = cpu_attention.paged_decode_attention_cpu(**args, library=lib)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, equal_nan=True)


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
    with pytest.raises(ValueError, match="reads formats"):
        run(**{**args, "fmt": "nf4"})
    with pytest.raises(ValueError, match="fewer pages"):
        run(**{**args, "context_lens": torch.tensor([10_000])})
    with pytest.raises(ValueError, match="sliding_window"):
        run(**{**args, "sliding_window": 0})


def _quant_args(sim, q, scale, window=None):
    tables, ctx, slots = sim.read_meta()
    rk, rv = sim.residual_kv()
    return dict(
        q=q,
        fmt=sim.fmt,
        cache=sim.views(),
        residual_k=rk,
        residual_v=rv,
        block_tables=tables,
        context_lens=ctx,
        residual_slots=slots,
        scale=scale,
        sliding_window=window,
    )


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
# (20, 4, 64): more query heads than one AVX-512 vector; (30, 3, 64): G = 10 > 4, so int4's
# query zero terms take more than one four-head sum tree (and the values run token-major)
@pytest.mark.parametrize(
    "Hq,Hkv,D",
    [(9, 3, 64), (8, 2, 128), (4, 2, 64), (8, 2, 64), (6, 2, 20), (20, 4, 64), (30, 3, 64)],
)
def test_quantized_pages_match_torch_twin(libraries, build, fmt, Hq, Hkv, D):
    """Quantized pages dequantized in the kernel (the same stored scales and arithmetic as the
    torch twin), the partial last page from the residual, exactly full pages with no tail.
    int4's value step keeps a KV head's accumulators in registers where they fit (AVX-512:
    G = 3 and G = 4 at D = 64, AVX2: G = 2 at D = 64) and runs token-major elsewhere: all
    covered."""
    sim = _sim(fmt, Hkv, D, [[37, 32, 1, 90], [2, 0, 0, 6]], seed=Hq + D)
    q = torch.randn(4, Hq, D, generator=torch.Generator().manual_seed(Hq * 3 + D))
    for window in (None, 20, 1):
        args = _quant_args(sim, q, 1 / math.sqrt(D), window)
        want = paged_decode_attention_torch(**args)
        got = cpu_attention.paged_decode_attention_cpu(**args, library=libraries[build])
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(
    "Hq,Hkv,D,bs",
    [(6, 2, 16, 1), (3, 3, 24, 64), (4, 1, 24, 1), (2, 2, 256, 16)],
)
def test_int4_head_sizes_off_32_and_other_block_sizes(libraries, build, Hq, Hkv, D, bs):
    """int4 with head sizes that are not a multiple of 32 (one value group of D: the vector
    builds take their memory path for the codes, or the scalar dequantizing path where D is
    off the vector width) and block sizes 1 and 64, against the torch twin."""
    pages = -(-96 // bs)  # the longest sequence: 96 tokens
    steps = [[37, 64, 1, 90], [2, 0, 0, 6]]
    sim = _sim("int4", Hkv, D, steps, seed=D + bs, bs=bs, num_pages=4 * pages + 1, max_pages=pages)
    q = torch.randn(4, Hq, D, generator=torch.Generator().manual_seed(D * 5 + bs))
    for window in (None, 20):
        args = _quant_args(sim, q, 1 / math.sqrt(D), window)
        want = paged_decode_attention_torch(**args)
        got = cpu_attention.paged_decode_attention_cpu(**args, library=libraries[build])
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("D", [128, 24])  # codes in registers (D % 32 == 0), via memory
def test_int4_wide_kv_rows_above_8192_floats(libraries, build, D):
    """Hkv * D above 8192 (the kernel once kept a page's K scales on the stack and refused
    these shapes, a ValueError mid-serving): the scales live in the heap work area now."""
    Hkv = 8192 // D + 2
    sim = _sim("int4", Hkv, D, [[5, 19]], seed=D, bs=4, num_pages=13, max_pages=6)
    q = torch.randn(2, Hkv, D, generator=torch.Generator().manual_seed(D))
    args = _quant_args(sim, q, 1 / math.sqrt(D))
    want = paged_decode_attention_torch(**args)
    got = cpu_attention.paged_decode_attention_cpu(**args, library=libraries[build])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_quantized_null_page_and_pool_poison_outside_pages(libraries):
    """The kernel reads only its sequences' pages and the residual slots it is given:
    poisoning the null page and unused residual slots with NaN changes nothing."""
    sim = _sim("int4", 2, 64, [[5, 33, 48]], seed=5, num_pages=30)
    args = _quant_args(sim, torch.randn(3, 4, 64), 0.2)
    want = paged_decode_attention_torch(**args)
    args["block_tables"] = torch.cat(
        [args["block_tables"], torch.zeros(3, 2, dtype=torch.int64)], 1
    )
    sim.buf[0] = 255  # every int4 code 15, every scale NaN
    used = {r.slot for r in sim.reqs if r.ctx % sim.bs}
    for slot in set(range(sim.residual.shape[2])) - used:
        sim.residual[:, :, slot] = float("nan")
    for lib in libraries.values():
        got = cpu_attention.paged_decode_attention_cpu(**args, library=lib)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_quantized_bad_arguments_are_named(libraries):
    sim = _sim("int8", 2, 32, [[3, 20]], seed=1)
    args = {**_quant_args(sim, torch.randn(2, 4, 32), 0.5), "library": libraries["native"]}
    run = cpu_attention.paged_decode_attention_cpu
    with pytest.raises(ValueError, match="residual_k must be contiguous float32"):
        run(
            **{
                **args,
                "residual_k": args["residual_k"].half(),
                "residual_v": args["residual_v"].half(),
            }
        )
    with pytest.raises(ValueError, match="residual_slots name a slot"):
        run(**{**args, "residual_slots": torch.tensor([99, -1])})
    with pytest.raises(ValueError, match="int8 needs residual_k"):
        run(**{**args, "residual_k": None})


def test_missing_compiler_names_the_fix(tmp_path):
    with pytest.raises(cpu_native.CpuKernelError, match="apt-get install -y gcc"):
        cpu_native.compile_library(build_dir=tmp_path, cc="/nonexistent/cc")


def test_build_is_cached_by_source_and_flags(tmp_path):
    fast = (*cpu_native.PORTABLE_FLAGS, "-O0")  # the last -O wins: builds in seconds, not 10
    a = cpu_native.compile_library(build_dir=tmp_path, cc=envs.c_compiler(), flags=fast)
    mtime = a.stat().st_mtime_ns
    assert cpu_native.compile_library(build_dir=tmp_path, cc=envs.c_compiler(), flags=fast) == a
    assert a.stat().st_mtime_ns == mtime  # found, not rebuilt
    b = cpu_native.compile_library(
        build_dir=tmp_path, cc=envs.c_compiler(), flags=(*fast, "-fno-unroll-loops")
    )
    assert b != a
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.name, b.name])  # no temps


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_the_engine_library_is_built_for_the_isa_cap(libraries, tmp_path, isa):
    """KVMESH_CPU_ISA caps the engine's build (``worker.cpu_kernels.load``), in a fresh process
    (a process loads its library once): ``avx2`` runs the 256-bit paths even on an AVX-512
    CPU, ``portable`` the scalar loops. The build comes from the directory the kernel tests
    filled, so nothing compiles here."""
    (tmp_path / "kernels").symlink_to(libraries["native"].path.parent)
    env = {**os.environ, "KVMESH_CACHE_DIR": str(tmp_path), "KVMESH_CPU_ISA": isa.upper()}
    code = "from kvmesh.worker import cpu_kernels; print(cpu_kernels.load().vector_bits)"
    if isa == "avx2" and not has_avx2():  # the cap on a CPU without AVX2: its own paths
        want = native_vector_bits()
    else:
        want = {"native": native_vector_bits(), "avx2": 256, "portable": 0}[isa]
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) == want


def test_a_bad_or_second_isa_cap_is_named(libraries, tmp_path):
    """A name outside the caps fails the engine's start, naming the variable and the choices;
    passed to ``build`` it fails that call only; a second cap in one process keeps the first
    build, with a warning that says so."""
    (tmp_path / "kernels").symlink_to(libraries["native"].path.parent)
    env = {**os.environ, "KVMESH_CACHE_DIR": str(tmp_path), "KVMESH_CPU_ISA": "avx3"}
    code = "from kvmesh.worker import cpu_kernels; print(cpu_kernels.load().vector_bits)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "KVMESH_CPU_ISA must be one of native, avx2, portable, got 'avx3'" in r.stderr
    env["KVMESH_CPU_ISA"] = "native"
    code = f"""
import logging
logging.basicConfig(level=logging.WARNING)
from pathlib import Path
from kvmesh.kernels import cpu_native
d = Path({str(tmp_path / "kernels")!r})
try:
    cpu_native.build(build_dir=d, isa="sse2")
except cpu_native.CpuKernelError as e:
    print("refused:", e)
a = cpu_native.build(build_dir=d, isa="native")
b = cpu_native.build(build_dir=d, isa="portable")
print("same:", a is b, a.vector_bits)
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "refused: unknown instruction-set cap 'sse2'" in r.stdout
    assert f"same: True {native_vector_bits()}" in r.stdout
    assert "the portable build asked for, the native build kept" in r.stderr


def test_isa_cap_names_its_flags_and_rejects_others(monkeypatch):
    # avx2 turns AVX-512 off on x86; elsewhere there is none to turn off: the native build
    want = cpu_native.AVX2_FLAGS if is_x86() else cpu_native.NATIVE_FLAGS
    assert cpu_native.isa_flags("avx2") == want
    assert cpu_native.isa_flags("portable") == cpu_native.PORTABLE_FLAGS
    assert cpu_native.isa_flags("native") == cpu_native.NATIVE_FLAGS
    with pytest.raises(cpu_native.CpuKernelError, match="native, avx2 or portable"):
        cpu_native.isa_flags("sse2")
    monkeypatch.setattr(cpu_native, "_X86", False)
    assert cpu_native.isa_flags("avx2") == cpu_native.NATIVE_FLAGS


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_few_long_sequences_split_over_threads(libraries, build, fmt):
    """Fewer sequences than two per thread: the kernel cuts each sequence's pages into parts
    (work items of their own, merged at the end). One and three sequences at 4 threads, tails
    in the residual, windows cutting the first pages: equal to the torch twin."""
    Hq, Hkv, D = 9, 3, 64
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for lens in ([300], [301, 150, 77]):
            sim = _sim(fmt, Hkv, D, [lens], seed=len(lens), num_pages=70, max_pages=20)
            q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(len(lens)))
            for window in (None, 130):
                args = (_quant_args if sim.fmt in ("int8", "int4") else _args)(
                    sim, q, 0.125, window
                )
                want = paged_decode_attention_torch(**args)
                got = cpu_attention.paged_decode_attention_cpu(**args, library=libraries[build])
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("build", BUILDS)
def test_hadamard_is_bit_equal_to_the_torch_rotation(libraries, build):
    """int4's V rotation in C (the backend's two calls per layer and step) against
    kernels.quant.hadamard_transform, bit for bit, at the engine's shapes and others; inputs
    it does not take go to the torch version; a bad block is named."""
    from kvmesh.kernels.quant import hadamard_transform

    lib = libraries[build]
    g = torch.Generator().manual_seed(21)
    # every path of the C rotation: blocks held in registers (a vector's width and up to 16
    # vectors: 8-256 on AVX2, 16-256 on AVX-512; 64 and 128 unrolled), the scalar loop for
    # the rest (1, 2, 4, 512, 1024, and everything on the portable build)
    shapes = [((16, 3, 64), 64), ((5, 9, 128), 128), ((7, 2, 96), 32), ((3, 8), 1)]
    shapes += [((9, 16), 2), ((9, 16), 4), ((9, 32), 8), ((5, 48), 16), ((3, 512), 256)]
    shapes += [((3, 1024), 512), ((2, 2048), 1024)]
    for shape, block in shapes:
        x = torch.randn(*shape, generator=g) * 10
        x.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, 3e38])
        got, want = cpu_attention.hadamard_cpu(x, block, library=lib), hadamard_transform(x, block)
        assert got.shape == x.shape and torch.equal(got.isnan(), want.isnan()), (shape, block)
        same = got.view(torch.int32) == want.view(torch.int32)  # signed zeros, infinities too
        assert (same | got.isnan()).all(), (shape, block)
    x = torch.randn(4, 64, generator=g)
    half = cpu_attention.hadamard_cpu(x.half(), 64, library=lib)  # torch's path
    assert half.dtype == torch.float16 and torch.equal(half, hadamard_transform(x.half(), 64))
    with pytest.raises(ValueError, match="power of two"):
        cpu_attention.hadamard_cpu(torch.randn(2, 48), 24, library=lib)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("H,D", [(3, 64), (2, 128), (4, 32), (1, 256), (2, 20)])
def test_int4_pages_dequantized_in_c_equal_the_torch_twin_bit_for_bit(libraries, build, H, D):
    """The own-page prefill's page read (kvmesh_dequantize_int4_pages) against
    ``dequantize_pages`` on the same pool pages, in any order and repeated: the same bits."""
    from kvmesh.kernels.cpu_quant import quantize_pages_into
    from kvmesh.kernels.page_format import PageLayout
    from kvmesh.kernels.quant import dequantize_pages

    bs, n = 16, 6
    layout = PageLayout("int4", 2, H, D, bs)
    views = layout.views(layout.allocate(10), 1)
    g = torch.Generator().manual_seed(H * D)
    k = torch.randn(n, bs, H, D, generator=g) * 3 + torch.randn(H, D, generator=g)
    v = torch.randn(n, bs, H, D, generator=g)
    lib = libraries[build]
    quantize_pages_into("int4", k, v, views, torch.tensor([8, 1, 5, 3, 9, 0]), library=lib)
    ids = torch.tensor([5, 0, 9, 9, 3])  # out of order, one twice
    want_k, want_v = dequantize_pages("int4", {c: t[ids] for c, t in views.items()})
    out_k = torch.full((7, bs, H, D), float("nan"))  # larger than the pages: rows after stay
    out_v = torch.full_like(out_k, float("nan"))
    cpu_attention.dequantize_int4_pages_cpu(views, ids, out_k[:5], out_v[:5], library=lib)
    assert torch.equal(out_k[:5], want_k) and torch.equal(out_v[:5], want_v)
    assert out_k[5:].isnan().all() and out_v[5:].isnan().all()
    with pytest.raises(ValueError, match="page ids"):
        cpu_attention.dequantize_int4_pages_cpu(
            views, torch.tensor([10]), out_k[:1], out_v[:1], library=lib
        )


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128)])
def test_output_rotation_in_the_kernel_is_the_rotation_after_it(libraries, build, Hq, Hkv, D):
    """A decode-only step over int4 pages rotates the attention output back in the decode
    call (``out_rotation``): bit for bit what the separate rotation after it gives."""
    lib = libraries[build]
    sim = _sim("int4", Hkv, D, [[37, 32, 1, 90], [2, 0, 0, 6]], seed=D)
    q = torch.randn(4, Hq, D, generator=torch.Generator().manual_seed(D + 1))
    args = _quant_args(sim, q, 1 / math.sqrt(D))
    plain = cpu_attention.paged_decode_attention_cpu(**args, library=lib)
    want = cpu_attention.hadamard_cpu(plain, D, library=lib)
    out = torch.empty_like(q)
    got = cpu_attention.paged_decode_attention_cpu(**args, library=lib, out_rotation=D, out=out)
    assert got is out and torch.equal(got, want)
    with pytest.raises(ValueError, match="out_rotation must be a power of two"):
        cpu_attention.paged_decode_attention_cpu(**args, library=lib, out_rotation=24)
    with pytest.raises(ValueError, match="out_rotation is for quantized pages"):
        fp32 = _sim("fp32", Hkv, D, [[3, 4, 1, 9]], seed=1)
        cpu_attention.paged_decode_attention_cpu(**_args(fp32, q, 0.1), out_rotation=D)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("window", [None, 250])  # 250 of 301 keys: still split
def test_output_rotation_of_a_sequence_split_over_threads(libraries, build, window):
    """One long sequence at 2 threads is split over them and its parts merged; the output
    rotation must then run after the merge: bit for bit the separate rotation after it."""
    lib = libraries[build]
    D, Hq, Hkv = 64, 9, 3
    sim = _sim("int4", Hkv, D, [[300], [1]], seed=11, num_pages=60, max_pages=40)
    q = torch.randn(1, Hq, D, generator=torch.Generator().manual_seed(12))
    args = _quant_args(sim, q, 1 / math.sqrt(D), window=window)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain = cpu_attention.paged_decode_attention_cpu(**args, library=lib)
        want = cpu_attention.hadamard_cpu(plain, D, library=lib)
        got = cpu_attention.paged_decode_attention_cpu(**args, library=lib, out_rotation=D)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)


def test_a_layer_decoder_with_the_steps_tables_is_the_one_call(libraries):
    """The backend's int4 decode path: a ``QuantLayerDecoder`` per layer (checked once) and
    one ``DecodeIndices`` per step, shared by the layers, give the same bits as
    ``paged_decode_attention_cpu`` per layer, written into ``out``; tables of another batch
    size or block size are refused by name."""
    lib = libraries["native"]
    D, Hq, Hkv = 64, 9, 3
    sim = _sim("int4", Hkv, D, [[37, 32, 1, 90], [2, 0, 0, 6]], seed=3)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, Hq, D, generator=g)
    a0 = _quant_args(sim, q, 0.125)
    other = sim.views(sim.buf.clone())  # a second layer: the same tables, other codes
    for c in ("k", "v"):
        other[c].copy_(torch.randint(0, 256, other[c].shape, generator=g, dtype=torch.uint8))
    args = [a0, dict(a0, cache=other)]
    idx = cpu_attention.DecodeIndices(
        a0["block_tables"], a0["context_lens"], a0["residual_slots"], bs=16,
        num_slots=a0["residual_k"].shape[0],
    )  # fmt: skip
    for a in args:
        want = cpu_attention.paged_decode_attention_cpu(**a, library=lib, out_rotation=D)
        dec = cpu_attention.QuantLayerDecoder(
            fmt="int4", cache=a["cache"], residual_k=a["residual_k"],
            residual_v=a["residual_v"], library=lib,
        )  # fmt: skip
        out = torch.full_like(q, float("nan"))
        got = dec.decode(q, idx, 0.125, out=out, rotation=D)
        assert got is out and torch.equal(got, want)
    with pytest.raises(ValueError, match="the step's tables are for 4 sequences"):
        dec.decode(q[:3], idx, 0.125)
    with pytest.raises(ValueError, match="out_rotation must be a power of two"):
        dec.decode(q, idx, 0.125, rotation=24)
