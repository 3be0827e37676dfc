"""Paged decode attention on CPU, in C (``cpu_attention.c``), without the gather copy.

The torch path gathers every page of every sequence (``index_select``) into a padded
(B, L, Hkv, D) copy, then runs SDPA over it: the KV is read, written and read again, and at
decode time that traffic is the step's largest cost after the weights. The C kernel reads
each K/V row once, in place, through the block table.

``build()`` compiles the library with the system C compiler into a build directory (the
engine passes ``$KVMESH_CACHE_DIR/kernels`` and ``$CC``, read by ``worker.envs``) under a
name keyed by the source, the compiler, the flags and the CPU's feature flags
(``-march=native`` code must not run on another CPU), then loads it with ctypes, which
releases the GIL for the call. It links OpenMP by soname, so it
shares torch's already loaded ``libgomp`` thread pool rather than starting a second one.

Float cache formats only (fp32, fp16, bf16 pages; q and the result in fp32 inside).
Where ``build()`` fails (no compiler), callers keep the torch twin,
``kernels.decode_attention.paged_decode_attention_torch``.
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

from kvmesh.kernels.page_format import FLOAT_FORMATS
from kvmesh.kernels.paged_kv import check_cache, check_index

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
ABI = 1
_SYMBOLS = {
    "fp32": "kvmesh_decode_attention_f32",
    "bf16": "kvmesh_decode_attention_bf16",
    "fp16": "kvmesh_decode_attention_f16",
}
NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
PORTABLE_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno")  # no -march: the scalar path

_lock = threading.Lock()
_default: CpuAttentionLibrary | None = None
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
    """Compile SOURCE once per (source, compiler, flags, CPU) into ``build_dir``; return
    the shared object's path. Raises CpuKernelError with the compiler's message."""
    if shutil.which(cc) is None:
        raise CpuKernelError(
            f"no C compiler ({cc!r} not found): install one (apt-get install -y gcc) or set "
            "CC; without it kvmesh uses the slower torch attention path"
        )
    parts = [SOURCE.read_bytes(), _compiler_id(cc).encode(), " ".join(flags).encode()]
    key = hashlib.sha256(b"\0".join([*parts, _cpu_flags().encode()])).hexdigest()[:16]
    out = Path(build_dir) / f"cpu_attention-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *flags, "-shared", "-fPIC", str(SOURCE), "-o", tmp, "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise CpuKernelError(
                f"compiling the CPU attention kernel failed: {' '.join(cmd)}\n"
                f"{r.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuKernelError(f"compiling the CPU attention kernel failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU attention kernel: %s", out)
    return out


class CpuAttentionLibrary:
    """A loaded build of ``cpu_attention.c``."""

    def __init__(self, path: Path):
        torch.get_num_threads()  # torch's libgomp is loaded: the kernel's OpenMP binds to it
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise CpuKernelError(f"loading the CPU attention kernel {path} failed: {e}") from e
        if lib.kvmesh_cpu_attention_abi() != ABI:
            raise CpuKernelError(f"stale CPU kernel library {path} (ABI != {ABI}): delete it")
        self.path = path
        self.vectorized = bool(lib.kvmesh_cpu_attention_vectorized())
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for fmt, name in _SYMBOLS.items():
            fn = getattr(lib, name)
            fn.argtypes = [ptr] * 6 + [i64] * 7 + [ctypes.c_float, i64, ctypes.c_int]
            fn.restype = ctypes.c_int
            self._fns[fmt] = fn
        self._lib = lib  # keeps the shared object mapped


def build(*, build_dir: Path, cc: str = "cc") -> CpuAttentionLibrary:
    """Compile (or find in ``build_dir``) and load the default, native library once per
    process. Raises CpuKernelError saying why it cannot; a failure is remembered."""
    global _default, _error
    with _lock:
        if _default is None and _error is None:
            try:
                _default = CpuAttentionLibrary(compile_library(build_dir=build_dir, cc=cc))
            except CpuKernelError as e:
                _error = str(e)
        if _default is None:
            raise CpuKernelError(_error)
        return _default


def supports(fmt: str, q: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention_cpu`` handles this cache format and query."""
    return fmt in _SYMBOLS and q.device.type == "cpu" and q.is_floating_point()


def paged_decode_attention_cpu(
    *,
    q: torch.Tensor,
    fmt: str,
    cache: dict[str, torch.Tensor],
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    library: CpuAttentionLibrary | None = None,
) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D) in q's dtype, computed in fp32, over float-format pages.

    Same contract as ``paged_decode_attention_torch`` for float formats: the keys are the
    first ``context_lens[b]`` positions of sequence b's pages (the new token's own K/V already
    written), the last ``sliding_window`` of them if given. ``library``: a specific build,
    else the one ``build()`` loaded.
    """
    if fmt not in _SYMBOLS:
        raise ValueError(f"the CPU kernel reads float formats {sorted(_SYMBOLS)}, got {fmt!r}")
    bs, Hkv, D = check_cache(fmt, cache, None, None)
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % Hkv:
        raise ValueError(f"q must be (B, Hq, {D}) with Hq a multiple of {Hkv}, got {q.shape}")
    B, Hq, _ = q.shape
    check_index(block_tables, "block_tables", (B, None))
    check_index(context_lens, "context_lens", (B,))
    k, v = cache["k"], cache["v"]
    if k.stride()[1:] != (Hkv * D, D, 1) or v.stride() != k.stride():
        raise ValueError(f"K/V views must be dense within a page, got {k.stride()} {v.stride()}")
    if k.dtype != FLOAT_FORMATS[fmt]:
        raise ValueError(f"{fmt} cache must be {FLOAT_FORMATS[fmt]}, got {k.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if B and int(block_tables.shape[1]) * bs < int(context_lens.max()):
        raise ValueError("block_tables have fewer pages than context_lens need")
    qf = q.detach().to(torch.float32).contiguous()
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    o = torch.empty((B, Hq, D), dtype=torch.float32)
    if B:
        lib = library or _default
        if lib is None:
            raise CpuKernelError("call kernels.cpu_attention.build() first")
        fn = lib._fns[fmt]
        rc = fn(
            qf.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            o.data_ptr(), B, tables.shape[1], Hq, Hkv, D, bs, k.stride(0), float(scale),
            sliding_window or 0, torch.get_num_threads(),
        )  # fmt: skip
        if rc:
            raise MemoryError("the CPU attention kernel could not allocate its score buffer")
    o = o.to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
