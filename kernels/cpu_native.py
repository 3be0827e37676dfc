"""Build and load kvmesh's C kernels for CPUs (``cpu_attention.c``, ``cpu_ops.c``,
``cpu_quant.c``).

``build()`` compiles the sources into one shared library with the system C compiler, in a
build directory (the engine passes ``$KVMESH_CACHE_DIR/kernels`` and ``$CC``, read by
``worker.envs``), under a name keyed by the sources, the compiler, the flags and the CPU's
feature flags (``-march=native`` code must not run on another CPU), then loads it with
ctypes, which releases the GIL for each call. The library links OpenMP by soname, so it
shares torch's already loaded ``libgomp`` thread pool rather than starting a second one.

``-ffp-contract=off``: no fused multiply-adds the torch kernels don't use, so each product
and sum rounds as torch's does (rotary is bit-equal to its twin; RMSNorm's sum order and
SiLU's ``exp`` still differ in the last bit). The attention kernel's FMAs are explicit.
Where the build fails (no compiler), callers keep the torch twins.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(n) for n in ("cpu_attention.c", "cpu_ops.c", "cpu_quant.c")
)
ABI = 7
NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
PORTABLE_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")  # scalar paths
# the AVX2 (+FMA, F16C) path on an AVX-512 machine (tests, KVMESH_CPU_ISA=avx2): native with
# AVX-512 turned off
AVX2_FLAGS = (*NATIVE_FLAGS, "-mno-avx512f")
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def isa_flags(isa: str) -> tuple[str, ...]:
    """The build flags of an instruction-set cap (``worker.envs.cpu_isa``): ``native``,
    ``avx2`` or ``portable``. A cap, not a demand: ``avx2`` off x86 (no AVX-512 to turn off)
    is the native build. CpuKernelError for another name."""
    if isa == "avx2" and not _X86:
        isa = "native"
    flags = {"native": NATIVE_FLAGS, "avx2": AVX2_FLAGS, "portable": PORTABLE_FLAGS}.get(isa)
    if flags is None:
        raise CpuKernelError(f"unknown instruction-set cap {isa!r}: native, avx2 or portable")
    return flags


# glibc on x86-64 ships libmvec, vector versions of expf & co. that let loops vectorise
_MVEC = platform.machine() in ("x86_64", "AMD64") and platform.libc_ver()[0] == "glibc"
_LIBS = ("-DKVMESH_LIBMVEC", "-lmvec", "-lm") if _MVEC else ("-lm",)

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# symbol -> argument types; every function returns int (0 = done)
SIGNATURES = {
    **{
        f"kvmesh_decode_attention_{t}": [_P] * 6 + [_I] * 7 + [_F, _I, _N]
        for t in ("f32", "bf16", "f16")
    },
    # (fmt, q, k, k_scale, k_zero, v, v_scale, v_zero, residual k, v, tables, lens, slots,
    #  out, B, P, residual pages W (slots is (B, W)), Hq, Hkv, D, bs, page stride in bytes, scale,
    #  window, threads)
    "kvmesh_decode_attention_quant": [_N] + [_P] * 13 + [_I] * 8 + [_F, _I, _N],
    # the same, then the output rotated (int4's V Hadamard): + (rotation block, its scale)
    "kvmesh_decode_attention_quant_rot": [_N] + [_P] * 13 + [_I] * 8 + [_F, _I, _N, _I, _F],
    # (fmt, k, v, n, bs, H, D, page ids, 6 component bases, page stride in bytes, threads)
    "kvmesh_quantize_pages": [_N, _P, _P] + [_I] * 4 + [_P] * 7 + [_I, _N],
    # (fmt, k, v, k row stride, v row stride, T, residual rows, residual k, v, R, n, complete
    #  pages, complete src, pool pages, bs, H, D, 6 component bases, page stride in bytes,
    #  threads, V rotation block (0: none), its scale)
    "kvmesh_write_kv_quant": [_N, _P, _P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P]
    + [_I] * 4
    + [_P] * 6
    + [_I, _N, _I, _F],
    # (k, k_scale, k_zero, v, v_scale, v_zero, page stride in bytes, page ids, n, bs, H, D,
    #  k out, v out, threads)
    "kvmesh_dequantize_int4_pages": [_P] * 6 + [_I, _P] + [_I] * 4 + [_P, _P, _N],
    # (x, out, rows, D, block, scale, threads)
    "kvmesh_hadamard_f32": [_P, _P, _I, _I, _I, _F, _N],
    # (residual k, v, R, ring pages, their count, bs, k, row stride, v, row stride, n, head,
    #  lx, H * D, D, k out, v out, V rotation block (0: none), its scale)
    "kvmesh_exact_rows_f32": [_P, _P, _I, _P, _I, _I, _P, _I, _P, _I] + [_I] * 5 + [_P, _P, _I, _F],
    "kvmesh_rmsnorm_f32": [_P, _P, _P, _I, _I, _F, _N],
    # (pool, its pages, page bytes, page ids, payload addresses, n, threads)
    "kvmesh_copy_pages": [_P, _I, _I, _P, _P, _I, _N],
    "kvmesh_add_rmsnorm_f32": [_P, _P, _P, _P, _I, _I, _F, _N],
    "kvmesh_rotary_f32": [_P, _P, _P, _I, _I, _I, _I, _N],
    "kvmesh_silu_mul_f32": [_P, _P, _I, _I, _N],
    # (q, q row stride, k, k row stride, v, v row stride, out, n, ctx, Hq, Hkv, D, scale, bq,
    #  bk, force_scalar, threads)
    "kvmesh_prefill_attention_f32": [_P, _I, _P, _I, _P, _I, _P] + [_I] * 5 + [_F, _I, _I, _N, _N],
    # (q, its row stride, k A, row stride, v A, row stride, keys in A, k B, row stride, v B,
    #  row stride, keys in B, ranges (n, 4), out, n, Hq, Hkv, D, scale, bq, bk, run A's V
    #  rotation block (0: none), its scale, force_scalar, threads)
    "kvmesh_prefill_attention_runs_f32": [_P, _I, _P, _I, _P, _I, _I, _P, _I, _P, _I, _I, _P, _P]
    + [_I] * 4
    + [_F, _I, _I, _I, _F, _N, _N],
    # (q, its row stride, run A's 6 int4 component bases, page stride in bytes, page ids, pages,
    #  pool pages, bs, k B, row stride, v B, row stride, keys in B, ranges (n, 4), out, n, Hq,
    #  Hkv, D, scale, bq, bk, run A's V rotation block (0: none), its scale, force_scalar,
    #  threads)
    "kvmesh_prefill_attention_runs_int4_f32": [_P, _I]
    + [_P] * 6
    + [_I, _P, _I, _I, _I, _P, _I, _P, _I, _I, _P, _P]
    + [_I] * 4
    + [_F, _I, _I, _I, _F, _N, _N],
}

_lock = threading.Lock()
_default: CpuLibrary | None = None
_default_isa: str | None = None  # the cap _default was built for
_error: str | None = None  # why the default library failed to build or load, once tried


class CpuKernelError(RuntimeError):
    """The C kernels could not be built or loaded; the message says why."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_id(cc: str) -> str:
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        return r.stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return cc


def compile_library(
    *, build_dir: Path, cc: str = "cc", flags: tuple[str, ...] = NATIVE_FLAGS
) -> Path:
    """Compile SOURCES once per (sources, compiler, flags, CPU) into ``build_dir``; return
    the shared object's path. Raises CpuKernelError with the compiler's message."""
    if shutil.which(cc) is None:
        raise CpuKernelError(
            f"no C compiler ({cc!r} not found): install one (apt-get install -y gcc) or set "
            "CC; without it kvmesh runs the slower torch paths"
        )
    parts = [*(s.read_bytes() for s in SOURCES), _compiler_id(cc).encode()]
    parts += [" ".join((*flags, *_LIBS)).encode(), _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out = Path(build_dir) / f"kvmesh_cpu-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *flags, "-shared", "-fPIC", *map(str, SOURCES), "-o", tmp, *_LIBS]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise CpuKernelError(
                f"compiling kvmesh's CPU kernels failed: {' '.join(cmd)}\n"
                f"{r.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuKernelError(f"compiling kvmesh's CPU kernels failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built kvmesh's CPU kernels: %s", out)
    return out


class CpuLibrary:
    """A loaded build: ``lib.fn(name)`` is the ctypes function, arguments typed."""

    def __init__(self, path: Path):
        torch.get_num_threads()  # torch's libgomp is loaded: the library's OpenMP binds to it
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise CpuKernelError(f"loading kvmesh's CPU kernels {path} failed: {e}") from e
        if lib.kvmesh_cpu_abi() != ABI:
            raise CpuKernelError(f"stale CPU kernel library {path} (ABI != {ABI}): delete it")
        self.path = path
        self.vector_bits = int(lib.kvmesh_cpu_attention_vectorized())  # 512, 256 or 0
        self.vectorized = self.vector_bits > 0
        self._fns = {}
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:  # a build of older sources (bench --baseline-ref): fn(name) fails
                continue
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        self._lib = lib  # keeps the shared object mapped

    def fn(self, name: str):
        return self._fns[name]


def build(*, build_dir: Path, cc: str = "cc", isa: str = "native") -> CpuLibrary:
    """Compile (or find in ``build_dir``) and load the default library once per process, for
    the instruction-set cap ``isa`` (``isa_flags``; the first call's cap holds for the
    process). Raises CpuKernelError saying why it cannot; a failure is remembered."""
    global _default, _default_isa, _error
    flags = isa_flags(isa)  # an unknown cap fails this call only, not the process's library
    if isa == "avx2" and flags == NATIVE_FLAGS:
        isa = "native"  # what was built: no AVX-512 to turn off
    with _lock:
        if _default is None and _error is None:
            try:
                _default = CpuLibrary(compile_library(build_dir=build_dir, cc=cc, flags=flags))
                _default_isa = isa
                bits = _default.vector_bits
                log.info(
                    "kvmesh's CPU kernels: %s build, %s",
                    isa, f"{bits}-bit vector paths" if bits else "scalar loops",
                )  # fmt: skip
            except CpuKernelError as e:
                _error = str(e)
        if _default is None:
            raise CpuKernelError(_error)
        if isa != _default_isa:
            log.warning(
                "kvmesh's CPU kernels: the %s build asked for, the %s build kept (the first "
                "build holds for the process)", isa, _default_isa,
            )  # fmt: skip
        return _default


def default_library() -> CpuLibrary:
    """The library ``build()`` loaded; CpuKernelError if it has not (or could not)."""
    if _default is None:
        raise CpuKernelError(_error or "call kernels.cpu_native.build() first")
    return _default
